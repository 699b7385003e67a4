"""The tools' unclear failures, each made one clear line (class 6), with what survived:

* `cpt-convert` into a full or read-only output filesystem: exit 4 (training's code for an output
  that cannot be written), the previous export unchanged, no temporary directory left;
* `model.init_from` a directory without tokenizer files: names that cause (not the shards);
* fine-tuning a model whose `model.safetensors` is truncated: names the file;
* `build_shards` interrupted (SIGINT): exit 130 and one line, no traceback; the same command resumes
  to the same shards;
* invalid YAML in a config file: one line with the line and column.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
from safetensors import SafetensorError

from data_prep.build_shards import SLEEP_AFTER_SHARD_ENV, STATE_FILE
from data_prep.build_shards import main as build_main
from pipeline.eval.finetune import main as finetune_main
from pipeline.export import convert as convert_module
from pipeline.train.cli import main as train_main
from tests.convert.conftest import save_tiny_bert
from tests.faults.faults import error_line
from tests.faults.test_tool_refusals import TOKENIZER_FILES, _task
from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB
from tests.train.runs import REPO, _env, run_inprocess


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _full(*args, **kwargs):  # what safetensors raises on a full disk (it wraps Rust's io::Error)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


@pytest.mark.parametrize("failure", ["full", "read-only"])
def test_convert_into_an_unwritable_output_keeps_the_previous_export(failure, monkeypatch, small_run, small_export,
                                                                     tmp_path, capsys):
    out = Path(shutil.copytree(small_export, tmp_path / "hf"))
    before = _files(out)
    if failure == "full":
        monkeypatch.setattr(safetensors.torch, "save_file", _full)
        reason = "no space left on device"
    else:
        def read_only(directory, *args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(directory))

        monkeypatch.setattr(convert_module, "write_export", read_only)
        reason = f"read-only file system: {convert_module._sibling(out, 'tmp')}"
    capsys.readouterr()
    assert convert_module.main([str(small_run), str(out), "--overwrite"]) == convert_module.EXIT_WRITE_FAILED == 4
    assert error_line(capsys.readouterr().err) == (f"{out}: cannot write the export ({reason}); the previous export "
                                                   "there is unchanged")
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary sibling left


def test_init_from_a_directory_without_tokenizer_files_names_that(tiny_tokenizer_dir, tiny_shards_dir, tmp_path,
                                                                  capsys):
    base = save_tiny_bert(tmp_path / "bert", tiny_tokenizer_dir)
    for name in TOKENIZER_FILES:
        (base / name).unlink(missing_ok=True)
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, f"model.init_from={base}") == 2
    assert error_line(capsys.readouterr().err) == (
        f"model.init_from={base} has no tokenizer files (none of tokenizer.json, vocab.txt, vocab.json, spiece.model, "
        "sentencepiece.bpe.model, tokenizer.model); a model directory without them loads only a placeholder of its "
        "special tokens; copy the base model's tokenizer files into it (shards built with the placeholder would be "
        "all [UNK])")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_fine_tuning_a_truncated_model_safetensors_names_the_file(small_export, tmp_path, capsys):
    model = Path(shutil.copytree(small_export, tmp_path / "hf"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    output = tmp_path / "result.json"
    assert finetune_main(["--model", str(model), "--task-dir", str(_task(tmp_path / "task")), "--epochs", "1",
                          "--output", str(output)]) == 2
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"{weights}: unreadable weights (SafetensorError: "), message
    assert not output.exists()


def test_an_interrupted_shard_build_says_so_in_one_line_and_resumes(tiny_corpus_file, tiny_tokenizer_dir,
                                                                     tiny_shards_dir, tmp_path, capsys):
    out = tmp_path / "shards"
    args = ["--input", str(tiny_corpus_file), "--tokenizer", str(tiny_tokenizer_dir), "--seq-len", str(TINY_SEQ_LEN),
            "--shard-size-mb", str(TINY_SHARD_MB), "--out", str(out), "--num-proc", "2", "--no-progress"]
    # `python -m data_prep.build_shards`, with Ctrl-C's default action as in a terminal: a suite started in the
    # background of a shell without job control (`nohup ... &`) hands its children SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler (the build would finish with exit 0 whatever the signal).
    as_in_a_terminal = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                        "runpy.run_module('data_prep.build_shards', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", as_in_a_terminal, *args], cwd=REPO,
                            env=_env({SLEEP_AFTER_SHARD_ENV: "1"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads((out / STATE_FILE).read_text())["shards"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"error: interrupted \(SIGINT\): the \d+ shard\(s\) recorded in {re.escape(str(out / STATE_FILE))} "
                        r"are kept; re-run the same command to resume", lines[0]), lines[0]
    assert build_main(args) == 0  # the same command resumes
    assert "resuming after" in capsys.readouterr().err
    shards = sorted(p.name for p in tiny_shards_dir.glob("shard_*.arrow"))
    assert sorted(p.name for p in out.glob("shard_*.arrow")) == shards
    assert all((out / n).read_bytes() == (tiny_shards_dir / n).read_bytes() for n in shards)


def test_invalid_yaml_is_one_line_with_line_and_column(tiny_shards_dir, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("inherit: tiny-mlm\ntrain: {total_steps: 3\nmodel: {size: tiny}\n")
    assert train_main(["--config", str(config), f"data.shards_dir={tiny_shards_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert re.fullmatch(rf"error: {re.escape(str(config))}: invalid YAML at line 3, column \d+: expected ',' or '}}', "
                        r"but got .+ \(while parsing a flow mapping\)", err), err


class _WritesAFile:
    """A hostile pickle: unpickling it creates `target`."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


@pytest.fixture()
def pickled_export(small_export, tmp_path):
    """A copy of the converted tiny model whose weights are a `pytorch_model.bin` carrying a planted pickle."""
    import torch

    model = Path(shutil.copytree(small_export, tmp_path / "hf_pickled"))
    state = safetensors.torch.load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    marker = tmp_path / "planted-code-ran"
    torch.save({**state, "planted": _WritesAFile(marker)}, model / "pytorch_model.bin")
    return model, marker


def _refused_in_one_line(err: str, weights: Path, prefix: str = "") -> None:
    message = error_line(err)
    assert message.startswith(f"{prefix}{weights}: refused: its pickle needs io.open, which is not a type"), message
    assert "weights_only" not in err and "Re-running" not in err, err


@pytest.mark.parametrize("tool", ["model.init_from", "cpt-convert --weights", "cpt-finetune", "cpt-sts"])
def test_a_pickle_in_pytorch_model_bin_is_one_line_naming_the_file_and_the_global(tool, pickled_export, small_run,
                                                                                   tiny_shards_dir, tmp_path, capsys):
    """Issue 57: every tool that reads a converted directory's `pytorch_model.bin` refuses a planted pickle with the
    restricted unpickler's one line (`pipeline.safe_load`), never torch's advice to load with
    `weights_only=False`; nothing of it runs."""
    from pipeline.eval import sts
    from pipeline.export.convert import main as convert_main
    from tests.eval.conftest import write_sts
    from tests.faults.test_tool_refusals import _task

    model, marker = pickled_export
    weights = model / "pytorch_model.bin"
    capsys.readouterr()
    if tool == "model.init_from":
        assert run_inprocess("tiny-mlm", tiny_shards_dir, tmp_path / "run", f"model.init_from={model}") == 2
        _refused_in_one_line(capsys.readouterr().err, weights)
    elif tool == "cpt-convert --weights":
        assert convert_main([str(small_run), str(tmp_path / "out"), "--weights", str(model)]) == 2
        _refused_in_one_line(capsys.readouterr().err, weights)
    elif tool == "cpt-finetune":
        assert finetune_main(["--model", str(model), "--task-dir", str(_task(tmp_path / "task")), "--epochs", "1"]) == 2
        _refused_in_one_line(capsys.readouterr().err, weights)
    else:
        assert sts.main([str(model), "--data", str(write_sts(tmp_path / "sts", n_pairs=10))]) == 2
        _refused_in_one_line(capsys.readouterr().err, weights, prefix="CONVERTED_DIR ")
    assert not marker.exists()
