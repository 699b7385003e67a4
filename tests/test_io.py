"""`pipeline.io.write_atomic` when two writers meet on one path: the study's parallel SLURM tasks each record
the same cached file (`top_token.json`, a run's `train.json`, a task's `select.tsv`), and every report file
goes through the same call (`pipeline.report_files`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.io import write_atomic
from pipeline.report_files import write_json


def _another_writer_between_write_and_rename(monkeypatch, write_b) -> None:
    """The first fsync of the next write (A's, after its bytes are written) runs writer B to the end first:
    B writes and renames while A is between its write and its rename, the race of two processes."""
    real_fsync, ran = os.fsync, []

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if not ran:
            ran.append(fd)
            write_b()

    monkeypatch.setattr(os, "fsync", fsync)


def test_shared_writers_of_one_path_each_rename_their_own_whole_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "tasks" / "sst2" / "select.tsv"  # no folder yet: `parents`
    seen_b = []
    _another_writer_between_write_and_rename(monkeypatch, lambda: (
        write_atomic(target, "B" * 1000, shared=True, parents=True), seen_b.append(target.read_text())))
    write_atomic(target, "A" * 5000, shared=True, parents=True)
    assert seen_b == ["B" * 1000]  # B's version was whole when it landed
    assert target.read_text() == "A" * 5000  # the last rename wins, whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["select.tsv"]  # no temporary left behind


def test_one_temporary_per_path_is_why_shared_exists(tmp_path: Path, monkeypatch) -> None:
    """The default (`<path>.tmp`, one writer per path: checkpoints, manifests) under the same race: B truncates
    and renames A's temporary, and A's rename then finds none. What `shared=True` is for."""
    target = tmp_path / "record.json"
    _another_writer_between_write_and_rename(monkeypatch, lambda: write_atomic(target, "B" * 1000))
    with pytest.raises(FileNotFoundError):
        write_atomic(target, "A" * 5000)


def test_report_files_are_shared_writes(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "runs" / "mlm" / "train.json"
    _another_writer_between_write_and_rename(monkeypatch, lambda: write_json(target, {"writer": "B"}))
    write_json(target, {"writer": "A", "pad": "x" * 4000})
    assert json.loads(target.read_text())["writer"] == "A"
    assert sorted(p.name for p in target.parent.iterdir()) == ["train.json"]
