"""Experiment trackers (`train.trackers`, `pipeline.train.trackers`): W&B offline and MLflow with a
local file store get the same scalars as `metrics.jsonl` and the run's config, read back with the
libraries' own readers (W&B: its offline run file, decoded with wandb's own protobuf `Record`;
MLflow: `mlflow.search_runs` and the client's metric history); a killed-and-resumed run continues
the same tracker runs; a tracker whose package is missing is refused before compute with the install
line; a tracker that fails mid-run costs one warning, never the run.

No network: `WANDB_MODE=offline`, `WANDB_SILENT=true`, no API key; MLflow's store is a `file://`
directory under `tmp_path`."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from pipeline.status import collect, format_detail, tracker_text
from pipeline.train.trackers import IDS_FILE, STEP_KEY
from tests.train.runs import DEADLINE_S, REPO, _env, losses, output_of, run_inprocess, train_command, wait_for_step

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_API_KEY": "",
           "MLFLOW_ALLOW_FILE_STORE": "true"}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no ~/.config/wandb settings
    for key in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_TAGS", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


# ---- W&B offline run files: leveldb-log framed protobuf `Record`s (wandb's `.wandb` format) ----------------
_BLOCK, _HEADER = 32768, 7  # block size; record header: crc32c (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every `Record` of a `.wandb` file (a torn tail, as after a SIGKILL, ends the list)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, chunks, records = 7, [], []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        payload = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            break
        chunks.append(payload)
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def finished_run_files(out: Path, newest: Optional[int] = None) -> list[Path]:
    """The offline run files of `out`, oldest first, once the `newest` of them (all: None) hold their exit
    record. `run.finish()` returns before wandb-core closes the run's file, and only then do its last
    records (all of a short run's) reach it: wandb-core's leveldb-log writer writes a 32 KiB block when
    it is full or closed."""
    from google.protobuf.message import DecodeError  # protobuf comes with wandb

    deadline = time.monotonic() + DEADLINE_S
    while True:
        files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
        try:
            kinds = [{r.WhichOneof("record_type") for r in wandb_records(f)} for f in files]
        except DecodeError:  # a block caught mid-write
            kinds = []
        if kinds and all("exit" in k for k in kinds[-(newest or len(kinds)):]):
            return files
        assert time.monotonic() < deadline, f"{files}: no exit record after {DEADLINE_S} s (run never finished)"
        time.sleep(0.01)


def wandb_runs(out: Path) -> dict[str, dict]:
    """run id -> {"config": ..., "history": {step: {key: value}}} over every offline run directory
    (a resumed offline run is a second directory with the same run id)."""
    runs: dict[str, dict] = {}
    for run_file in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        entry = None
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                entry = runs.setdefault(record.run.run_id, {"config": {}, "history": {}})
                for item in record.run.config.update:
                    entry["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                row = {"/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json)
                       for i in record.history.item}
                entry["history"][int(row[STEP_KEY])] = row
    return runs


def subprocess_env() -> dict:
    """The training subprocess's environment: offline, and without this process's W&B service
    (`WANDB_SERVICE`, exported by an in-process run before): a child attached to it would leave its
    run registered there when killed, and the resume here would find the run id "in use"."""
    env = _env(OFFLINE)
    env.pop("WANDB_SERVICE", None)
    return env


def jsonl_scalars(out: Path) -> dict[int, dict]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        rows[step] = {k: v for k, v in record.items() if isinstance(v, (int, float))}
    return rows


def mlflow_run(uri: str) -> tuple:
    """(the only run of the store as a `search_runs` row, its client)."""
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(search_all_experiments=True)
    return runs, mlflow.tracking.MlflowClient(tracking_uri=uri)


def test_wandb_and_mlflow_get_the_scalars_and_the_config(offline, tiny_shards_dir):
    out, uri = offline / "run", (offline / "mlruns").as_uri()
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=4", "train.trackers=[jsonl,wandb,mlflow]",
                         f"train.mlflow_tracking_uri={uri}", "train.tracker_project=trk-test",
                         "train.tracker_tags=[smoke]") == 0
    expected = jsonl_scalars(out)
    assert sorted(expected) == [1, 2, 3, 4] and "loss" in expected[4] and "lr" in expected[4]

    finished_run_files(out)
    runs = wandb_runs(out)
    assert list(runs) == [json.loads((out / IDS_FILE).read_text())["wandb"]["run_id"]]
    (run,) = runs.values()
    assert run["config"]["config"]["train"]["total_steps"] == 4 and run["config"]["recipe"]["preset"] == "tiny-mlm"
    assert sorted(run["history"]) == [1, 2, 3, 4]
    for step, row in expected.items():
        for key, value in row.items():
            assert run["history"][step][key] == pytest.approx(value, rel=1e-12, nan_ok=True), (step, key)

    table, client = mlflow_run(uri)
    assert len(table) == 1 and table["tags.mlflow.runName"][0] == "run" and table["tags.smoke"][0] == "true"
    assert table["params.train.total_steps"][0] == "4" and table["params.recipe.preset"][0] == "tiny-mlm"
    assert table["metrics.loss"][0] == pytest.approx(expected[4]["loss"], rel=1e-12)
    run_id = table["run_id"][0]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps", "mlm/accuracy", "health/unigram_accuracy"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == pytest.approx({s: r[key] for s, r in expected.items()}, rel=1e-12), key


def test_killed_and_resumed_run_is_one_tracker_run(offline, tiny_shards_dir):
    out, uri = offline / "run", (offline / "mlruns").as_uri()
    args = ["train.total_steps=40", "train.checkpoint_every=4", "train.trackers=[jsonl,wandb,mlflow]",
            f"train.mlflow_tracking_uri={uri}"]
    proc = subprocess.Popen(train_command("tiny-mlm", tiny_shards_dir, out, *args), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(out, 6, proc)
    proc.kill()
    assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL, "the run finished before it could be killed"
    ids = json.loads((out / IDS_FILE).read_text())
    killed = collect(out)  # cpt-status: the record says running, its process is gone
    assert killed.state == "died" and killed.detail.startswith(f"died: process {proc.pid} ")

    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *args) == 0  # resume="auto" from the step-4 checkpoint
    assert json.loads((out / IDS_FILE).read_text()) == ids
    finished_run_files(out, newest=1)  # the resumed run's (the killed one's never gets an exit record)
    assert list(wandb_runs(out)) == [ids["wandb"]["run_id"]]  # two offline directories, one run id
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2
    table, client = mlflow_run(uri)
    assert list(table["run_id"]) == [ids["mlflow"]["run_id"]] and table["status"][0] == "FINISHED"
    steps = {m.step for m in client.get_metric_history(ids["mlflow"]["run_id"], "loss")}
    assert steps == set(range(1, 41))
    resumed = collect(out)  # cpt-status names the one tracker run of each, and the sync line for W&B
    assert resumed.trackers == ids and resumed.wandb_offline_runs == 2
    assert tracker_text(resumed) == (f"wandb run {ids['wandb']['run_id']} (2 offline: wandb sync {out / 'wandb'}/"
                                     f"offline-run-*); mlflow run {ids['mlflow']['run_id']} at {uri}")
    assert f"  trackers    {tracker_text(resumed)}" in format_detail(resumed).splitlines()


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_package_is_refused_before_compute(tracker, tiny_shards_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import <tracker>` now raises ImportError
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, f"train.trackers=[jsonl,{tracker}]") == 2
    err = capsys.readouterr().err
    assert f'error: train.trackers lists {tracker}, but {tracker} is not installed here' in err
    assert f'pip install ".[{tracker}]"' in err
    assert not out.exists(), "the run wrote something before refusing"


def test_tensorboard_switch_still_drops_tensorboard():
    from pipeline.train.run_config import load_config

    assert load_config("tiny-mlm").train.active_trackers() == ["tensorboard", "jsonl"]
    assert load_config("tiny-mlm", ["train.tensorboard=false"]).train.active_trackers() == ["jsonl"]
    cfg = load_config("tiny-mlm", ["train.trackers=[mlflow,jsonl,tensorboard]", "train.tensorboard=false"])
    assert cfg.train.active_trackers() == ["mlflow", "jsonl"]
    assert load_config("tiny-mlm", ["train.trackers=jsonl"]).train.trackers == ["jsonl"]  # one name: a list of one


@pytest.mark.parametrize("override, message", [
    ("train.trackers=[jsonl,neptune]", "train.trackers: unknown tracker 'neptune'; choose from tensorboard, wandb, "
                                       "mlflow, jsonl"),
    ("train.trackers=[jsonl,jsonl]", "train.trackers: jsonl listed more than once"),
    ("train.trackers=5", "train.trackers: expected a list, got 5"),
    ("train.tracker_tags=[a,{b: 1}]", "train.tracker_tags[1]: expected str"),
])
def test_bad_tracker_fields_are_one_line_errors(override, message):
    from pipeline.config.checks import ConfigError
    from pipeline.train.run_config import load_config

    with pytest.raises(ConfigError) as err:
        load_config("tiny-mlm", [override])
    assert str(err.value).startswith(message)


def test_a_tracker_failing_mid_run_costs_one_warning(offline, tiny_shards_dir):
    """MLflow's file store is replaced by a plain file mid-run (the process stopped meanwhile with
    SIGSTOP, so the swap falls between two logged steps). The tests run as root, where a read-only
    directory does not stop writes; a file in a directory's place fails every write into it."""
    out, store = offline / "run", offline / "mlruns"
    total = 60
    proc = subprocess.Popen(
        train_command("tiny-mlm", tiny_shards_dir, out, f"train.total_steps={total}", "train.checkpoint_every=1000",
                      "train.trackers=[jsonl,mlflow]", f"train.mlflow_tracking_uri={store.as_uri()}"),
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(out, 2, proc)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        swapped_at = max(losses(out))
        assert swapped_at < total, "the run finished before the store could be broken"
        store.rename(offline / "mlruns.moved")
        store.write_text("not a directory\n")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=DEADLINE_S) == 0
    output = output_of(proc)
    assert output.count("tracker mlflow failed") == 1, output[-3000:]
    assert "the run goes on without it" in output
    assert sorted(losses(out)) == list(range(1, total + 1))  # training and metrics.jsonl went on
    store.unlink()
    shutil.move(str(offline / "mlruns.moved"), str(store))
    table, client = mlflow_run(store.as_uri())
    logged = {m.step for m in client.get_metric_history(table["run_id"][0], "loss")}
    # metrics.jsonl gets step k before MLflow does (MetricsWriter.write), so the SIGSTOP can fall
    # between the two: MLflow then holds up to step k-1 or k, and never anything after the swap.
    assert logged == set(range(1, max(logged) + 1)) and swapped_at - 1 <= max(logged) <= swapped_at


def wandb_endings(out: Path) -> list[tuple[int, bool]]:
    """(exit code, marked preempting) of each offline run directory, oldest first."""
    endings = []
    for run_file in finished_run_files(out):
        kinds = {r.WhichOneof("record_type"): r for r in wandb_records(run_file)}
        endings.append((kinds["exit"].exit.exit_code, "preempting" in kinds))
    return endings


def test_tracker_runs_end_as_the_training_run_ended(offline, tiny_shards_dir):
    """Stopped for requeue (SIGTERM, exit 75): MLflow KILLED, W&B preempting with exit code 75; the
    requeued run finishes the same tracker runs (FINISHED, exit 0). A diverged run (exit 3): FAILED,
    exit code 1."""
    from tests.test_status import DIVERGE_BLOW_UP, DIVERGE_FIRST

    out, uri = offline / "run", (offline / "mlruns").as_uri()
    trackers = ["train.trackers=[jsonl,wandb,mlflow]", f"train.mlflow_tracking_uri={uri}"]
    proc = subprocess.Popen(train_command("tiny-mlm", tiny_shards_dir, out, "train.total_steps=5000",
                                          "train.checkpoint_every=1000", *trackers),
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=DEADLINE_S) == 75, output_of(proc)[-3000:]
    table, _ = mlflow_run(uri)
    assert list(table["status"]) == ["KILLED"]
    assert wandb_endings(out) == [(75, True)]

    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=6", "train.allow_config_change=true",
                         *trackers) == 0
    table, _ = mlflow_run(uri)
    assert list(table["status"]) == ["FINISHED"]  # the same MLflow run, not a second one
    assert wandb_endings(out) == [(75, True), (0, False)]

    diverged, diverged_uri = offline / "diverged", (offline / "mlruns-diverged").as_uri()
    trackers = ["train.trackers=[jsonl,wandb,mlflow]", f"train.mlflow_tracking_uri={diverged_uri}"]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, diverged, *DIVERGE_FIRST, *trackers) == 0
    assert run_inprocess("tiny-mlm", tiny_shards_dir, diverged, *DIVERGE_BLOW_UP, *trackers) == 3
    table, _ = mlflow_run(diverged_uri)
    assert list(table["status"]) == ["FAILED"]
    assert wandb_endings(diverged) == [(0, False), (1, False)]


def test_a_rewind_starts_new_tracker_runs_linked_to_their_parents(offline, tiny_shards_dir):
    """A branch from an older tag with another learning rate (`train.allow_config_change`): the first
    trajectory's steps 5-8 stay in the first tracker runs, the branch's go to new runs tagged with their
    parent and the branch step, so no tracker run holds two losses at one step (issue 49, item 5)."""
    from tests.train.runs import tag_dir

    out, uri = offline / "run", (offline / "mlruns").as_uri()
    args = ["train.total_steps=8", "train.checkpoint_every=4", "train.keep_last=5",
            "train.trackers=[jsonl,wandb,mlflow]", f"train.mlflow_tracking_uri={uri}"]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *args) == 0
    first, first_losses = json.loads((out / IDS_FILE).read_text()), losses(out)
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *args, f"train.resume={tag_dir(out, 4)}", "optim.lr=5e-4",
                         "train.allow_config_change=true") == 0
    ids, branch_losses = json.loads((out / IDS_FILE).read_text()), losses(out)
    assert branch_losses[6] != first_losses[6]  # another trajectory (step 5 updates at the new rate)
    for name in ("wandb", "mlflow"):
        assert ids[name]["run_id"] != first[name]["run_id"]
        assert (ids[name]["parent_run_id"], ids[name]["branched_at_step"]) == (first[name]["run_id"], 4)
    table, client = mlflow_run(uri)
    assert sorted(table["run_id"]) == sorted([first["mlflow"]["run_id"], ids["mlflow"]["run_id"]])
    branch = client.get_run(ids["mlflow"]["run_id"]).data.tags
    assert (branch["parent_run_id"], branch["branched_at_step"], branch["mlflow.parentRunId"]) == (
        first["mlflow"]["run_id"], "4", first["mlflow"]["run_id"])

    def history(run_id: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))

    assert history(first["mlflow"]["run_id"]) == [(s, pytest.approx(first_losses[s])) for s in range(1, 9)]
    assert history(ids["mlflow"]["run_id"]) == [(s, pytest.approx(branch_losses[s])) for s in range(5, 9)]
    runs = wandb_runs(out)
    assert sorted(runs[first["wandb"]["run_id"]]["history"]) == list(range(1, 9))
    assert sorted(runs[ids["wandb"]["run_id"]]["history"]) == list(range(5, 9))
    assert runs[ids["wandb"]["run_id"]]["config"]["parent_run_id"] == first["wandb"]["run_id"]


def test_an_unreachable_mlflow_server_costs_seconds_and_one_warning(offline, caplog, monkeypatch):
    """A closed local port held step 1 for 247 s of MLflow's retries: the start-up's requests are bounded
    (`MLFLOW_STARTUP_LIMITS`), then the usual warning; the user's own settings and the rest of the run
    keep MLflow's values."""
    import logging

    from pipeline.train.trackers import MLFLOW_STARTUP_LIMITS, RunIdentity, TrackerSet
    from tests.gloo_ranks import free_port

    for key in MLFLOW_STARTUP_LIMITS:
        monkeypatch.delenv(key, raising=False)
    identity = RunIdentity(offline / "run", mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}")
    (offline / "run").mkdir()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pipeline.train.trackers"):
        trackers = TrackerSet.open(["mlflow"], identity, 0)
    elapsed = time.monotonic() - started
    assert trackers.trackers == [] and elapsed < 60, elapsed
    warned = [r.getMessage() for r in caplog.records if r.name == "pipeline.train.trackers"]
    assert len(warned) == 1 and warned[0].startswith("tracker mlflow could not start ("), warned
    assert warned[0].endswith("; the run goes on without it"), warned
    assert not any(key in os.environ for key in MLFLOW_STARTUP_LIMITS)  # restored: mid-run logging keeps MLflow's
