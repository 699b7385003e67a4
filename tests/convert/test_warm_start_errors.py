"""Every `model.init_from` mismatch is a clear error naming the file or field, before any compute.

Each case edits a copy of the tiny base directory (or picks mismatched shards), runs the real
`python -m pipeline.train` entry point in-process (not `--check`), and expects exit code 2, the
message on stderr, and nothing written: no metrics, no checkpoint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
from safetensors.torch import load_file, save_file

from tests.train.runs import run_inprocess


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(base: Path) -> None:
        config = json.loads((base / "config.json").read_text())
        config.update(changes)
        (base / "config.json").write_text(json.dumps(config))

    return edit


def _drop_tensor(name: str) -> Callable[[Path], None]:
    def edit(base: Path) -> None:
        state = load_file(base / "model.safetensors")
        del state[name]
        save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})

    return edit


def _add_token(base: Path) -> None:
    """Another tokenizer: one extra vocabulary entry (config.json's vocab_size still holds it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens(["zzqxj"])
    tokenizer.save_pretrained(str(base))
    _edit_config(vocab_size=len(tokenizer))(base)


CASES = {
    "other tokenizer": (_add_token, [], "was built with another tokenizer than model.init_from"),
    "vocabulary too small": (_edit_config(vocab_size=700), [],
                             "config.json: vocab_size=700 is smaller than the shards' vocabulary (800 tokens)"),
    "hidden size override": (None, ["model.hidden_size=128"],
                             "model.hidden_size=128 disagrees with hidden_size=64 in"),
    "hidden size vs weights": (_edit_config(hidden_size=32), [],
                               "bert.embeddings.LayerNorm.bias has shape (64,) but"),
    "too few positions": (_edit_config(max_position_embeddings=32), [],
                          "config.json: max_position_embeddings=32 is shorter than the shards' seq_len=64"),
    "not bert": (_edit_config(model_type="roberta"), [], "config.json: model_type='roberta'; model.init_from takes BERT"),
    "other activation": (_edit_config(hidden_act="gelu_new"), [], "config.json: hidden_act='gelu_new' is not supported"),
    "missing tensor": (_drop_tensor("bert.encoder.layer.1.output.dense.weight"), [],
                       "model.safetensors: missing weights ['bert.encoder.layer.1.output.dense.weight']"),
    "partial MLM head": (_drop_tensor("cls.predictions.transform.dense.weight"), [],
                         "missing weights ['cls.predictions.transform.dense.weight']"),
    "no weights": (lambda base: (base / "model.safetensors").unlink(), [], "no PyTorch weights (looked for"),
    "corrupt weights": (lambda base: (base / "model.safetensors").write_bytes(b"\x00" * 64), [],
                        "model.safetensors: unreadable weights"),
    "no config": (lambda base: (base / "config.json").unlink(), [], "config.json: missing"),
    "not a directory": (lambda base: shutil.rmtree(base), [], "not a directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mismatch_is_an_error_before_compute(case, bert_dir, bert_shards, tmp_path, capsys):
    edit, overrides, message = CASES[case]
    base = shutil.copytree(bert_dir, tmp_path / "base")
    if edit is not None:
        edit(base)
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", bert_shards, out, f"model.init_from={base}", *overrides) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_shards_of_another_tokenizer_are_refused(bert_dir, tiny_shards_dir, tmp_path, capsys):
    """Shards built from a tokenizer-only directory with the same tokenizer pass; other shards do not."""
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path / "ok", f"model.init_from={bert_dir}",
                         "train.total_steps=1", "optim.warmup_steps=0") == 0  # same tokenizer, other files
    base = shutil.copytree(bert_dir, tmp_path / "base")
    _add_token(base)
    assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path / "bad", f"model.init_from={base}") == 2
    err = capsys.readouterr().err
    assert f"data.shards_dir={tiny_shards_dir} was built with another tokenizer" in err
    assert "vocabularies differ: 801 vs 800 entries" in err and "build_shards --tokenizer" in err
