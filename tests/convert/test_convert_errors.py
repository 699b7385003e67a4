"""A corrupt, incomplete or mismatched checkpoint gives a clear error and writes nothing to OUT_DIR."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.export.convert import convert, main, resolve_tag_dir
from pipeline.export.hf_adapter import ExportError, check_state_dict
from pipeline.model.build import model_from_meta
from pipeline.train.run_meta import RunMeta

pytestmark = pytest.mark.slow
ONE_RANK = "zero0-1rank-mlm"
TWO_RANKS = "zero2-2ranks-mlm-capt-mlmnce"


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
    "run, victim, message",
    [
        (TWO_RANKS, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "cannot consolidate the ZeRO checkpoint"),
        (ONE_RANK, "mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt: unreadable"),
    ],
)
def test_garbled_file_of_the_right_size(run, victim, message, checkpoint_copy, tmp_path, capsys):
    # Same size as recorded, so only the loader can notice: its failure is reported as ours.
    checkpoints = checkpoint_copy(run)
    path = _tag(checkpoints) / victim
    path.write_bytes(b"\0" * path.stat().st_size)
    out = tmp_path / "hf"
    err = _cli_error(capsys, checkpoints, out)
    assert message in err and _tag(checkpoints).name in err
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
    assert main([str(checkpoints), str(out), "--overwrite"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "model.safetensors" in summary["files"] and not (out / "keep.txt").exists()
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
