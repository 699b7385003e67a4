"""The health check at conversion: a collapsed encoder (every token's last hidden state the same
vector) or a contrastive positive pinned at 1.0 is warned about loudly and recorded in the card."""
from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.export.convert import main as convert_main
from pipeline.export.health_check import HealthReport, announce, check_health
from pipeline.pretrain.build import build_pretrain_model
from pipeline.train.run_meta import RunMeta
from tests.convert.conftest import save_tiny_bert
from tests.train.runs import run_inprocess

LAST_NORM = "bert.encoder.layer.1.output.LayerNorm"


def _model_and_meta(shards, last_metrics=None):
    from pipeline.data.shards import read_manifest
    from pipeline.model.config import ModelConfig

    manifest = read_manifest(shards)
    encoder = ModelConfig().encoder_config(manifest.vocab_size, manifest.seq_len, manifest.special_tokens)
    model = build_pretrain_model(encoder, {"mlm": 1.0}, manifest.special_tokens, {}, seed=1, kernels="torch")
    meta = RunMeta(encoder_config=encoder.to_dict(), objectives={"mlm": 1.0}, objective_options={},
                   special_tokens=manifest.special_tokens, tokenizer_dir="", data_dir=str(shards), manifest_hash="",
                   config_hash="", config={}, last_metrics=dict(last_metrics or {}))
    return model, meta


def _collapse(state: dict) -> dict:
    """Last LayerNorm scaled to 0: every token's last hidden state is the LayerNorm bias."""
    state = dict(state)
    state[f"{LAST_NORM}.weight"] = torch.zeros_like(state[f"{LAST_NORM}.weight"])
    state[f"{LAST_NORM}.bias"] = torch.randn_like(state[f"{LAST_NORM}.bias"])
    return state


def test_collapsed_encoder_is_flagged_and_a_healthy_one_is_not(tiny_shards_dir):
    model, meta = _model_and_meta(tiny_shards_dir)
    healthy = check_health(model, model.state_dict(), meta, None)
    assert healthy.token_cosine is not None and healthy.token_cosine < 0.9 and healthy.problems() == []
    assert healthy.probe_rows == 16 and healthy.probe_tokens > 16 * 20
    collapsed = check_health(model, _collapse(model.state_dict()), meta, None)
    assert collapsed.token_cosine == pytest.approx(1.0, abs=1e-4) and collapsed.collapsed
    assert "mean token cosine 1.0000 > 0.9" in collapsed.problems()[0]
    stream = io.StringIO()
    announce(collapsed, stream)
    assert "WARNING: this checkpoint looks COLLAPSED" in stream.getvalue()


def test_pinned_positive_cosine_is_flagged_from_the_last_metrics(tiny_shards_dir, tmp_path):
    model, meta = _model_and_meta(tiny_shards_dir, {"capt/positive_cosine": 0.9996, "mlm/loss": 5.0})
    report = check_health(model, model.state_dict(), meta, tmp_path / "moved-away")  # shards not there
    assert report.token_cosine is None and "--shards" in report.note
    assert report.pinned == {"capt/positive_cosine": 0.9996}
    assert report.problems() == ["capt/positive_cosine = 0.9996 (>= 0.999): the contrastive positive is pinned at 1.0"]
    assert report.signals == []  # the last metrics hold no learning signal with its reference
    assert HealthReport(0.3, positive_cosines={"capt/positive_cosine": 0.8}).problems() == []


def test_collapsed_checkpoint_converts_with_a_loud_warning_and_a_card_that_says_so(
        tmp_path, tiny_tokenizer_dir, bert_shards, capsys):
    """End to end: a CAPT run warm-started from a collapsed BERT (one step, tiny learning rate) keeps
    it collapsed; its positive cosine is pinned; the converter warns on stderr and the card records both."""
    base = save_tiny_bert(tmp_path / "collapsed-bert", tiny_tokenizer_dir, seed=3)
    save_file(_collapse(load_file(base / "model.safetensors")), str(base / "model.safetensors"),
              metadata={"format": "pt"})
    out = tmp_path / "run"
    assert run_inprocess("tiny-capt", bert_shards, out, f"model.init_from={base}", "optim.lr=1e-9",
                         "optim.warmup_steps=0", "train.total_steps=1") == 0
    capsys.readouterr()
    assert convert_main([str(out), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: this checkpoint looks COLLAPSED" in err
    assert "mean token cosine" in err and "capt/positive_cosine" in err
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "**Warning: this checkpoint looks collapsed**" in card.split("## Training")[0]
    assert "**COLLAPSED**" in card and "**PINNED at 1.0**" in card


def test_healthy_conversion_prints_no_warning(bert_dir, bert_shards, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", bert_shards, out, f"model.init_from={bert_dir}", "train.total_steps=1",
                         "optim.warmup_steps=0") == 0
    capsys.readouterr()
    assert convert_main([str(out), str(tmp_path / "hf")]) == 0
    assert "WARNING" not in capsys.readouterr().err
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "| ok (collapsed above 0.9) |" in card and "Warning" not in card
