"""Fast conversion parity (litgpt-style): a tiny `PretrainModel` exported with the state-dict adapter
loads into `transformers.BertForMaskedLM` and gives the same logits; Hugging Face weights imported
with the inverse adapter give our model the same logits; both directions round-trip."""
from __future__ import annotations

import pytest
import torch

from pipeline.export.hf_adapter import bert_config
from pipeline.model.hf_names import from_hf, to_hf
from pipeline.pretrain.build import build_pretrain_model
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


# ---- the MLM head trained with sampled negatives: exported as p(v | c) ∝ q(v) exp s(v, c) ----------

def _nce(objectives, options=None, counts_seed=0):
    import numpy as np

    from pipeline.pretrain.build import fill_unigram_tensors

    encoder = build_encoder_config("tiny", vocab_size=61, max_position=24)
    model = build_pretrain_model(encoder, objectives, SPECIAL, options or {}, seed=2, kernels="torch").eval()
    with torch.no_grad():  # a trained-looking bias, so "unchanged" and "corrected" cannot coincide
        model.cls.predictions.decoder.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    counts = np.random.RandomState(counts_seed).zipf(1.5, 61).clip(max=5000)
    fill_unigram_tensors(model, counts, output_biases=False)
    return model


def test_an_nce_only_head_is_exported_as_the_masked_lm_its_scores_imply():
    from pipeline.export.hf_adapter import split_for_hf

    model = _nce({"mlm-nce": 1.0, "infoword": 1.0})
    state = model.state_dict()
    log_q = state["objectives.mlm-nce.sampler.log_proposal"]
    assert log_q.std() > 1.0
    export = split_for_hf(model, state)
    assert export.head_bias.corrected and export.head_bias.objectives == {"mlm-nce": "sampled_softmax",
                                                                          "infoword": "sampled_softmax"}
    assert torch.equal(export.main["cls.predictions.bias"], state["cls.predictions.decoder.bias"] + log_q)
    assert torch.equal(state["cls.predictions.decoder.bias"], model.cls.predictions.decoder.bias)  # state untouched
    assert not any(k.endswith("log_proposal") for k in export.dropped_buffers)  # folded into the bias
    hf = _hf()
    hf.load_state_dict(export.main, strict=False)
    hf.tie_weights()
    ids, mask = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(theirs, _our_logits(model, ids, mask) + log_q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("objectives, options, corrected, note", [
    ({"mlm-nce": 1.0}, {"mlm-nce": {"negatives": "uniform"}}, True, "q is uniform"),
    ({"mlm": 1.0, "mlm-nce": 1.0}, {}, False, "full softmax (mlm) and with sampled negatives (mlm-nce)"),
    ({"mlm-nce": 1.0, "infoword": 1.0}, {"mlm-nce": {"negatives": "uniform"}}, False, "different log q"),
    ({"mlm": 1.0, "capt": 1.0}, {}, None, None),
    ({"mlm": 0.0, "mlm-nce": 1.0}, {}, True, "trained with sampled negatives (mlm-nce;"),  # mlm trains nothing
])
def test_the_head_bias_is_corrected_only_where_one_masked_lm_is_implied(objectives, options, corrected, note):
    """Uniform negatives: log q = 0 (no change). A full softmax on the same head, or NCE objectives with
    different proposals: not corrected, and said so. No NCE objective: nothing to say. An objective of
    weight 0 trains nothing."""
    from pipeline.export.hf_adapter import split_for_hf

    model = _nce(objectives, options)
    state = model.state_dict()
    export = split_for_hf(model, state)
    log_q = state["objectives.mlm-nce.sampler.log_proposal"] if corrected else 0.0
    assert torch.equal(export.main["cls.predictions.bias"], state["cls.predictions.decoder.bias"] + log_q)
    if corrected is None:
        assert export.head_bias is None
        return
    assert export.head_bias.corrected is corrected and note in export.head_bias.note


def test_a_checkpoint_without_log_q_converts_as_before_with_a_note():
    from pipeline.export.hf_adapter import split_for_hf

    model = _nce({"mlm-nce": 1.0})
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("log_proposal")}
    export = split_for_hf(model, state)
    assert not export.head_bias.corrected and "predates" in export.head_bias.note
    assert torch.equal(export.main["cls.predictions.bias"], state["cls.predictions.decoder.bias"])


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_parameter_outside_the_known_prefixes_is_refused_by_either_familys_export(family):
    """Every trained parameter must land in the HF model or beside it as an objective head: one that is
    neither (a module added outside `objectives.*`) stops the export with its name, not dropped silently."""
    from pipeline.export.hf_adapter import split_for_hf
    from pipeline.export.modernbert_adapter import split_modernbert_for_hf
    from pipeline.model.hf_names import ExportError
    from pipeline.model.modernbert import ModernBertConfig

    if family == "bert":
        model, split = _ours({"mlm": 1.0, "capt": 1.0}), split_for_hf
    else:
        encoder = ModernBertConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, ffn_size=40,
                                   max_position=24, local_attention=8, global_attn_every_n_layers=2)
        model = build_pretrain_model(encoder, {"mlm": 1.0, "capt": 1.0}, SPECIAL, {}, seed=2, kernels="torch").eval()
        split = split_modernbert_for_hf
    export = split(model, model.state_dict())
    assert export.objective_heads and all(k.startswith("objectives.capt.") for k in export.objective_heads)
    model.stray = torch.nn.Linear(2, 2)
    with pytest.raises(ExportError, match=r"parameters outside bert\.\*, cls\.\* and objectives\.\*: "
                                          r"\['stray\.bias', 'stray\.weight'\]"):
        split(model, model.state_dict())
