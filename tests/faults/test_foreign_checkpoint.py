"""Class: checkpoints from elsewhere. A checkpoint directory someone hands over is read without running
code from its pickles (`pipeline.safe_load`): a `.pt` whose pickle names anything outside the
types DeepSpeed and the project save is refused by `cpt-convert` and by a resume (exit 2), naming the
file and the type, even when the completeness record was rewritten to match the planted file."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.export.convert import main as convert_main
from pipeline.train.checkpoint.tags import COMPLETE_FILE, MODEL_STATES_FILE, TRAIN_STATE_FILE, tag_for_step
from pipeline.train.cli import EXIT_CONFIG_ERROR
from pipeline.safe_load import ALLOWED_GLOBAL_NAMES, load_pt, unsafe_checkpoint_problem
from tests.faults.faults import error_line
from tests.train.runs import latest, run_inprocess


class WritesAFile:
    """What a hostile pickle does: unpickling it calls `open(target, "w")`, creating the file."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


def plant(tag_dir: Path, name: str, marker: Path) -> None:
    """Add a `WritesAFile` to `name`'s pickle and rewrite the completeness record to match it."""
    path = tag_dir / name
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["planted"] = WritesAFile(marker)
    torch.save(state, path)
    record = json.loads((tag_dir / COMPLETE_FILE).read_text())
    record["files"][name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (tag_dir / COMPLETE_FILE).write_text(json.dumps(record))


PLANTED_FILES = [TRAIN_STATE_FILE, MODEL_STATES_FILE, "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


@pytest.fixture()
def planted_run(small_run: Path, tmp_path: Path, request) -> tuple[Path, Path, str]:
    """A copy of the small run whose step-2 checkpoint has one planted file: (its tag dir, marker, file name)."""
    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    marker = tmp_path / "planted-code-ran"
    tag = run / "checkpoints" / tag_for_step(2)
    plant(tag, request.param, marker)
    # The plant is live: a plain unpickling of the file runs it (then the marker is removed again).
    torch.load(tag / request.param, map_location="cpu", weights_only=False)
    assert marker.exists()
    marker.unlink()
    return tag, marker, request.param


@pytest.mark.parametrize("planted_run", PLANTED_FILES, indirect=True)
def test_convert_refuses_a_planted_pickle_and_runs_nothing(planted_run, tmp_path, capsys):
    tag, marker, name = planted_run
    out = tmp_path / "hf"
    assert convert_main([str(tag), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{tag / name}: refused: its pickle needs io.open" in err, err
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("planted_run", PLANTED_FILES, indirect=True)
def test_resume_refuses_a_planted_pickle_and_runs_nothing(planted_run, capsys):
    """A resume from the planted tag (an older tag of the run: nothing is set aside before it loads)."""
    tag, marker, name = planted_run
    run = tag.parent.parent
    shards = Path(json.loads((tag / "pipeline_meta.json").read_text())["config"]["data"]["shards_dir"])
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert run_inprocess("tiny-mlm", shards, run, f"train.resume={tag}", "train.total_steps=4",
                         "train.checkpoint_every=2", "train.keep_last=5") == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert f"{tag / name}: refused: its pickle needs io.open" in message, message
    assert not marker.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # no step ran, nothing saved


def test_a_planted_universal_conversion_is_refused_too(small_run, tmp_path):
    """`universal/` is loaded without being rebuilt once it exists, and it is outside the completeness
    record: the scan covers every `.pt` below the tag, recorded or not."""
    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    marker = tmp_path / "planted-code-ran"
    universal = latest(run) / "universal" / "zero" / "w"
    universal.mkdir(parents=True)
    torch.save({"param": torch.zeros(2), "x": WritesAFile(marker)}, universal / "fp32.pt")
    problem = unsafe_checkpoint_problem(latest(run))
    assert problem and problem.startswith(f"{universal / 'fp32.pt'}: refused") and "io.open" in problem
    assert not marker.exists()


def test_every_file_of_a_real_checkpoint_passes(small_run):
    assert unsafe_checkpoint_problem(latest(small_run)) is None


def test_the_allow_list_covers_the_loss_scalers_deepspeed_saves_in_fp16_and_bf16(tmp_path):
    """fp16/bf16 need a GPU to train; the objects their optimizers put into a checkpoint are built
    here as DeepSpeed builds them (`runtime/fp16/loss_scaler.py`, `utils/tensor_fragment.py`)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"loss_scaler": DynamicLossScaler(2.0 ** 16, 1000, 1.0, 2, False, dtype=torch.half),
             "static": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
             "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}], "flat": torch.ones(3)}
    torch.save(state, tmp_path / "optim.pt")
    loaded = load_pt(tmp_path / "optim.pt")
    assert loaded["loss_scaler"].cur_scale == 2.0 ** 16 and loaded["loss_scaler"].dtype == torch.half
    assert loaded["zero_stage"] is ZeroStageEnum.gradients
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=0)
    assert len(ALLOWED_GLOBAL_NAMES) == 4  # exactly these types: a new one is a decision, not a default


def test_every_file_of_a_universal_conversion_passes(small_run, tmp_path):
    """The universal conversion (`ds_to_universal`, written when a resume changes the rank count) is
    scanned too once it exists: every file it writes is within the allow-list."""
    from pipeline.train.checkpoint.load import ensure_universal

    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    ensure_universal(latest(run), is_main=True)
    assert len(list((latest(run) / "universal").rglob("*.pt"))) > 10
    assert unsafe_checkpoint_problem(latest(run)) is None


# ---- symbolic links, the universal path, and loads the scan does not see (issue 57) -------------------------
def _resume_from(tag: Path, *extra: str) -> int:
    run = tag.parent.parent
    shards = Path(json.loads((tag / "pipeline_meta.json").read_text())["config"]["data"]["shards_dir"])
    return run_inprocess("tiny-mlm", shards, run, f"train.resume={tag}", "train.total_steps=4",
                         "train.checkpoint_every=2", "train.keep_last=5", *extra)


#: a resume on another ZeRO stage: the universal path (`ensure_universal`, DeepSpeed's universal load), which a
#: checkpoint written by 2 ranks and resumed on 1 takes as well
UNIVERSAL = ("deepspeed.config=zero2", "train.allow_config_change=true")


def _planted_conversion(directory: Path, marker: Path) -> Path:
    """A universal conversion with its completion marker, one of whose files would write `marker`."""
    param = directory / "zero" / "bert.embeddings.word_embeddings.weight"
    param.mkdir(parents=True)
    torch.save({"param": torch.zeros(2), "x": WritesAFile(marker)}, param / "fp32.pt")
    (directory / COMPLETE_FILE).write_text("{}")
    return directory


def test_a_universal_directory_linked_from_outside_the_tag_is_refused_naming_the_link(small_run, tmp_path, capsys):
    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    marker = tmp_path / "planted-code-ran"
    tag = run / "checkpoints" / tag_for_step(2)
    outside = _planted_conversion(tmp_path / "elsewhere", marker)
    (tag / "universal").symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert _resume_from(tag, *UNIVERSAL) == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"{tag / 'universal'}: a symbolic link to {outside.resolve()}, outside the checkpoint"), \
        message
    assert not marker.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    out = tmp_path / "hf"
    assert convert_main([str(tag), str(out)]) == 2  # the converter reads the tag through the same check
    assert "a symbolic link to" in capsys.readouterr().err and not marker.exists() and not out.exists()


def test_a_file_linked_from_outside_is_refused_and_a_link_inside_the_tag_is_not(small_run, tmp_path):
    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    tag = latest(run)
    state = tag / TRAIN_STATE_FILE
    inside = tag / "copy_of_state.pt"
    inside.symlink_to(state)
    assert unsafe_checkpoint_problem(tag) is None
    outside = tmp_path / "outside.pt"
    shutil.copy(state, outside)
    inside.unlink()
    (tag / "extra.pt").symlink_to(outside)
    assert unsafe_checkpoint_problem(tag).startswith(f"{tag / 'extra.pt'}: a symbolic link to {outside}")


@pytest.mark.parametrize("path", ["same stage", "universal"])
@pytest.mark.parametrize("planted_run", [MODEL_STATES_FILE, "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                         indirect=True)
def test_nothing_is_unpickled_outside_the_restricted_loader_even_when_the_scan_misses_it(planted_run, path,
                                                                                          monkeypatch, capsys):
    """The class, not the instance: with the up-front scan switched off (a file swapped after it, one it never
    saw), DeepSpeed's own loads (`weights_only=False`; `ds_to_universal`, the universal load) still read every
    file with the restricted unpickler: refused by name, exit 2, the planted code never runs."""
    import pipeline.train.checkpoint.tags as checkpoint

    tag, marker, name = planted_run
    monkeypatch.setattr(checkpoint, "unsafe_checkpoint_problem", lambda tag_dir: None)
    extra = UNIVERSAL if path == "universal" else ()
    assert _resume_from(tag, *extra) == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert "refused: its pickle needs io.open" in message and name in message, message
    assert not marker.exists()
    assert not (tag / "universal").exists()  # no conversion of a refused tag is left to be reused


def test_the_restricted_loader_replaces_torch_load_inside_its_scope_only(tmp_path):
    from pipeline.safe_load import UnsafeCheckpointError, safe_unpickling

    marker = tmp_path / "ran"
    torch.save({"x": WritesAFile(marker)}, tmp_path / "f.pt")
    original = torch.load
    with safe_unpickling():
        with pytest.raises(UnsafeCheckpointError, match=r"f\.pt: refused: its pickle needs io\.open"):
            torch.load(tmp_path / "f.pt", weights_only=False)  # what DeepSpeed asks for
        with pytest.raises(UnsafeCheckpointError, match="pickle module"):
            import pickle
            torch.load(tmp_path / "f.pt", pickle_module=pickle)
    assert not marker.exists() and torch.load is original


def test_a_universal_conversion_of_another_tag_is_not_reused(small_run, tmp_path):
    """`universal/` is outside the completeness record: its own record names the tag it was made from and every
    file; a conversion copied from another tag (or edited) is converted again."""
    from pipeline.train.checkpoint.load import ensure_universal, universal_mismatch

    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    newest, older = run / "checkpoints" / tag_for_step(4), run / "checkpoints" / tag_for_step(2)
    ensure_universal(newest, is_main=True)
    assert universal_mismatch(newest) == ""
    shutil.copytree(newest / "universal", older / "universal")
    assert "converted from another checkpoint" in universal_mismatch(older)
    ensure_universal(older, is_main=True)
    assert universal_mismatch(older) == ""
    some = next((older / "universal").rglob("fp32.pt"))
    torch.save({"param": torch.ones(3)}, some)  # a file edited after the conversion
    assert "not the ones the conversion wrote" in universal_mismatch(older)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, tiny_shards_dir) -> Path:
    """A 4-step tiny MLM run on 2 ranks (torchrun, gloo; ZeRO-1, checkpoints at steps 2 and 4)."""
    from tests.faults.faults import copy_shards
    from tests.train.runs import run_torchrun

    base = tmp_path_factory.mktemp("two_rank_run")
    shards = copy_shards(tiny_shards_dir, base / "shards")
    run_torchrun("tiny-mlm", shards, base / "run", "train.total_steps=4", "train.checkpoint_every=2",
                 "train.keep_last=5")
    return base / "run"


def test_a_two_rank_checkpoint_resumed_on_one_rank_unpickles_only_through_the_restricted_loader(
        two_rank_run, tmp_path, monkeypatch, capsys):
    """The path issue 57 names: written by 2 ranks, resumed on 1 with no edit at all, the tag goes through
    `ensure_universal` (DeepSpeed's `ds_to_universal`) and the universal load, both `weights_only=False` in
    DeepSpeed. With the up-front scan off, a planted pickle in the second rank's optimizer file is refused by
    name there, and runs nothing."""
    import pipeline.train.checkpoint.tags as checkpoint

    run = Path(shutil.copytree(two_rank_run, tmp_path / "run"))
    tag = run / "checkpoints" / tag_for_step(2)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "planted-code-ran"
    plant(tag, name, marker)
    monkeypatch.setattr(checkpoint, "unsafe_checkpoint_problem", lambda tag_dir: None)
    assert _resume_from(tag) == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"{tag / name}: refused: its pickle needs io.open"), message
    assert not marker.exists()
