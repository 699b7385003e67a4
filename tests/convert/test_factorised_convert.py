"""A masked-LM run with factorised embeddings (`model.embedding_size` E != H, `mlm-electra-small`'s shape) has no
`BertForMaskedLM` (one width throughout): it converts as `ElectraForMaskedLM`, whose logits equal the training
model's within 1e-4, loads with `AutoModelForMaskedLM` / `AutoModel`, and its sentence-transformers files load."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.export.convert import convert
from pipeline.pretrain.build import model_from_meta
from pipeline.study.evaluate import masked_lm_dir
from pipeline.train.run_meta import RunMeta
from tests.train.runs import module_state, run_inprocess, tag_dir


def test_factorised_mlm_run_exports_as_electra_for_masked_lm(tiny_shards_dir, tmp_path):
    from transformers import AutoModel, AutoModelForMaskedLM, ElectraForMaskedLM, ElectraModel

    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=3", "train.checkpoint_every=3",
                         "model.embedding_size=24") == 0
    exported = convert(out, tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["ElectraForMaskedLM"]
    assert (config["model_type"], config["embedding_size"], config["hidden_size"]) == ("electra", 24, 64)
    hf, info = AutoModelForMaskedLM.from_pretrained(str(exported), output_loading_info=True)
    assert type(hf) is ElectraForMaskedLM and not info["unexpected_keys"]
    assert set(info["missing_keys"]) <= {"generator_lm_head.weight"}  # tied to the word embeddings
    assert hf.generator_lm_head.weight.data_ptr() == hf.electra.embeddings.word_embeddings.weight.data_ptr()
    tag = tag_dir(out, 3)
    ours = model_from_meta(RunMeta.read(tag))
    ours.load_state_dict(module_state(tag), strict=False)
    ours.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, config["vocab_size"], (3, 30), generator=gen)
    mask = (torch.arange(30)[None] < torch.tensor([30, 19, 7])[:, None]).long()
    real = mask.bool()
    with torch.no_grad():
        reference = hf.eval()(input_ids=ids, attention_mask=mask).logits
        hidden = ours.bert(ids, mask).last_hidden
        torch.testing.assert_close(ours.cls(hidden)[real], reference[real], rtol=0, atol=1e-4)
        body = AutoModel.from_pretrained(str(exported)).eval()
        assert type(body) is ElectraModel
        torch.testing.assert_close(body(input_ids=ids, attention_mask=mask).last_hidden_state[real], hidden[real],
                                   rtol=0, atol=1e-4)
    assert reference[real].std() > 1e-3
    assert masked_lm_dir(exported) == exported  # the study's masked-LM evaluation reads it as it is
    card = (exported / "README.md").read_text()
    assert "`ElectraForMaskedLM` (encoder + tied MLM head; the factorised embeddings" in card
    assert json.loads((exported / "0_Transformer/config.json").read_text())["architectures"] == ["ElectraModel"]
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(exported), device="cpu")
    assert model.encode(["the first sentence", "and a second one"]).shape == (2, 64)
