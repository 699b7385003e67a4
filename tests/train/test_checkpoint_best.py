"""The best checkpoint (`train.keep_best`, `train.keep_best_mode`; `pipeline.train.checkpoint.best`),
decided by the `Checkpointer`: a synthetic metric stream through `observe_metric` + `step_end` on a
fake engine: a strictly better value saves its step, `best.json` names it once the tag is complete,
`keep_last` pruning never deletes it, and the record survives resume (dropped only when it is not
this run's best any more). Then one real tiny run keeping its best training loss."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import load_config
from pipeline.train.checkpoint.tags import (
    COMPLETE_FILE,
    TRAIN_STATE_FILE,
    ResumeTarget,
    TrainState,
    is_complete,
    list_tags,
    read_latest,
    verify_checkpoint,
)
from pipeline.train.checkpoint.best import BEST_FILE, read_best
from pipeline.train.checkpoint.checkpointer import Checkpointer
from pipeline.train.config import TrainConfig
from pipeline.train.guard import NonFiniteGuard
from pipeline.train.run_meta import RunMeta
from tests.train.runs import metric_rows, run_inprocess, tag_dir
from tests.train.test_checkpoint_background import FakeEngine, meta


class LoadingEngine(FakeEngine):
    """`FakeEngine` that also "loads" a tag (DeepSpeed's `load_checkpoint` return value)."""

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs):
        return str(Path(load_dir) / tag), {}


class FakeModel(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)

    def extra_state_for_checkpoint(self) -> dict:
        return {}

    def load_extra_state_from_checkpoint(self, state: dict) -> None:
        pass


class FakeRun:
    """What `Checkpointer.step_end` reads of a `pipeline.train.loop.Run`."""

    def __init__(self, state: TrainState) -> None:
        self.engine, self.model, self.state, self.meta = LoadingEngine(), FakeModel(), state, meta()
        self.device = torch.device("cpu")
        self.guard = NonFiniteGuard(10, False, 0.0, 0.0)
        self.batches = SimpleNamespace(dataset=None, seed=0, consumed_samples=0)  # one directory: no mixture record


def train_cfg(out: Path, **fields) -> TrainConfig:
    defaults = dict(output_dir=str(out), total_steps=12, checkpoint_every=3, keep_last=1, keep_best="val/loss",
                    keep_best_mode="min")
    return TrainConfig(**{**defaults, **fields})


def walk(checkpointer: Checkpointer, run: FakeRun, steps: range, stream: dict[int, float]) -> list[int]:
    """Steps `steps` with `stream`'s value observed at its steps; returns the steps that were saved."""
    saved = []
    for step in steps:
        run.state.step = step
        if step in stream:
            checkpointer.observe_metric(step, {"val/loss": stream[step], "loss": 9.0})
        if checkpointer.step_end(run, step, False, {"loss": 9.0}):
            saved.append(step)
    checkpointer.settle()
    return saved


def steps_on_disk(root: Path) -> list[int]:
    return [s for s, p in list_tags(root) if is_complete(p)]


def test_a_better_value_saves_its_step_and_pruning_keeps_it(tmp_path):
    checkpointer = Checkpointer(train_cfg(tmp_path), is_main=True)
    run = FakeRun(TrainState())
    stream = {2: 5.0, 4: 3.0, 6: 4.0, 8: 3.0, 10: float("nan")}  # 8 ties (not better); NaN is never a best
    assert walk(checkpointer, run, range(1, 13), stream) == [2, 3, 4, 6, 9, 12]  # every 3rd, the last, the bests
    root = tmp_path / "checkpoints"
    best = read_best(root)
    assert (best.metric, best.mode, best.value, best.step, best.tag) == ("val/loss", "min", 3.0, 4, "step_00000004")
    # keep_last=1: latest (12), the newest confirmed-healthy one before it (9), and the best (4)
    assert steps_on_disk(root) == [4, 9, 12] and read_latest(root).name == "step_00000012"
    verify_checkpoint(root / best.tag, check_hashes=True)  # an ordinary complete tag: resumable, convertible
    assert json.loads((root / BEST_FILE).read_text())["tag"] == "step_00000004"


def test_max_mode_and_strictness(tmp_path):
    checkpointer = Checkpointer(train_cfg(tmp_path, keep_best="val/accuracy", keep_best_mode="max",
                                          checkpoint_every=100), is_main=True)
    run = FakeRun(TrainState())
    saved = []
    for step, value in [(1, 0.2), (2, 0.1), (3, 0.2), (4, 0.5), (5, -math.inf)]:
        run.state.step = step
        assert checkpointer.observe_metric(step, {"val/accuracy": value}) == (step in (1, 4))  # 3 ties: not better
        saved += [step] if checkpointer.step_end(run, step, False, {}) else []
    checkpointer.settle()
    assert saved == [1, 4] and read_best(tmp_path / "checkpoints").value == 0.5
    assert not checkpointer.observe_metric(6, {"loss": 1.0})  # the metric is not in this set: nothing to judge
    assert not Checkpointer(train_cfg(tmp_path, keep_best=""), is_main=True).observe_metric(1, {"val/loss": 0.0})


def resume(out: Path, step: int, **fields) -> tuple[Checkpointer, TrainState]:
    checkpointer = Checkpointer(train_cfg(out, **fields), is_main=True)
    tag = out / "checkpoints" / f"step_{step:08d}"
    target = ResumeTarget(tag, RunMeta.read(tag), universal=False)
    state = checkpointer.load(LoadingEngine(), target, FakeModel())
    return checkpointer, state


def test_the_best_survives_resume(tmp_path):
    walk(Checkpointer(train_cfg(tmp_path), is_main=True), FakeRun(TrainState()), range(1, 13), {2: 5.0, 4: 3.0})
    checkpointer, state = resume(tmp_path, 12, total_steps=20)
    assert state.step == 12 and checkpointer.best.tag == "step_00000004"
    run = FakeRun(state)
    saved = walk(checkpointer, run, range(13, 21), {14: 3.5, 16: 2.0})  # 3.5 is no better than the resumed 3.0
    root = tmp_path / "checkpoints"
    assert saved == [15, 16, 18, 20] and read_best(root).tag == "step_00000016"
    assert steps_on_disk(root) == [16, 18, 20]  # the old best (4) is pruned once 16 is the best


@pytest.mark.parametrize("change, why", [
    ({"keep_best": "val/mlm/loss"}, "another metric"),
    ({"keep_best_mode": "max"}, "another direction"),
])
def test_a_changed_keep_best_starts_afresh(tmp_path, change, why):
    walk(Checkpointer(train_cfg(tmp_path), is_main=True), FakeRun(TrainState()), range(1, 13), {4: 3.0})
    checkpointer, _ = resume(tmp_path, 12, total_steps=20, **change)
    assert checkpointer.best is None and not (tmp_path / "checkpoints" / BEST_FILE).exists(), why


def test_a_best_after_the_resumed_tag_is_replaced_by_the_best_as_of_that_tag(tmp_path):
    """`train.resume=<older tag>`: a best from the set-aside future is not this run's; the resumed tag's own
    record (`RunMeta.best`) says which was the best at its step."""
    walk(Checkpointer(train_cfg(tmp_path, checkpoint_every=2, keep_last=10), is_main=True), FakeRun(TrainState()),
         range(1, 13), {4: 5.0, 9: 1.0})
    assert read_best(tmp_path / "checkpoints").step == 9
    checkpointer, _ = resume(tmp_path, 6, keep_last=10)
    assert checkpointer.best.step == 4 and read_best(tmp_path / "checkpoints") == checkpointer.best


def test_keep_best_mode_is_checked():
    with pytest.raises(ConfigError, match=r"train.keep_best_mode='lowest': use 'min' or 'max'"):
        load_config("tiny-mlm", ["train.keep_best=val/loss", "train.keep_best_mode=lowest"])


def test_a_run_keeps_the_checkpoint_of_its_best_loss(tiny_shards_dir, tmp_path):
    """`train.keep_best=loss`: the checkpoint of the step with the lowest logged loss is kept (and
    named by best.json) besides keep_last=1, through the run and its resumed extension."""
    out = tmp_path / "run"
    args = ["train.total_steps=6", "train.checkpoint_every=100", "train.keep_last=1", "train.keep_best=loss"]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *args) == 0
    rows = metric_rows(out)
    losses = [rows[s]["loss"] for s in range(1, 7)]
    best_step = 1 + losses.index(min(losses))  # the first step reaching the minimum
    best = read_best(out / "checkpoints")
    assert (best.step, best.value) == (best_step, min(losses))
    assert is_complete(tag_dir(out, best_step)) and is_complete(tag_dir(out, 6))
    assert torch.load(tag_dir(out, best_step) / TRAIN_STATE_FILE, weights_only=False)["step"] == best_step
    assert json.loads((tag_dir(out, best_step) / COMPLETE_FILE).read_text())["healthy"] is True
    assert math.isfinite(best.value)
