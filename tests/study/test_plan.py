"""`cpt-study plan` and the study file: job counts and GPU-hours (FLOPs at a stated MFU, or a measured
rate) computed by hand here, the BERT-base study's number as docs/slurm.md gives it, and every
study-file error naming the file and the field before anything is submitted."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.study.plan import plan
from pipeline.study.spec import StudyError, load_study

REPO = Path(__file__).resolve().parents[2]


def _bert_base_output() -> str:
    out = subprocess.run([sys.executable, "-m", "pipeline.study.cli", "plan", str(REPO / "studies" / "bert-base.yaml")],
                         env={"PATH": "/usr/bin:/bin"}, cwd=REPO,  # no CPT_STUDY_DATA: a plan needs no data
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_plan_of_the_bert_base_study_prints_its_jobs_and_gpu_hours_and_the_docs_quote_them() -> None:
    text = _bert_base_output()
    # 4 objectives x (3 learning rates + 2 more seeds) pretraining jobs, one evaluation array per run
    # (the sweep seed's selected run twice: sweep, then its curves), the driver and the final job
    assert "jobs: 46 (20 pretraining, 24 evaluation arrays with 476 tasks, 1 driver, 1 final)" in text
    # BERT-base, 100k steps x 1024 x 128 tokens, Megatron's formula at MFU 0.4 of an H100 (bf16 989.4 TFLOP/s)
    L, h, f, V, B, s = 12, 768, 3072, 30522, 1024, 128
    n = round(0.15 * B * s)
    step = 3 * (L * (2 * B * s * (4 * h * h + 2 * h * f) + 4 * B * s * s * h) + 2 * n * h * h + 2 * n * h * V)
    per_run = 100_000 * step / (989.4e12 * 0.4) / 3600
    assert f"{per_run:.4g} GPU-h per run" in text and f"{per_run * 1.33:.4g} GPU-h per run" in text  # cocolm x 1.33
    total = re.search(r"estimated GPU-hours: ([0-9.]+) \(pretraining ([0-9.]+)", text)
    assert float(total[2]) == pytest.approx(5 * per_run * (2 + 1.33 + 1.13), rel=1e-3)  # electra x 1.13
    assert f"estimated GPU-hours: {total[1]}" in (REPO / "docs" / "slurm.md").read_text()  # the docs' number is plan's


def _study(tmp_path: Path, **changes) -> Path:
    raw = {"name": "t", "work_dir": "work", "objectives": {"mlm": {"preset": "tiny-mlm"}}, "seeds": [1, 2],
           "lrs": [1e-3], "budget": {"steps": 10}, "eval_every": 5,
           "shards": {"train": "s", "heldout_select": "s", "heldout_report": "s"},
           "cost": {"tokens_per_s": {"mlm": 1000.0}, "seq_len": 128}}
    raw.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_measured_rate_replaces_the_flops_estimate(tmp_path: Path) -> None:
    p = plan(load_study(_study(tmp_path), check_data=False))
    row = p["rows"][0]
    # tiny-mlm: 8 sequences x 128 tokens per step (no shards yet: cost.seq_len), 10 steps, 1000 tokens/s
    assert row["estimate"] == "measured 1,000 tokens/s per GPU" and row["runs"] == 2
    assert row["gpu_hours_per_run"] == pytest.approx(10 * 8 * 128 / 1000 / 3600)
    assert p["jobs"] == {"pretrain": 2, "eval_arrays": 3, "eval_array_tasks": 5, "driver": 1, "final": 1}


@pytest.mark.parametrize("changes, message", [
    ({"objectives": {"taco": {"preset": "tiny-taco"}}}, "objectives: needs 'mlm'"),
    ({"objectives": {"mlm": {"preset": "nope"}}}, "objectives.mlm.preset: 'nope' is neither a preset"),
    ({"objectives": {"mlm": {"preset": "tiny-mlm", "overrides": ["optim.lr=1"]}}}, "the study sets these itself"),
    ({"objectives": {"mlm": {"preset": "tiny-mlm", "overrides": ["train.run_name=a b"]}}}, "without spaces"),
    ({"budget": {"steps": 10, "tokens": 5}}, "budget: give exactly one of"),
    ({"eval_every": 11}, "eval_every: 11 must be in [1, 10]"),
    ({"seeds": [1, 1]}, "seeds: give distinct"),
    ({"lrs": [0]}, "lrs: give positive"),
    ({"tasks": [{"name": "stsb", "dir": "x"}]}, "tasks[0].name: 'stsb': give a GLUE classification task"),
    ({"seeds": ["a", "b"]}, "seeds: expected a list of integers, got ['a', 'b']"),
    ({"lrs": ["fast"]}, "lrs: expected a list of numbers"),
    ({"finetune": [1]}, "finetune: expected {seeds: [..], lr: X, epochs: N}, got [1]"),
    ({"finetune": {"seeds": ["x"]}}, "finetune: seeds: expected a list of integers"),
    ({"budget": {"tokens": 100000}}, "budget.tokens: preset 'tiny-mlm' of mlm sets no data.seq_len"),
    ({"epochs": 3}, "unknown field(s) ['epochs']"),
])
def test_study_file_errors_name_the_file_and_field(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(StudyError) as err:
        load_study(_study(tmp_path, **changes), check_data=False)
    assert message in str(err.value) and str(tmp_path / "study.yaml") in str(err.value)


def test_submit_checks_the_data_before_anything_is_queued(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pipeline.study.cli", "submit", str(_study(tmp_path))], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "shards.train:" in out.stderr and "has no manifest.json" in out.stderr
    assert not (tmp_path / "work").exists()


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.study.cli", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def test_plan_needs_no_data_variables_and_prints_the_paths_as_written_submit_checks_them(tmp_path: Path) -> None:
    shards = {"train": "${CPT_NO_SUCH_VARIABLE}/train", "heldout_select": "s", "heldout_report": "s"}
    path = _study(tmp_path, shards=shards, work_dir="${CPT_NO_SUCH_WORK}")
    out = _cli("plan", str(path))
    assert out.returncode == 0, out.stderr
    assert "data (as written; checked at submit): train ${CPT_NO_SUCH_VARIABLE}/train" in out.stdout
    out = _cli("submit", str(path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "shards.train: '${CPT_NO_SUCH_VARIABLE}/train' names an environment variable that is not set" in out.stderr


def test_malformed_yaml_is_one_line_with_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nseeds: [1, 2\nlrs: [1e-3]\n")
    out = _cli("plan", str(path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"{path}: not valid YAML at line 3, column 4" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["submit", "status"])
def test_submit_and_status_without_slurm_on_path_say_so_in_one_line(tmp_path: Path, tiny_shards_dir: Path,
                                                                      command: str) -> None:
    shards = {k: str(tiny_shards_dir) for k in ("train", "heldout_select", "heldout_report")}
    path = _study(tmp_path, shards=shards)
    (tmp_path / "work").mkdir()  # status asks the queue about the jobs submitted before
    (tmp_path / "work" / "jobs.jsonl").write_text('{"job": "7", "kind": "pretrain", "unit": "mlm", "time": ""}\n')
    bare = tmp_path / "bin"  # python only: no sbatch, no squeue
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    out = _cli(command, str(path), env={"PATH": str(bare), "HOME": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert "SLURM's commands are not on PATH" in out.stderr
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["jobs.jsonl"]  # nothing made or queued
    if command == "submit":  # what the whole study costs comes first: the plan's two totals, nothing else
        lines = out.stdout.strip().splitlines()
        assert [line.split(":")[0] for line in lines] == ["jobs", "estimated GPU-hours"], out.stdout


def test_plan_says_where_its_seq_len_comes_from_and_what_it_assumed(tmp_path: Path) -> None:
    """Issue 57: without the data variables the plan estimated at seq_len 128 without a word (5x off for 64-token
    shards). Now the row and a line say where seq_len and vocab_size came from, and ASSUMED when nothing said."""
    from pipeline.study.plan import format_plan

    bare = {"tokens_per_s": {"mlm": 1000.0}}
    assumed = plan(load_study(_study(tmp_path, cost=bare), check_data=False))
    text = format_plan(assumed)
    assert assumed["rows"][0]["seq_len_from"] == "assumed" and "seq 128 (ASSUMED)" in text
    assert "ASSUMED seq_len 128 for mlm: no shards' manifest at shards.train yet" in text
    assert "ASSUMED vocab_size 30522 for mlm" in text
    overridden = _study(tmp_path, cost=bare, objectives={"mlm": {"preset": "tiny-mlm", "overrides": ["data.seq_len=64"]}})
    p = plan(load_study(overridden, check_data=False))
    assert p["rows"][0]["seq_len"] == 64 and p["rows"][0]["seq_len_from"] == "objectives.mlm data.seq_len"
    assert p["rows"][0]["gpu_hours_per_run"] == pytest.approx(assumed["rows"][0]["gpu_hours_per_run"] / 2)
    stated = format_plan(plan(load_study(_study(tmp_path, cost={**bare, "seq_len": 64, "vocab_size": 4096}),
                                         check_data=False)))
    assert "seq_len: 64 from cost.seq_len" in stated and "vocab_size: 4096 from cost.vocab_size" in stated
    assert "ASSUMED" not in stated


@pytest.mark.parametrize("overrides, reason", [
    (["model.arch=modernbert"], "--with-generator: the ELECTRA generator of a model.arch=modernbert run has no "
                                "Hugging Face class"),
    (["objectives.mlm=0.5"], "objectives ['mlm'] train the MLM head cls.predictions beside electra"),
])
def test_an_electra_row_the_evaluation_could_not_convert_is_refused_before_any_job(tmp_path: Path, overrides: list,
                                                                                 reason: str) -> None:
    """The study converts every run it evaluates, an ELECTRA run with its generator (its masked LM). A ModernBERT
    ELECTRA has no Hugging Face generator and an MLM head trained beside electra has no place in the export:
    `cpt-convert` refuses both, so they used to fail in the evaluation jobs after the pretraining was paid for.
    Refused at load time now, naming the row and the conversion's reason; the same rows without the cause load."""
    rows = {"mlm": {"preset": "tiny-mlm"}, "electra": {"preset": "tiny-electra", "overrides": overrides}}
    with pytest.raises(StudyError) as err:
        load_study(_study(tmp_path, objectives=rows), check_data=False)
    assert str(err.value).startswith(f"{tmp_path / 'study.yaml'}: objectives.electra: its runs could not be converted "
                                     f"for the evaluation: {reason}")
    fine = ["objectives.mlm=0"] if "mlm" in reason else []  # a weight of 0 trains no head
    rows["electra"]["overrides"] = fine
    assert "electra" in load_study(_study(tmp_path, objectives=rows), check_data=False).objectives
