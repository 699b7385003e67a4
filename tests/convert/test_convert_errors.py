"""A corrupt, incomplete or mismatched checkpoint gives a clear error and writes nothing to OUT_DIR."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.export.convert import clean_stale_siblings, convert, main, resolve_tag_dir
from pipeline.export.hf_adapter import check_state_dict
from pipeline.model.hf_names import ExportError
from pipeline.pretrain.build import model_from_meta
from pipeline.train.run_meta import RunMeta

pytestmark = pytest.mark.slow
ONE_RANK = "zero0-1rank-mlm"
TWO_RANKS = "zero2-2ranks-mlm-capt-mlmnce"
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 600


def _tag(checkpoints: Path) -> Path:
    return checkpoints / (checkpoints / "latest").read_text().strip()


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == [], leftovers


def _cli_error(capsys, *argv: str) -> str:
    assert main([*map(str, argv)]) == 2
    return capsys.readouterr().err


def test_missing_rank_file(checkpoint_copy, tmp_path, capsys):
    checkpoints = checkpoint_copy(TWO_RANKS)
    (_tag(checkpoints) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    out = tmp_path / "hf"
    err = _cli_error(capsys, checkpoints, out)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in err and "missing" in err
    _assert_nothing_written(out)


def test_truncated_rank_file(checkpoint_copy, tmp_path, capsys):
    checkpoints = checkpoint_copy(TWO_RANKS)
    victim = _tag(checkpoints) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    out = tmp_path / "hf"
    err = _cli_error(capsys, checkpoints, out)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in err and "truncated" in err
    _assert_nothing_written(out)


@pytest.mark.parametrize(
    "run, victim",
    [(TWO_RANKS, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), (ONE_RANK, "mp_rank_00_model_states.pt")],
)
def test_garbled_file_of_the_right_size(run, victim, checkpoint_copy, tmp_path, capsys):
    # Same size as recorded: the sha256 recorded at save (COMPLETE.json) catches it before any load.
    checkpoints = checkpoint_copy(run)
    path = _tag(checkpoints) / victim
    path.write_bytes(b"\0" * path.stat().st_size)
    out = tmp_path / "hf"
    err = _cli_error(capsys, checkpoints, out)
    assert f"{_tag(checkpoints)}: file {victim} does not match the sha256 recorded when it was written" in err
    _assert_nothing_written(out)


def test_a_flipped_byte_in_the_weights_is_caught(checkpoint_copy, tmp_path, capsys):
    """One byte of a weight changed: the file still loads and the weights stay finite, so only the
    recorded sha256 can tell; converting it would silently publish wrong weights."""
    checkpoints = checkpoint_copy(ONE_RANK)
    path = _tag(checkpoints) / "mp_rank_00_model_states.pt"
    before = torch.load(path, map_location="cpu", weights_only=False)["module"]
    data = bytearray(path.read_bytes())
    weight = before["bert.encoder.layer.0.attention.self.qkv.weight"].numpy().tobytes()  # fused Q/K/V in training checkpoints
    at = data.find(weight[:256])
    assert at > 0
    data[at + 100] ^= 0x01  # the lowest mantissa bit of one float32 weight
    path.write_bytes(bytes(data))
    after = torch.load(path, map_location="cpu", weights_only=False)["module"]
    assert any(not torch.equal(before[k], after[k]) for k in before)  # loadable, but different weights
    out = tmp_path / "hf"
    assert "mp_rank_00_model_states.pt does not match the sha256" in _cli_error(capsys, checkpoints, out)
    _assert_nothing_written(out)


def test_partial_checkpoint_without_completion_marker(checkpoint_copy, tmp_path, capsys):
    checkpoints = checkpoint_copy(ONE_RANK)
    (_tag(checkpoints) / "COMPLETE.json").unlink()
    out = tmp_path / "hf"
    assert "partial checkpoint" in _cli_error(capsys, checkpoints, out)
    _assert_nothing_written(out)


def test_latest_pointing_nowhere_and_not_a_checkpoint(checkpoint_copy, tmp_path, capsys):
    checkpoints = checkpoint_copy(ONE_RANK)
    (checkpoints / "latest").write_text("step_00000999")
    out = tmp_path / "hf"
    assert "step_00000999" in _cli_error(capsys, checkpoints, out)
    (tmp_path / "empty").mkdir()
    assert "neither a checkpoint tag directory" in _cli_error(capsys, tmp_path / "empty", out)
    assert "no such checkpoint directory" in _cli_error(capsys, tmp_path / "nope", out)
    _assert_nothing_written(out)


def test_missing_tokenizer_is_reported_before_any_weights_are_read(checkpoint_copy, tmp_path, capsys):
    checkpoints = checkpoint_copy(ONE_RANK)
    out = tmp_path / "hf"
    err = _cli_error(capsys, checkpoints, out, "--tokenizer", tmp_path / "no-tokenizer")
    assert "tokenizer_dir" in err and "--tokenizer" in err
    _assert_nothing_written(out)


def test_generator_requested_for_a_run_without_one(trained_runs, tmp_path, capsys):
    out = tmp_path / "hf"
    assert "--with-generator" in _cli_error(capsys, trained_runs(ONE_RANK).checkpoints, out, "--with-generator")
    _assert_nothing_written(out)


def test_non_empty_out_dir_needs_overwrite(trained_runs, tmp_path, capsys):
    checkpoints = trained_runs(ONE_RANK).checkpoints
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert "--overwrite" in _cli_error(capsys, checkpoints, out)
    assert (out / "keep.txt").read_text() == "precious"
    assert main([str(checkpoints), str(out), "--overwrite", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])  # after DeepSpeed's first-import line, if any
    assert "model.safetensors" in summary["files"] and not (out / "keep.txt").exists()
    assert summary["tokenizer_fingerprint"] and summary["sentence_embedding"]["mode"] == "mean"
    # without --json: lines for a person, describing the same directory
    assert main([str(checkpoints), str(out), "--overwrite"]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    lines = out_lines[next(i for i, line in enumerate(out_lines) if line.startswith("exported")):]
    meta = json.loads((out / "pipeline_meta.json").read_text())
    assert lines[0] == (f"exported step {meta['step']} of a mlm run ({meta['recipe']['preset']}) to {out} "
                        f"({len(summary['files'])} files) as BertForMaskedLM")
    assert lines[1] == f"  load with: transformers.BertForMaskedLM.from_pretrained({str(out)!r})"
    assert lines[2] == f"  the encoder alone: transformers.AutoModel.from_pretrained({str(out / '0_Transformer')!r})"
    assert lines[3] == f"  sentence embeddings: sentence_transformers.SentenceTransformer({str(out)!r})"
    assert lines[4].startswith("  sentence pooling: mean (")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert(resolve_tag_dir(checkpoints), empty) == empty and (empty / "config.json").is_file()


def test_weights_that_disagree_with_the_meta_are_named(trained_runs):
    run = trained_runs(ONE_RANK)
    model = model_from_meta(RunMeta.read(run.tag_dir))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    check_state_dict(model, state, "ok")  # the model's own weights pass

    missing = dict(state)
    del missing["bert.encoder.layer.1.output.dense.weight"]
    with pytest.raises(ExportError, match=r"missing \['bert.encoder.layer.1.output.dense.weight'\]"):
        check_state_dict(model, missing, "ckpt")
    extra = {**state, "objectives.taco.head.weight": torch.zeros(2)}
    with pytest.raises(ExportError, match=r"unexpected \['objectives.taco.head.weight'\]"):
        check_state_dict(model, extra, "ckpt")
    shaped = {**state, "cls.predictions.decoder.bias": torch.zeros(3)}
    with pytest.raises(ExportError, match=r"cls.predictions.decoder.bias has shape \(3,\)"):
        check_state_dict(model, shaped, "ckpt")
    nan = torch.full_like(state["bert.embeddings.LayerNorm.weight"], float("nan"))
    broken = {**state, "bert.embeddings.LayerNorm.weight": nan}
    with pytest.raises(ExportError, match="bert.embeddings.LayerNorm.weight contains NaN"):
        check_state_dict(model, broken, "ckpt")


_PAUSED_CONVERT = """
import pathlib, sys, time
import pipeline.export.convert as convert

write_export = convert.write_export

def write_then_wait(directory, *args, **kwargs):
    write_export(directory, *args, **kwargs)
    # The temporary directory is full now. The marker appears whole (renamed into place): the test kills
    # this process as soon as it sees the file, which could fall between creating and writing it.
    marker = pathlib.Path(sys.argv[-1])
    marker.with_suffix(".tmp").write_text(str(directory))
    marker.with_suffix(".tmp").replace(marker)
    while True:  # until the test kills this process
        time.sleep(0.05)

convert.write_export = write_then_wait
sys.exit(convert.main(sys.argv[1:-1]))
"""


def _killed_convert(checkpoints: Path, out: Path, marker: Path, sig: signal.Signals) -> tuple[int, Path]:
    """Run `convert --overwrite` in a process that stops once its temporary directory is written,
    then send it `sig`; returns (exit status, the temporary directory it was writing)."""
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_CONVERT, str(checkpoints), str(out), "--overwrite",
                             str(marker)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + DEADLINE_S
    while not marker.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, f"convert ended (rc {proc.returncode}) or hung"
        time.sleep(0.02)
    proc.send_signal(sig)
    return proc.wait(timeout=DEADLINE_S), Path(marker.read_text())


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_convert_overwrite_leaves_nothing_behind(sig, trained_runs, tmp_path, capsys):
    checkpoints = trained_runs(ONE_RANK).checkpoints
    out = tmp_path / "clean"
    assert main([str(checkpoints), str(out)]) == 0
    previous = sorted(p.name for p in out.iterdir())
    code, tmp = _killed_convert(checkpoints, out, tmp_path / "paused", sig)
    assert sorted(p.name for p in out.iterdir()) == previous  # the previous export is untouched
    if sig == signal.SIGTERM:  # cleans up itself
        assert code == 128 + signal.SIGTERM and _siblings(out) == []
        return
    assert code == -signal.SIGKILL and _siblings(out) == [tmp.name]  # kill -9: nothing can run
    assert main([str(checkpoints), str(out), "--overwrite"]) == 0  # the next conversion removes it
    assert _siblings(out) == [] and sorted(p.name for p in out.iterdir()) == previous


def test_stale_siblings_of_other_hosts_or_live_processes_are_kept(tmp_path):
    out = tmp_path / "hf"
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    mine_dead = tmp_path / f".hf.tmp-{host}-{dead.pid}"
    legacy_dead = tmp_path / f".hf.tmp-{dead.pid}"
    live = tmp_path / f".hf.tmp-{host}-{os.getppid()}"
    elsewhere = tmp_path / f".hf.tmp-other-host-{dead.pid}"
    previous_export = tmp_path / f".hf.old-{host}-{dead.pid}"
    for d in (mine_dead, legacy_dead, live, elsewhere, previous_export):
        d.mkdir()
    (previous_export / "config.json").write_text("{}")
    assert sorted(clean_stale_siblings(out)) == sorted([mine_dead, legacy_dead])
    assert live.is_dir() and elsewhere.is_dir()
    assert (out / "config.json").is_file() and not previous_export.exists()  # killed between its renames: restored
