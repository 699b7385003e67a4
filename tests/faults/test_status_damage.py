"""`cpt-status` on damaged or unusual run files (issue 49): each read ends with one clear line, never a
traceback, and says what it skipped.

* a `metrics.jsonl` line that is not a JSON object (a bare number, invalid UTF-8) is skipped and
  reported by its line number; the other records are read as before;
* a truncated `run_state.json` is called damaged (not "no exit record"); a non-numeric `exit_code`
  too; the state then comes from the files (finished when the final checkpoint is there);
* a run that was killed (its record says running, its process is gone) shows no ETA;
* resume's cut-back of `metrics.jsonl` (`truncate_jsonl`) reads such lines the same way (drops them);
* the suggested `cpt-convert` writes into the run directory (`RUN/hf/step<N>`), and that export
  leaves the directory a run `cpt-status` reads as before.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.status import main as status_main
from pipeline.train.exit_record import RUN_STATE_FILE


def status_json(capsys, run: Path) -> dict:
    capsys.readouterr()
    assert status_main([str(run), "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()  # --json: one object per run, one per line
    s = json.loads(line)
    return s


def status_text(capsys, run: Path) -> str:
    capsys.readouterr()
    assert status_main([str(run)]) == 0
    return capsys.readouterr().out


@pytest.fixture
def run_copy(small_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished 4-step run (faults/conftest.py), to damage."""
    return Path(shutil.copytree(small_run, tmp_path / "run"))


def test_a_bad_metrics_line_is_skipped_and_reported(run_copy, capsys):
    before = status_json(capsys, run_copy)
    lines = (run_copy / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) >= 3
    damaged = lines[:1] + [b"5\n"] + lines[1:2] + [b"\xff\xfe{\"step\": 2}\n"] + lines[2:]
    (run_copy / "metrics.jsonl").write_bytes(b"".join(damaged))
    s = status_json(capsys, run_copy)
    assert s["metrics_skipped"] == ["line 2: not a JSON object (5)", "line 4: invalid UTF-8 (byte 1)"]
    assert (s["state"], s["step"], s["loss"], s["signals"]) == (before["state"], 4, before["loss"], before["signals"])
    assert ("  metrics     2 unreadable line(s) of metrics.jsonl skipped: line 2: not a JSON object (5); "
            "line 4: invalid UTF-8 (byte 1)") in status_text(capsys, run_copy)
    assert before["metrics_skipped"] == []


def test_a_truncated_run_state_is_called_damaged(run_copy, tmp_path, capsys):
    record = (run_copy / RUN_STATE_FILE).read_text()
    (run_copy / RUN_STATE_FILE).write_text(record[: len(record) // 2])
    s = status_json(capsys, run_copy)
    assert s["state"] == "finished" and s["exit_code"] is None  # from the files: the final checkpoint is there
    assert s["detail"].startswith(f"finished ({RUN_STATE_FILE} is damaged: not valid JSON (")
    assert "truncated?); final checkpoint written)" in s["detail"]

    early = tmp_path / "early"  # no checkpoint: nothing says how it ended
    early.mkdir()
    (early / RUN_STATE_FILE).write_text('{"state": "exi')
    s = status_json(capsys, early)
    assert s["state"] == "unknown" and s["detail"].startswith(f"unknown ({RUN_STATE_FILE} is damaged: not valid JSON")


@pytest.mark.parametrize("code", ["oops", None, [1]])
def test_a_non_numeric_exit_code_is_damage_not_a_traceback(run_copy, capsys, code):
    record = {**json.loads((run_copy / RUN_STATE_FILE).read_text()), "state": "exited"}  # (run in-process: "running")
    (run_copy / RUN_STATE_FILE).write_text(json.dumps({**record, "exit_code": code}))
    s = status_json(capsys, run_copy)
    assert s["state"] == "finished" and s["exit_code"] is None
    assert s["detail"] == (f"finished ({RUN_STATE_FILE} is damaged: exit_code {code!r} is not a number; "
                           "final checkpoint written)")
    (run_copy / RUN_STATE_FILE).write_text(json.dumps({**record, "exit_code": "4"}))  # a numeric string is read
    assert status_json(capsys, run_copy)["exit_code"] == 4


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_run_shows_no_eta(tmp_path, capsys):
    import socket

    run = tmp_path / "killed"
    run.mkdir()
    rows = [{"step": step, "loss": 5.0 - 0.1 * step, "step_time_s": 0.5, "tokens_per_s": 1000.0, "tokens_seen": 64 * step}
            for step in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"state": "running", "pid": _dead_pid(), "host": socket.gethostname(), "total_steps": 100, "name": "k"}
    (run / RUN_STATE_FILE).write_text(json.dumps(record))
    s = status_json(capsys, run)
    assert s["state"] == "died" and s["step"] == 10 and s["eta_s"] is None
    assert "ETA -" in status_text(capsys, run)
    record["host"] = "another-host"  # cannot tell from here: still running, with its ETA
    (run / RUN_STATE_FILE).write_text(json.dumps(record))
    assert status_json(capsys, run)["eta_s"] == pytest.approx(90 * 0.5)


def test_the_suggested_conversion_writes_into_the_run_directory(run_copy, capsys):
    from pipeline.export.convert import main as convert_main

    s = status_json(capsys, run_copy)
    tag = run_copy / "checkpoints" / "step_00000004"
    assert s["convert_command"] == f"cpt-convert {tag} {run_copy / 'hf' / 'step4'}"
    program, source, target = s["convert_command"].split()
    assert program == "cpt-convert" and convert_main([source, target]) == 0  # the command, as printed, works
    assert (run_copy / "hf" / "step4" / "config.json").is_file()
    again = status_json(capsys, run_copy)  # the export inside the run changes nothing cpt-status reads
    assert {k: again[k] for k in ("state", "step", "checkpoint", "convert_command", "checkpoint_bytes")} == {
        k: s[k] for k in ("state", "step", "checkpoint", "convert_command", "checkpoint_bytes")}


def test_resume_cuts_back_a_metrics_file_with_bad_lines(tmp_path):
    """What resume does to metrics.jsonl (`truncate_jsonl`, back to the checkpoint's step) reads it as
    `cpt-status` does: a bare number or invalid UTF-8 was an AttributeError / UnicodeDecodeError there."""
    from pipeline.train.metrics import read_jsonl, truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 3.0}\n5\n\xff\xfe\n{"step": 2, "loss": 2.0}\n{"step": 3, "loss": 1.0}\n')
    truncate_jsonl(path, 2)
    skipped: list[str] = []
    assert read_jsonl(path, skipped) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}] and skipped == []
