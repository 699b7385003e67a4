"""`model.init_from=DIR`: pretraining starts from a Hugging Face BERT directory, and the export says so.

Proofs on a tiny random `BertForMaskedLM` saved with `save_pretrained`, shards built with its own
tokenizer (`build_shards --tokenizer DIR`), real one-step runs of `pipeline.train`:
* with a tiny learning rate, the exported weights equal the input's (a normal one moves them);
* the MLM loss of step 1 equals the Hugging Face model's loss on the same masked batch;
* a resumed run takes its weights from the checkpoint and never reads the base weights;
* the model card and `pipeline_meta.json` name the base model (no local path).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.train.run_config import load_config
from pipeline.io import sha256_file
from pipeline.export.convert import convert
from pipeline.export.model_card import public
from pipeline.train.metrics import read_jsonl
from tests.fixtures_data import make_batch
from tests.train.runs import losses, run_inprocess

ONE_STEP = ["optim.warmup_steps=0", "train.total_steps=1"]


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _train_and_convert(bert_dir: Path, shards: Path, tmp_path: Path, *extra: str, preset: str = "tiny-mlm") -> Path:
    out = tmp_path / "run"
    assert run_inprocess(preset, shards, out, f"model.init_from={bert_dir}", *extra) == 0
    return convert(out, tmp_path / "hf")


def test_tiny_learning_rate_exports_the_input_weights(bert_dir, bert_shards, tmp_path):
    hf = _train_and_convert(bert_dir, bert_shards, tmp_path, *ONE_STEP, "optim.lr=1e-9")
    before, after = load_file(bert_dir / "model.safetensors"), load_file(hf / "model.safetensors")
    assert set(after) == set(before)  # every BertForMaskedLM tensor, the MLM head included
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=1e-6, msg=key)

    # the export's other promises: a clean tokenizer config and the run's record beside the card
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(tokenizer_config)
    tag = tmp_path / "run" / "checkpoints" / "step_00000001"
    recorded = json.loads((tag / "pipeline_meta.json").read_text())
    exported = json.loads((hf / "pipeline_meta.json").read_text())
    assert set(exported.pop("conversion")) == {"tokenizer_fingerprint", "sentence_embedding"}  # what conversion adds
    assert exported == public(recorded)  # local paths reduced to names

    card = (hf / "README.md").read_text()
    assert "\nbase_model: tiny-bert\n" in card.split("---")[1]  # YAML front matter
    assert str(tmp_path.parents[1]) not in card  # no local path: run, shards, base and tokenizer all live there
    meta = json.loads((hf / "pipeline_meta.json").read_text())
    assert meta["base_model"]["name"] == "tiny-bert"
    assert meta["base_model"]["config_sha256"] == sha256_file(bert_dir / "config.json")
    assert meta["base_model"]["config_sha256"][:16] in card


def test_step_one_mlm_loss_is_the_hugging_face_loss(bert_dir, bert_shards, tmp_path):
    """Same masked batch, dropout off: our step-1 MLM loss is `BertForMaskedLM(...).loss`; a normal
    learning rate then moves the weights (so the tiny-LR test above is not vacuous)."""
    from transformers import BertForMaskedLM

    overrides = [*ONE_STEP, "model.dropout=0", "model.attention_dropout=0", "data.micro_batch_size=8"]
    hf_out = _train_and_convert(bert_dir, bert_shards, tmp_path, *overrides)
    ours = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]

    seed = load_config("tiny-mlm").train.seed
    batch = make_batch(bert_shards, ("masked",), batch_size=8, seed=seed)
    model = BertForMaskedLM.from_pretrained(str(bert_dir)).eval()
    with torch.no_grad():
        theirs = model(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"],
                       labels=batch["mlm_labels"]).loss
    assert ours["step"] == 1 and int(ours["mlm/selected_tokens"]) == int((batch["mlm_labels"] != -100).sum())
    assert ours["mlm/loss"] == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)

    before, after = load_file(bert_dir / "model.safetensors"), load_file(hf_out / "model.safetensors")
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert 1e-4 < moved < 1e-2  # one Adam step of lr 1e-3 away from the input weights


def test_bert_model_checkpoint_fills_the_encoder_and_the_mlm_head_starts_fresh(tmp_path, tiny_tokenizer_dir,
                                                                                bert_dir, bert_shards):
    """`BertModel` weights (a pooler, no MLM head): the encoder comes from them, the head is the
    run's own initialisation (not silently left at some constant), the pooler is not used."""
    from tests.convert.conftest import save_tiny_bert

    base = save_tiny_bert(tmp_path / "tiny-bert-model", tiny_tokenizer_dir, seed=11, model_cls="BertModel")
    hf = _train_and_convert(base, bert_shards, tmp_path, *ONE_STEP, "optim.lr=1e-9")
    before, after = load_file(base / "model.safetensors"), load_file(hf / "model.safetensors")
    assert any(k.startswith("pooler.") for k in before) and not any("pooler" in k for k in after)
    for key, value in before.items():
        if not key.startswith("pooler."):
            torch.testing.assert_close(after[f"bert.{key}"], value, rtol=0, atol=1e-6, msg=key)
    head = after["cls.predictions.transform.dense.weight"]
    assert 0.01 < float(head.std()) < 0.03  # the run's normal(0, 0.02) initialisation


def test_resume_takes_the_checkpoint_and_never_reads_the_base_weights(bert_dir, bert_shards, tmp_path):
    base = shutil.copytree(bert_dir, tmp_path / "tiny-bert")
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    common = [f"model.init_from={base}", "train.total_steps=3", "train.checkpoint_every=1", "train.keep_last=3"]
    assert run_inprocess("tiny-mlm", bert_shards, first, *common) == 0

    (base / "model.safetensors").unlink()  # a fresh start can no longer load; a resume must not try
    from pipeline.config.checks import ConfigError
    from pipeline.train.run_config import check_run

    cfg = load_config("tiny-mlm", [f"data.shards_dir={bert_shards}", *common])
    with pytest.raises(ConfigError, match="no PyTorch weights"):
        check_run(cfg, 1, False)
    check_run(cfg, 1, False, fresh_start=False)

    tag = first / "checkpoints" / "step_00000002"
    assert run_inprocess("tiny-mlm", bert_shards, resumed, *common, f"train.resume={tag}") == 0
    assert losses(resumed) == {3: losses(first)[3]}  # bit for bit the uninterrupted run's step 3


@pytest.mark.parametrize("layout", ["legacy pytorch_model.bin", "sharded safetensors"])
def test_other_weight_layouts_load_exactly(layout, bert_dir, bert_shards, tmp_path):
    """`pytorch_model.bin` of a `BertForPreTraining` with TensorFlow-era `gamma`/`beta` names (the
    original `bert-base-*` layout), and a sharded `model.safetensors.index.json`: the model built
    by the run's constructor gives the Hugging Face model's MLM logits."""
    from transformers import BertConfig, BertForPreTraining

    from pipeline.train.run_config import check_run
    from pipeline.train.loop import build_run_model

    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bert_dir / name, base / name)
    torch.manual_seed(5)
    hf = BertForPreTraining(BertConfig.from_pretrained(str(bert_dir))).eval()
    if layout.startswith("legacy"):
        state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                 for k, v in hf.state_dict().items()}
        torch.save(state, base / "pytorch_model.bin", _use_new_zipfile_serialization=False)  # 2018's format
    else:
        hf.save_pretrained(str(base), max_shard_size="100KB")
        assert (base / "model.safetensors.index.json").is_file()
    cfg = load_config("tiny-mlm", [f"data.shards_dir={bert_shards}", f"model.init_from={base}"])
    model = build_run_model(cfg, check_run(cfg, 1, False)).eval()
    batch = make_batch(bert_shards, ("masked",), batch_size=4)
    ids, mask = batch["masked_ids"], batch["attention_mask"]
    with torch.no_grad():
        ours = model.cls(model.bert(ids, mask).last_hidden)
        theirs = hf(input_ids=ids, attention_mask=mask).prediction_logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_every_rank_starts_from_the_base_weights_under_zero3(bert_dir, bert_shards, tmp_path):
    """Two ranks, ZeRO-3 (parameters partitioned after the constructor loaded them): one step at a
    tiny learning rate exports the input weights, so both ranks' partitions held them."""
    from tests.train.runs import run_torchrun

    run_torchrun("tiny-mlm", bert_shards, tmp_path / "run", f"model.init_from={bert_dir}", "deepspeed.config=zero3",
                 *ONE_STEP, "optim.lr=1e-9")
    hf = convert(tmp_path / "run", tmp_path / "hf")
    before, after = load_file(bert_dir / "model.safetensors"), load_file(hf / "model.safetensors")
    assert set(after) == set(before)
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=1e-6, msg=key)
