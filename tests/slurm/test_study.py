"""`cpt-study` on the two-node test cluster: the tiny study (2 objectives x 2 seeds x 1 learning rate,
2 evaluation points, 1 task, zero-shot STS) submitted twice, once left alone and once with a pretraining job cancelled
mid-run and the study resubmitted; `collect` gives the same quality numbers, and the interrupted run's
GPU-seconds count each of its steps once."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eval.conftest import write_sts
from tests.slurm.cluster import DEADLINE_S, SlurmCluster
from tests.slurm.jobs import REPO_ROOT, metrics, pause_env, paused, wait_for

pytestmark = pytest.mark.slurm
STUDY = REPO_ROOT / "studies" / "tiny.yaml"
#: report fields that are measured times (or say when and where it ran), not quality numbers
TIMES = ("hours", "seconds", "created", "command", "hardware", "wall")


def _cli(cluster: SlurmCluster, command: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "pipeline.study.cli", command, str(STUDY), *extra],
                         env=dict(cluster.env, PYTHON=sys.executable, **env), cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def _queued(cluster: SlurmCluster, work: Path) -> set[str]:
    path = work / "jobs.jsonl"
    ours = {json.loads(line)["job"] for line in path.read_text().splitlines()} if path.is_file() else set()
    return ours & set(cluster.run(["squeue", "-h", "-o", "%F"]).stdout.split())


def _logs(work: Path) -> str:
    files = sorted(work.glob("**/logs/*.out"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in files)


def _quality(report: Path) -> dict:
    """Every number and string of the report's JSON files but the measured times, flattened."""
    flat: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and value.get("basis") == "matched compute":
            return  # the STS comparison at matched compute picks its points by measured device-hours
        if isinstance(value, dict):
            for k, v in value.items():
                if not any(t in str(k) for t in TIMES):
                    walk(f"{prefix}.{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        else:
            flat[prefix] = value

    for path in sorted(report.glob("*.json")):
        data = json.loads(path.read_text())
        walk(path.name, {k: v for k, v in data.items() if k not in ("notes", "gpu_seconds", "study")})
    return flat


def test_a_study_cancelled_mid_run_and_resubmitted_reports_what_an_uninterrupted_one_does(
        slurm_cluster: SlurmCluster, tiny_shards_dir: Path, tmp_path: Path) -> None:
    task = tmp_path / "sst2"
    task.mkdir()
    rows = [(f"sentence number {i} is {'good' if i % 2 else 'bad'}", i % 2) for i in range(40)]
    for split, part in (("train", rows), ("dev", rows[:10]), ("test", rows[10:20])):
        (task / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in part))
    data = {"CPT_STUDY_SHARDS": str(tiny_shards_dir), "CPT_STUDY_TASK": str(task),
            "CPT_STUDY_STS": str(write_sts(tmp_path / "sts-b", n_pairs=30))}
    ref, cut = tmp_path / "reference", tmp_path / "interrupted"
    victim = cut / "runs" / "mlm" / "lr_0.001" / "seed_1"
    pause_dir = tmp_path / "pause"
    # The victim's rank holds when it first imports pipeline.train.checkpoint.readme: at its step-4 checkpoint
    # (`save_checkpoint` imports the README renderer at the first save).
    hold = pause_env(pause_dir, f"ckpt@import:pipeline.train.checkpoint.readme@train.output_dir={victim}")
    (pause_dir / "arm-ckpt").touch()

    planned = _cli(slurm_cluster, "plan", {**data, "CPT_STUDY_WORK": str(cut)}).stdout
    assert "jobs: 12 (4 pretraining, 6 evaluation arrays with 10 tasks, 1 driver, 1 final)" in planned
    _cli(slurm_cluster, "submit", {**data, **hold, "CPT_STUDY_WORK": str(cut)})
    _cli(slurm_cluster, "submit", {**data, "CPT_STUDY_WORK": str(ref)})

    wait_for("the victim's rank at its step-4 checkpoint", lambda: bool(paused(pause_dir, "ckpt")), lambda: _logs(cut))
    (pause_dir / "arm-ckpt").unlink()
    steps_at_kill = len(metrics(victim))
    job = json.loads((cut / "jobs.jsonl").read_text().splitlines()[0])
    assert job["unit"] == "mlm/lr0.001/seed1" and job["kind"] == "pretrain"
    slurm_cluster.run(["scancel", job["job"]])  # SIGTERM to the job: the ranks checkpoint and stop
    # scancel returns before SLURM signals the job: released earlier, the rank could finish its 8 steps first
    rank_log = victim / "logs" / job["job"] / "rank0.log"
    wait_for("SIGTERM delivered to the held rank",
             lambda: rank_log.is_file() and "rank 0 received SIGTERM, passed on to pid" in rank_log.read_text(),
             lambda: _logs(cut))
    (pause_dir / "release-ckpt").touch()
    assert slurm_cluster.wait_job(job["job"]).state == "CANCELLED"
    assert 1 <= steps_at_kill < 8

    wait_for("the interrupted study's jobs to end", lambda: not _queued(slurm_cluster, cut), lambda: _logs(cut))
    status = _cli(slurm_cluster, "status", {**data, "CPT_STUDY_WORK": str(cut)}).stdout
    assert "sweep: pretraining 1/2 runs" in status and "seeds: after the sweep" in status, status
    resubmitted = _cli(slurm_cluster, "submit", {**data, "CPT_STUDY_WORK": str(cut)}).stdout
    # only the missing units: the victim's pretraining and evaluation, and the driver
    assert "jobs: 12 (" in resubmitted  # submit prints the plan's totals first
    kinds = [line.split("=")[0] for line in resubmitted.splitlines() if re.match(r"\w+=\d+ ", line)]
    assert kinds == ["pretrain", "eval", "driver"], resubmitted
    for work in (ref, cut):
        wait_for(f"{work.name}'s jobs to end", lambda: not _queued(slurm_cluster, work), lambda: _logs(work))

    # the plan's job count is what an uninterrupted submission sends
    assert len((ref / "jobs.jsonl").read_text().splitlines()) == 12
    reports = {}
    for work in (ref, cut):
        out = _cli(slurm_cluster, "collect", {**data, "CPT_STUDY_WORK": str(work)}).stdout
        assert "wrote" in out, _logs(work)
        reports[work.name] = _quality(work / "report" / "sst2")
    want, got = reports["reference"], reports["interrupted"]
    assert sorted(got) == sorted(want) and len(want) > 100
    for key, value in want.items():
        assert got[key] == (pytest.approx(value, rel=1e-5, abs=1e-7) if isinstance(value, float) else value), key

    # GPU-seconds of the interrupted run: each of its 8 steps counted once, from its own step times
    record = json.loads((victim / "train.json").read_text())
    steps = metrics(victim)
    assert [m["step"] for m in steps] == list(range(1, 9)) and record["counted_steps"] == 8
    assert record["world_size"] == 1
    assert record["gpu_seconds"]["8"] == pytest.approx(sum(m["step_time_s"] for m in steps))
    assert len(list((victim / "logs").glob("cpt-study-pretrain-*.out"))) == 2  # cancelled + resubmitted
    assert not (victim / "checkpoints").exists() and (victim / "hf" / "step_4" / "config.json").is_file()  # keep_checkpoints: false
    assert all((victim / "eval" / f"sts_step_{s}.json").is_file() for s in (4, 8))  # the cluster carries STS too
    assert any(k.startswith("time_to_quality_sts.json") for k in want)
    cost = json.loads((cut / "report" / "sst2" / "time_to_quality.json").read_text())["gpu_seconds"]
    assert sorted(r["run"] for r in cost) == ["mlm/lr0.001/seed1", "mlm/lr0.001/seed2", "taco/lr0.001/seed1",
                                              "taco/lr0.001/seed2"]
    assert all(r["counted_steps"] == 8 for r in cost)
