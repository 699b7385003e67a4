"""Fast conversion parity (litgpt-style): a tiny `PretrainModel` exported with the state-dict adapter
loads into `transformers.BertForMaskedLM` and gives the same logits; Hugging Face weights imported
with the inverse adapter give our model the same logits; both directions round-trip."""
from __future__ import annotations

import pytest
import torch

from pipeline.export.hf_adapter import bert_config, from_hf, to_hf
from pipeline.model.build import build_pretrain_model
from pipeline.model.encoder import build_encoder_config

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def _ours(objectives=None, seed=0):
    encoder = build_encoder_config("tiny", vocab_size=61, max_position=24)
    return build_pretrain_model(encoder, objectives or {"mlm": 1.0}, SPECIAL, {}, seed=seed, kernels="torch").eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 61, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 15:], mask[1, 15:] = SPECIAL["pad"], 0  # padding must agree too
    return ids, mask


def _our_logits(model, ids, mask):
    with torch.no_grad():
        return model.cls(model.bert(ids, mask).last_hidden)


def _hf(model_cls=None, seed=1):
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    return (model_cls or BertForMaskedLM)(bert_config(_ours().config, SPECIAL)).eval()


def test_export_gives_bert_for_masked_lm_the_same_logits():
    ours = _ours()
    hf = _hf()
    missing, unexpected = hf.load_state_dict(to_hf(ours.state_dict()), strict=False)
    assert unexpected == [] and set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    hf.tie_weights()
    ids, mask = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(theirs, _our_logits(ours, ids, mask), rtol=1e-5, atol=1e-5)


def test_import_from_bert_for_masked_lm_gives_our_model_the_same_logits():
    hf = _hf(seed=3)
    state, unused = from_hf(hf.state_dict())
    ours = _ours(seed=4)  # different init: every encoder/head weight must be overwritten
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == [] and set(unused) <= {"cls.predictions.decoder.weight",
                                                                  "cls.predictions.decoder.bias"}
    ids, mask = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(_our_logits(ours, ids, mask), theirs, rtol=1e-5, atol=1e-5)


def test_import_from_bert_model_fills_the_encoder_and_reports_the_pooler():
    from transformers import BertModel

    hf = _hf(BertModel, seed=5)
    state, unused = from_hf(hf.state_dict())
    assert sorted(unused) == ["pooler.dense.bias", "pooler.dense.weight"]
    ours = _ours(seed=6)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == [k for k in ours.state_dict() if k.startswith("cls.")
                                            and k != "cls.predictions.decoder.weight"]  # the head stays fresh
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours.bert(ids, mask).last_hidden, hf(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("objectives", [{"mlm": 1.0}, {"mlm": 1.0, "capt": 1.0}])
def test_adapters_round_trip(objectives):
    ours = _ours(objectives)
    state = ours.state_dict()
    back, unused = from_hf(to_hf(state))
    assert unused == []
    expected = {k for k in state if k.startswith(("bert.", "cls."))}
    assert set(back) == expected and all(torch.equal(back[k], state[k]) for k in back)


def test_import_from_bert_for_pretraining_with_legacy_layernorm_names():
    """The original `bert-base-*` checkpoints: `BertForPreTraining` (MLM + next-sentence head, pooler)
    with TensorFlow-era `LayerNorm.gamma` / `.beta` names. The NSP head and pooler are unused."""
    from transformers import BertForPreTraining

    torch.manual_seed(8)
    hf = BertForPreTraining(bert_config(_ours().config, SPECIAL)).eval()
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in hf.state_dict().items()}
    assert any(k.endswith("LayerNorm.gamma") for k in legacy)
    state, unused = from_hf(legacy)
    assert {k for k in unused if "seq_relationship" in k or "pooler" in k} == {
        "cls.seq_relationship.weight", "cls.seq_relationship.bias", "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    ours = _ours(seed=9)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == []
    ids, mask = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).prediction_logits
    torch.testing.assert_close(_our_logits(ours, ids, mask), theirs, rtol=1e-5, atol=1e-5)
