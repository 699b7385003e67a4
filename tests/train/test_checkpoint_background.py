"""Checkpoint hashing off the critical path: `save_checkpoint` returns once the files are written,
a `CheckpointFinisher` thread records the hashes, and `latest` still moves only after the complete
record exists; a failure there leaves the previous checkpoint in charge and surfaces on `wait()` and at the next save."""
from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

import pipeline.train.checkpoint.tags as ckpt
from pipeline.io import sha256_file
from pipeline.train.run_meta import RunMeta


class BytesWriter:
    """DeepSpeed's checkpoint-engine interface (`save(state, path)`), writing bytes."""

    def save(self, state: bytes, path: str) -> None:
        Path(path).write_bytes(state)


class FakeEngine:
    """Writes one file per tag through its `checkpoint_engine`, as DeepSpeed's `save_checkpoint` does."""

    def __init__(self) -> None:
        self.checkpoint_engine = BytesWriter()

    def save_checkpoint(self, root: str, tag: str, client_state: dict, save_latest: bool) -> None:
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        state = io.BytesIO()  # a real torch file: a verified tag's .pt files are unpickled (safe_load)
        torch.save({"tag": tag, "module": {"w": torch.zeros(1000)}}, state)
        self.checkpoint_engine.save(state.getvalue(), str(Path(root) / tag / "mp_rank_00_model_states.pt"))


def meta() -> RunMeta:
    return RunMeta(encoder_config={}, objectives={"mlm": 1.0}, objective_options={}, special_tokens={},
                   tokenizer_dir="", data_dir="", manifest_hash="m", config_hash="c", config={})


def save(root: Path, step: int, finisher: ckpt.CheckpointFinisher) -> Path:
    return ckpt.save_checkpoint(FakeEngine(), root, ckpt.TrainState(step=step), meta(), keep_last=2, is_main=True,
                                finisher=finisher)


def test_latest_moves_only_after_the_hashed_record_exists(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    finisher = ckpt.CheckpointFinisher()
    save(root, 1, finisher)
    finisher.wait()
    assert ckpt.read_latest(root) == root / "step_00000001"

    hashing, release = threading.Event(), threading.Event()
    real_listing = ckpt._listing

    def slow_listing(tag_dir):
        hashing.set()
        assert release.wait(10)
        return real_listing(tag_dir)

    monkeypatch.setattr(ckpt, "_listing", slow_listing)
    tag = save(root, 2, finisher)  # returns while the hashes are still being computed
    assert hashing.wait(10)
    assert not (tag / ckpt.COMPLETE_FILE).exists() and ckpt.read_latest(root) == root / "step_00000001"
    assert (tag / ckpt.TRAIN_STATE_FILE).is_file()  # the step's own files are already written
    release.set()
    finisher.wait()
    record = json.loads((tag / ckpt.COMPLETE_FILE).read_text())
    assert record["step"] == 2 and ckpt.read_latest(root) == tag
    for name, entry in record["files"].items():
        assert entry["sha256"] == sha256_file(tag / name)
    ckpt.verify_checkpoint(tag, check_hashes=True)


def test_the_next_save_waits_for_the_previous_completion_and_keeps_the_order(tmp_path):
    root = tmp_path / "checkpoints"
    finisher = ckpt.CheckpointFinisher()
    for step in (1, 2, 3):
        save(root, step, finisher)
    finisher.wait()
    assert ckpt.read_latest(root) == root / "step_00000003"
    assert [s for s, _ in ckpt.list_tags(root)] == [2, 3]  # pruned to keep_last=2 in the thread
    assert all(ckpt.is_complete(p) for _, p in ckpt.list_tags(root))


def test_a_failed_completion_keeps_the_previous_checkpoint_and_is_reported(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    finisher = ckpt.CheckpointFinisher()
    save(root, 1, finisher)
    assert finisher.wait() == ""

    def full_disk(tag_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_listing", full_disk)
    tag = save(root, 2, finisher)
    problem = finisher.wait()
    assert "no space left on device" in problem.lower() and "step_00000002 was not completed" in problem
    assert ckpt.read_latest(root) == root / "step_00000001" and not tag.exists()  # its space is freed
    assert finisher.wait() == ""  # reported once


def test_the_next_save_reports_a_failed_background_completion(tmp_path, monkeypatch):
    """The failure surfaces as the same `CheckpointWriteError` (exit 4) the synchronous path raises."""
    root = tmp_path / "checkpoints"
    finisher = ckpt.CheckpointFinisher()
    save(root, 1, finisher)
    assert finisher.wait() == ""
    real_listing = ckpt._listing
    monkeypatch.setattr(ckpt, "_listing", lambda tag_dir: (_ for _ in ()).throw(OSError(28, "No space left")))
    save(root, 2, finisher)
    with pytest.raises(ckpt.CheckpointWriteError, match="step_00000002 was not completed.*latest still names "
                                                        "step_00000001"):
        save(root, 3, finisher)
    monkeypatch.setattr(ckpt, "_listing", real_listing)
    save(root, 3, finisher)  # space is back: saving goes on
    assert finisher.wait() == "" and ckpt.read_latest(root) == root / "step_00000003"


def test_a_complete_tag_saved_again_moves_latest_that_a_kill_left_behind(tmp_path):
    """Killed between a tag's COMPLETE.json and `latest` (both written on the finisher's thread): the
    resumed run reaches that step, keeps the complete tag as it is, and moves `latest` to it."""
    root = tmp_path / "checkpoints"
    finisher = ckpt.CheckpointFinisher()
    save(root, 1, finisher)
    tag = save(root, 2, finisher)
    assert finisher.wait() == "" and ckpt.read_latest(root) == tag
    (root / ckpt.LATEST_FILE).write_text("step_00000001")  # what the kill left: the older pointer
    before = (tag / ckpt.COMPLETE_FILE).read_text()
    assert save(root, 2, finisher) == tag  # the resumed run's save of step 2
    assert ckpt.read_latest(root) == tag and (tag / ckpt.COMPLETE_FILE).read_text() == before  # not rewritten
    save(root, 1, finisher)  # a complete tag older than `latest` never moves it back
    assert ckpt.read_latest(root) == tag
