"""The GPU suite: its plans against the 15-minute lease (arithmetic, never a CI clock), its CPU
rehearsal (every command of every plan at tiny shapes, one process each, as on a lease), a command
killed by SIGKILL part-way, a throughput row's timed steps, and the filing of results. The README's
performance table must be exactly what the committed results give (today: "not measured yet").
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_suite import plan
from benchmarks.gpu_suite.collect import (
    NOT_MEASURED,
    TABLE_END,
    TABLE_START,
    CollectError,
    collect,
    read_stage_files,
    regenerate_readme,
    render_run_page,
    render_table,
    tracked_payloads,
)
from pipeline.train.run_config import load_config
from pipeline.data.config import plan_batches

ROOT = Path(__file__).resolve().parents[2]


def suite_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the suite must switch the interpreter on itself
    return env


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("dry")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=suite_env(), capture_output=True, text=True, timeout=900)
    return out, proc


def payload(out: Path, stage: str) -> dict:
    return json.loads((out / stage / f"{stage}.json").read_text())


def rows_by_name(data: dict) -> dict:
    return {r["row"]: r for r in data["rows"]}


# ---- the plans against the lease: arithmetic only ------------------------------------------------------------

@pytest.mark.parametrize("name", ["core", "modernbert"])
def test_each_plan_fits_the_15_minute_lease_with_start_and_idle_gaps(name):
    stages = plan.PLANS[name]
    assert plan.check_plan(stages) == []
    total = plan.START_S + sum(s.limit_s + plan.IDLE_S for s in stages)
    assert plan.device_seconds(stages) == total <= 15 * 60 == plan.LEASE_S
    for stage in stages:
        assert plan.INSTALL_S + sum(r.gpu_s for r in stage.rows) <= stage.limit_s <= 10 * 60
        assert len(stage.command()) <= plan.COMMAND_CHARS
    text = plan.describe(stages, name)
    assert all(s.command() in text for s in stages) and f"= {total / 60:.1f} min of the lease's 15" in text


def test_command_1_yields_the_headline_rows_in_value_order():
    """Command 1 alone: environment, MLM and hf-bert at L=128 then L=512, every objective at L=128, then the
    fused linear-CE and token-InfoNCE rows against eager (linear CE also against Liger, CCE and itself at
    smaller chunks); the rows whose target the first lease missed also profile a window."""
    first = plan.PLANS["core"][0]
    assert [r.name for r in first.rows] == [
        "env", "mlm L=128", "hf-bert L=128", "mlm L=512", "hf-bert L=512", "taco L=128", "capt L=128",
        "cocolm L=128", "infoword L=128", "electra L=128", "kernel linear_cross_entropy 16k", "kernel token_contrastive_loss 16k"]
    assert set(first.rows[-2].arg("impls")) == {"triton", "triton_chunk128", "triton_chunk64", "eager_bf16",
                                                "eager_fp32", "liger", "cce"}
    profiled = {r.name for stage in plan.ALL_STAGES for r in stage.rows if r.arg("profile")}
    assert profiled == {"mlm L=128", "mlm L=512", "hf-bert L=512", "infoword L=128", "infoword L=512",
                        "kernel linear_cross_entropy 16k", "kernel token_contrastive_loss 16k",
                        "modernbert mlm L=512", "modernbert mlm L=512 packed"}
    # every row of command 1 starts before its deadline when the estimates hold
    assert plan.INSTALL_S + sum(r.gpu_s for r in first.rows) <= first.limit_s


def test_estimates_cover_the_first_leases_measured_wall_times():
    """Every row the first lease measured is planned at >= its measured wall time x 1.25 (plus the profiled
    window where the row now profiles), read from the committed results (not from plan.py's own table)."""
    folder = ROOT / "benchmarks" / "results" / "gpu" / "nvidia-h200-2026-11-28"
    measured: dict[str, float] = {}
    for stage in ("headline", "more", "modernbert"):
        for r in json.loads((folder / f"{stage}.json").read_text())["rows"]:
            measured[r["row"]] = max(measured.get(r["row"], 0.0), r["wall_s"])
    assert {k: v for k, v in plan.MEASURED_S.items()} == measured
    checked = 0
    for stage in plan.ALL_STAGES:
        for row in stage.rows:
            if row.name in measured and row.kind != "checkpointing":  # that row spends its estimate as its budget
                extra = plan.PROFILE_S if row.arg("profile") else 0.0
                assert row.gpu_s - extra >= 1.25 * measured[row.name], (row.name, row.gpu_s, measured[row.name])
                checked += 1
    assert checked >= 30


def test_electra_is_measured_in_every_command_and_every_plan_still_fits():
    """ELECTRA (planned at NEW_OBJECTIVE_S a row until a lease measures it): at L=128 in command 1, at L=512 in
    command 2, paired with ModernBERT; every command still holds its rows' estimates within its limit, and every
    plan its lease."""
    head, second = plan.PLANS["core"]
    assert "electra L=128" in [r.name for r in head.rows] and "electra L=512" in [r.name for r in second.rows]
    (paired,) = plan.PLANS["modernbert"]
    assert {"electra L=128", "modernbert electra L=128"} <= {r.name for r in paired.rows}
    assert plan.check_plan([head, second]) == [] and plan.check_plan([paired]) == []


def test_check_plan_fails_each_limit():
    head, more = plan.PLANS["core"]
    over = plan.check_plan([head, more, plan.Stage("extra", "one more command", 60, ())])
    total = plan.START_S + head.limit_s + more.limit_s + 60 + 3 * plan.IDLE_S
    assert over == [f"plan: {total / 60:.1f} device minutes (start 90 s + commands + 30 s idle after each) > the "
                    "lease's 15"]
    row = plan.Row("env", "env", 60)
    crowded = plan.Stage("crowded", "rows past its limit", 100, (row, row))
    assert plan.check_plan([crowded]) == ["crowded: install 20 s + row estimates 120 s = 140 s > its limit 100 s"]
    long = plan.Stage("long", "over the device's limit", 601, ())
    assert plan.check_plan([long])[0] == "long: limit 601 s > the device's 600 s a command"
    wordy = plan.Stage("x" * plan.COMMAND_CHARS, "long name", 60, ())
    assert any("characters" in p for p in plan.check_plan([wordy]))
    assert plan.check_plan([head], carry_bytes=plan.CARRY_LIMIT_BYTES + 1)[0].startswith("carry:")
    assert plan.check_plan([head], files_written={"headline": plan.MAX_STAGE_FILES + 1})[0].startswith("headline: wrote")
    with pytest.raises(KeyError, match="no such stage"):
        plan.stage_named("nope")


def test_plan_prints_the_commands_and_what_to_prepare_without_failing(tmp_path):
    """`--plan` before `--prepare`: the plan and readiness, exit 0 (readiness is not an error)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--plan"], cwd=ROOT, env=suite_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--stage headline --out $OUT" in proc.stdout and "--stage more --out $OUT" in proc.stdout
    assert "plan check: fits the lease and every limit" in proc.stdout
    total = plan.device_seconds(plan.PLANS["core"])
    assert f"= {total:.0f} s = {total / 60:.1f} min" in proc.stdout and "--local --out DIR" in proc.stdout
    # someone with a GPU of their own is told how to run the same commands without a lease
    assert "On a GPU machine of your own (no lease)" in proc.stdout
    assert "python -m benchmarks.gpu_suite --stage NAME --out DIR --deadline-s inf" in proc.stdout
    if not any((ROOT / plan.WHEELS_DIR).glob("deepspeed-*.whl")):
        assert "not prepared yet: .whl/ has no DeepSpeed wheel" in proc.stdout


# ---- the rehearsal -----------------------------------------------------------------------------------------

def test_dry_run_runs_every_command_and_writes_what_comes_back(rehearsal):
    out, proc = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: every stage ran and the plans fit" in proc.stdout
    for stage in plan.ALL_STAGES:
        data = payload(out, stage.name)
        assert data["dry_run"] is True and data["device"]["name"] == "cpu" and data["complete"] is True
        assert [r["row"] for r in data["rows"]] == [r.name for r in stage.rows] and data["skipped"] == []
        assert all("error" not in r for r in data["rows"]), [r for r in data["rows"] if "error" in r]
        files = sorted(p.name for p in (out / stage.name).iterdir())
        assert files == sorted(data["files"]) and len(files) <= plan.MAX_STAGE_FILES
        assert data["source"]["commit"] and data["versions"]["torch"] and "--dry-run" in data["command"]
        assert "optim.impl=torch" in data["optimizer"]
        md = (out / stage.name / f"{stage.name}.md").read_text()
        assert md.startswith(f"# GPU suite: {stage.name}") and "Commit:" in md
        # performance is never judged on the CPU; correctness is
        for t in data["targets"]:
            assert (t["met"] is True) if t["name"].startswith(("correct", "pytest")) else t["met"] is None, t
        assert proc.stdout.count(f"row 1/{len(stage.rows)} ") >= 1


def test_dry_run_headline_rows(rehearsal):
    from benchmarks.gpu_suite.train_rows import PRESETS
    from benchmarks.kernels.bench_kernels import OPS

    data = payload(rehearsal[0], "headline")
    rows = rows_by_name(data)
    env = rows["env"]
    assert [c["case"] for c in env["correctness"]] == list(OPS)
    assert all(c["ok"] and c["grad_rel_err_max"] < 1e-5 for c in env["correctness"]), env["correctness"]
    requirements = {r["requirement"]: r for r in data["requirements"]}
    assert set(requirements) >= {"torch", "triton", "deepspeed", "torch.mm(bf16, bf16, out_dtype=float32)"}
    for length in (128, 512):
        mlm, hf = rows[f"mlm L={length}"], rows[f"hf-bert L={length}"]
        assert hf["optim"] == mlm["optim"] and hf["grad_accum"] == mlm["grad_accum"]  # the MLM preset's AdamW
        assert mlm["tokens_vs_hf_bert"] == pytest.approx(mlm["tokens_per_s"] / hf["tokens_per_s"])
        assert mlm["measured_steps"] == 2 and mlm["spread"] >= 0 and mlm["tokens_per_s"] > 0
    for objective in plan.OBJECTIVES:  # the headline's (ELECTRA is measured in the modernbert plan)
        assert objective in PRESETS
        r = rows[f"{objective} L=128"]
        assert r["engine"] == load_config(r["preset"]).deepspeed.config == "zero1"
        assert r["preset_grad_accum"] == plan_batches(load_config(r["preset"]).data, 1).grad_accum
        assert r["tokens_vs_mlm"] == pytest.approx(r["tokens_per_s"] / rows["mlm L=128"]["tokens_per_s"])
    lce = rows["kernel linear_cross_entropy 16k"]
    assert {x["impl"] for x in lce["results"]} == {"triton", "triton_chunk128", "triton_chunk64", "eager_bf16",
                                                   "eager_fp32"}
    # the rows that missed a target on the first lease carry a breakdown of a profiled window (CPU operators here)
    for name in ("mlm L=128", "mlm L=512", "hf-bert L=512", "infoword L=128"):
        b = rows[name]["breakdown"]
        assert b["steps"] == 1 and len(b["largest"]) == 3 and b["wall_ms_per_step"] > 0, (name, b)
        assert rows[name]["measured_steps"] == 2  # the profiled window is not among the timed steps
    assert "breakdown" not in rows["taco L=128"] and "breakdown" not in rows["hf-bert L=128"]
    assert set(lce["breakdown"]) == {"linear_cross_entropy"} and "largest" in lce["breakdown"]["linear_cross_entropy"]
    md = (rehearsal[0] / "headline" / "headline.md").read_text()
    assert "## Where the time goes" in md and "| infoword L=128 | cpu operators (self time) |" in md
    assert lce["not_measured"] == {"linear_cross_entropy/liger": "dry run: peers need CUDA",
                                   "linear_cross_entropy/cce": "dry run: peers need CUDA"}
    assert {t["name"] for t in data["targets"]} >= {"L=512 MLM tokens/s vs hf-bert", "L=128 cocolm MFU / MLM's",
                                                    "16k fused linear CE time / Liger's", "16k token InfoNCE speed-up over eager"}


def test_dry_run_more_rows(rehearsal):
    data = payload(rehearsal[0], "more")
    rows = rows_by_name(data)
    capt, queue = rows["capt L=512"], rows["queue InfoNCE share of a CAPT step"]
    assert queue["capt_ms_per_micro_batch"] == pytest.approx(capt["step_time_s"] * 1e3 / capt["grad_accum"])
    assert queue["share"] == pytest.approx(queue["queue_ms"] / queue["capt_ms_per_micro_batch"])
    assert rows["pytest -m gpu"]["exit"] == 0  # on the CPU every gpu test is collected and skipped
    mlm = rows["mlm L=512"]
    for objective in ("taco", "capt", "cocolm", "infoword"):  # judged against the MLM row of the same process
        assert rows[f"{objective} L=512"]["mfu_vs_mlm"] is None  # no MFU on the CPU
        assert rows[f"{objective} L=512"]["tokens_vs_mlm"] == pytest.approx(
            rows[f"{objective} L=512"]["tokens_per_s"] / mlm["tokens_per_s"])
    ckpt = rows[plan.CHECKPOINTING_ROW.name]["results"]  # benchmarks/memory/activation_checkpointing.py
    assert [(r["family"], r["checkpointing"]) for r in ckpt] == [(f, s) for f in ("bert", "modernbert") for s in ("none", "all")]
    for r in ckpt:  # no out-of-memory on the CPU: every search reaches the dry run's cap
        assert r["largest_micro_batch"] == 4 and r["search_stopped_by"] == "cap" and r["tokens_per_s"] > 0
        base = next(b for b in ckpt if b["family"] == r["family"] and b["checkpointing"] == "none")
        assert r["tokens_vs_none"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
    assert {t["name"] for t in data["targets"]} >= {"L=512 cocolm MFU / MLM's", "64k fused linear CE time / Liger's",
                                                    "L=512 queue InfoNCE share of a CAPT step", "pytest -m gpu passes"}


def test_dry_run_modernbert_pairs_every_objective_with_its_bert_row(rehearsal):
    data = payload(rehearsal[0], "modernbert")
    rows = data["rows"]
    assert [(r["arch"], r["objective"], r["length"], r["shards"]) for r in rows] == [
        (a, o, length, "full") for o, length in [("mlm", 128), ("mlm", 512), ("taco", 128), ("capt", 128),
                                                 ("cocolm", 128), ("infoword", 128), ("electra", 128)] for a in ("bert", "modernbert")
    ] + [(a, "mlm", length, "packed") for length in (128, 512) for a in ("bert", "modernbert")]
    for bert, modern in zip(rows[::2], rows[1::2]):
        assert (bert["size"], modern["size"]) == ("capt-small", "small")  # the same 6 x 256 x 4 shape
        for key in ("preset", "engine", "grad_accum", "seq_len", "precision", "micro_batch", "optim", "shards"):
            assert bert[key] == modern[key], key
        assert modern["tokens_vs_bert"] == pytest.approx(modern["tokens_per_s"] / bert["tokens_per_s"])
        assert bert["tokens_vs_bert"] is None and "tokens_vs_hf_bert" not in modern
    for r in rows[-4:]:  # packed shards: padded rows, so fewer real tokens than slots; MLM vs the packed MLM row
        assert 0.4 < r["real_token_fraction"] < 0.8 and r["tokens_vs_mlm"] == 1.0
    assert "breakdown" in rows[3] and "breakdown" in rows[-1] and "breakdown" not in rows[2]
    # issue 56's goals are judged on the packed ModernBERT rows (not on the CPU)
    assert [t["name"] for t in data["targets"]] == [
        f"L={length} ModernBERT mlm {what}" for length in (128, 512)
        for what in ("MFU on packed shards", "useful tokens/s vs BERT-large on packed shards")]
    assert all(t["met"] is None for t in data["targets"]) and any("for ModernBERT" in n for n in data["notes"])


def test_a_command_killed_by_sigkill_leaves_every_finished_row_and_collect_files_them(tmp_path):
    """SIGKILL right after the second row's summary line: the JSON left holds every finished row, in plan
    order, and is filed by `--collect` (a rehearsal is refused unless the test allows it)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_suite", "--stage", "headline", "--dry-run",
                             "--out", str(out)], cwd=ROOT, env=suite_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    seen = []
    try:
        for line in proc.stdout:
            if line.startswith("row "):
                seen.append(line)
            if len(seen) == 2:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert len(seen) == 2 and proc.returncode == -signal.SIGKILL, seen
    data = json.loads((out / "headline.json").read_text())
    names = [r.name for r in plan.stage_named("headline").rows]
    finished = [r["row"] for r in data["rows"]]
    assert len(finished) >= 2 and finished == names[:len(finished)] and data["complete"] is False
    assert all("error" not in r and r["wall_s"] >= 0 for r in data["rows"])
    assert (out / "headline.md").read_text().count("INCOMPLETE") == 1
    with pytest.raises(CollectError, match="dry run"):
        collect([out], root=tmp_path)
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    (dest,) = collect([out], root=tmp_path / "repo", allow_dry_run=True)
    filed = json.loads((tmp_path / "repo" / dest / "headline.json").read_text())
    assert filed["rows"] == data["rows"]
    assert json.loads((tmp_path / "repo" / dest / "collected.json").read_text())["headline"]["rows"] == len(finished)


def test_no_row_starts_past_the_deadline(tmp_path):
    """A deadline already spent: every row is skipped with the reason, and the file is still complete."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--stage", "more", "--dry-run",
                           "--deadline-s", "0", "--out", str(tmp_path)], cwd=ROOT, env=suite_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "more.json").read_text())
    assert data["rows"] == [] and data["complete"] is True and data["deadline_s"] == 0
    assert [s["row"] for s in data["skipped"]] == [r.name for r in plan.stage_named("more").rows]
    assert all(s["reason"].startswith("deadline: 0 s left") for s in data["skipped"])


def test_local_runs_every_command_of_a_plan_from_a_plain_clone_and_says_why_it_cannot_here(tmp_path):
    """`--local` needs no ../shared, wheels or carried folders: each command runs in its own process
    and writes `DIR/<stage>.json`; without a GPU each stops before any compute, saying so (exit 1)."""
    scratch = tmp_path / "scratch"  # the runner's work dirs (tempfile), which no return may leave behind
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--local", "modernbert", "--out",
                           str(tmp_path)], cwd=ROOT, env={**suite_env(), "TMPDIR": str(scratch)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "local run: FAILED" in proc.stdout, proc.stdout[-2000:]
    assert not list(scratch.glob("gpu_suite_*")), list(scratch.iterdir())
    for stage in plan.PLANS["modernbert"]:
        data = json.loads((tmp_path / f"{stage.name}.json").read_text())
        assert data["rows"] == [] and data["dry_run"] is False and "--deadline-s inf" in data["command"]
        assert any("no CUDA device visible to torch" in n for n in data["notes"]), data["notes"]


def test_a_throughput_row_writes_no_checkpoint_and_times_only_unlogged_steps(tmp_path, monkeypatch):
    """COCO-LM (its no-grad corrective-LM projection runs only on logged steps): every micro-batch of
    the row runs with record_metrics=False, nothing is saved, and the row reports its timed steps."""
    import pipeline.train.checkpoint.tags as checkpoint
    import pipeline.train.checkpoint.checkpointer as checkpointer_module
    from benchmarks.gpu_suite import train_rows
    from benchmarks.gpu_suite.runner import StageContext
    from pipeline.pretrain.pretrainer import PretrainModel

    seen, saves = [], []
    forward = PretrainModel.forward

    def recording_forward(self, batch, progress=None, *args, **kwargs):
        seen.append(progress.record_metrics)
        return forward(self, batch, progress, *args, **kwargs)

    def recording_save(*args, **kwargs):
        saves.append(args)
        return save(*args, **kwargs)

    save = checkpoint.save_checkpoint
    monkeypatch.setattr(PretrainModel, "forward", recording_forward)
    monkeypatch.setattr(checkpointer_module, "save_checkpoint", recording_save)
    monkeypatch.setattr(checkpoint, "save_checkpoint", recording_save)
    ctx = StageContext(plan.stage_named("headline"), tmp_path / "out", True, None, tmp_path / "work")
    row = train_rows.train_row(ctx, plan.train_row("cocolm", 128))
    s = train_rows.settings(128, True)
    assert seen == [False] * ((s["warmup"] + s["steps"]) * s["accum"]) and saves == []
    assert row["measured_steps"] == s["steps"] and row["tokens_per_s"] > 0
    assert not list((tmp_path / "work").rglob("*checkpoint*")) and not (tmp_path / "work" / "cocolm").exists()


def test_a_failing_gpu_test_leaves_its_assertion_and_traceback_in_the_row(tmp_path):
    """The first lease's pytest row kept only `FAILED path::test`: the cause was lost. Now every failure's
    short traceback (bounded) and its -rfE line (with the exception message) are in the JSON."""
    from benchmarks.gpu_suite.kernel_rows import TRACEBACK_CHARS, run_pytest

    (tmp_path / "test_probe.py").write_text(
        "import pytest\n\n"
        "def helper(widths):\n    return widths.numpy()\n\n"
        "def test_reads_a_device_tensor():\n    class Cuda:\n        def numpy(self):\n"
        "            raise TypeError(\"can't convert cuda:0 device type tensor to numpy\")\n"
        "    helper(Cuda())\n\n"
        "def test_long():\n    assert 'x' * 5000 == 'y'\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('fixture broke')\n\n"
        "def test_error(broken):\n    pass\n\n"
        "def test_fine():\n    pass\n")
    row = run_pytest(["test_probe.py"], "not slow", 120, cwd=tmp_path)
    assert row["exit"] == 1 and "2 failed, 1 passed, 1 error" in row["summary"], row
    assert "FAILED test_probe.py::test_reads_a_device_tensor - TypeError: can't convert cuda:0" in row["failures"]
    tracebacks = {t["test"]: t["traceback"] for t in row["tracebacks"]}
    assert set(tracebacks) == {"test_reads_a_device_tensor", "test_long", "ERROR at setup of test_error"}
    device = tracebacks["test_reads_a_device_tensor"]
    assert "return widths.numpy()" in device and "TypeError: can't convert cuda:0" in device
    assert "RuntimeError: fixture broke" in tracebacks["ERROR at setup of test_error"]
    assert all(len(t) <= TRACEBACK_CHARS for t in tracebacks.values())


def test_packed_shards_are_the_packers_doc_rows_and_count_their_padding(tmp_path):
    """The packed rows' shards: documents packed by `data_prep.packing.Packer` in doc mode, written by the shard
    writer; every row [CLS] ... [SEP] then padding, its length the real tokens, the manifest's padding exact;
    an identical build is reused, another one replaces it."""
    import numpy as np

    from benchmarks.data.synthetic_shards import SPECIAL_TOKENS, write_packed_shards
    from pipeline.data.reader import ShardDataset

    manifest = write_packed_shards(tmp_path / "p", vocab_size=500, seq_len=32, rows=300, rows_per_shard=128)
    assert manifest.packing == "doc" and manifest.total_sequences == 300 and len(manifest.shards) == 3
    dataset = ShardDataset(tmp_path / "p")
    ids = np.stack([np.asarray(dataset[i]["input_ids"]) for i in range(len(dataset))])
    real = (ids != SPECIAL_TOKENS["pad"]).sum(1)
    assert (dataset.lengths() == real).all()
    assert (ids[:, 0] == SPECIAL_TOKENS["cls"]).all() and manifest.stats["padding_tokens"] == int((32 - real).sum())
    assert 0.4 < 1 - manifest.stats["padding_tokens"] / manifest.total_tokens < 0.8  # rows do pad
    assert (ids[np.arange(300), real - 1] == SPECIAL_TOKENS["sep"]).all()
    again = write_packed_shards(tmp_path / "p", vocab_size=500, seq_len=32, rows=300, rows_per_shard=128)
    assert again == manifest
    other = write_packed_shards(tmp_path / "p", vocab_size=500, seq_len=32, rows=100, median=1.0)
    assert other.total_sequences == 100 and other.build_args["median"] == 1.0
    with pytest.raises(ValueError, match="median"):
        write_packed_shards(tmp_path / "q", vocab_size=500, seq_len=32, rows=10, median=0)


# ---- requirements ----------------------------------------------------------------------------------------------

def test_requirements_hold_on_this_machines_real_versions():
    from benchmarks.gpu_suite.kernel_rows import MM_OUT_DTYPE, REQUIRED, check_requirements, minimums, versions

    rows, problems = check_requirements(need_cuda=False)
    assert problems == []
    found, specs = versions(), minimums()
    libraries = {r["requirement"]: r for r in rows if r["requirement"] in REQUIRED}
    assert list(libraries) == list(REQUIRED)
    for lib, row in libraries.items():
        assert row["found"] == found[lib] and row["minimum"] == (specs[lib] or "any") and row["ok"]
    (mm,) = [r for r in rows if r["requirement"] == MM_OUT_DTYPE]
    assert mm["ok"] and mm["found"] == "runs (probed on meta)"  # no GPU here: the overload, on the meta device


def test_requirements_fail_fast_naming_each_missing_thing_with_its_version(monkeypatch):
    from benchmarks.gpu_suite import kernel_rows

    old = {**kernel_rows.versions(), "pyarrow": "14.0.2", "xxhash": None, "torch": "2.7.1+cu126"}
    _, problems = kernel_rows.check_requirements(False, found=old, mm_out_dtype=(False, "cuda"))
    assert problems == ["pyarrow 14.0.2 (need >=15)", "xxhash not importable (need >=3.0)",
                        "torch.mm(bf16, bf16, out_dtype=float32) missing on cuda in torch 2.7.1+cu126"]
    monkeypatch.setattr(kernel_rows, "versions", lambda: old)
    monkeypatch.setattr(kernel_rows, "mm_out_dtype_probe", lambda: (False, "cuda"))
    with pytest.raises(kernel_rows.EnvironmentError_, match=r"pyarrow 14.0.2 \(need >=15\).*'torch': '2.7.1\+cu126'"):
        kernel_rows.require_environment(True)


# ---- filing results and README's table -------------------------------------------------------------------------

def test_collect_names_a_missing_field(tmp_path):
    (tmp_path / "headline.json").write_text(json.dumps({"stage": "headline", "dry_run": False}))
    with pytest.raises(CollectError, match=r"headline.json: missing field\(s\) \['created'"):
        collect([tmp_path], root=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CollectError, match="no stage result"):
        read_stage_files(tmp_path / "empty")


def _gpu_payload(mfu: float) -> dict:
    return {"stage": "headline", "dry_run": False, "created": "2026-11-25T00:00:00+00:00", "complete": True,
            "command": "cmd", "source": {"commit": "abc1234def"}, "versions": {"torch": "2.11", "triton": "3.6"},
            "device": {"name": "NVIDIA H100 80GB HBM3", "cuda_available": True},
            "rows": [{"row": "mlm L=512", "kind": "train", "arch": "bert", "size": "large", "objective": "mlm",
                      "length": 512, "tokens_per_s": 1000.0, "mfu": mfu, "spread": 0.02, "wall_s": 30.0}],
            "targets": [{"name": "L=512 MLM MFU", "measured": mfu, "target": ">= 0.5", "met": mfu >= 0.5}]}


def test_table_shows_only_gpu_results():
    dry = {**_gpu_payload(0.6), "dry_run": True}
    assert render_table([("benchmarks/results/gpu/x/headline.json", dry)]) == NOT_MEASURED + "\n"
    path = "benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-25/headline.json"
    table = render_table([(path, _gpu_payload(0.42))])
    assert "NVIDIA H100 80GB HBM3" in table and "abc1234def" in table and "0 targets met, 1 missed" in table
    assert "| BERT-large MLM tokens/s (MFU) | - | 1,000 (**42.0%**) |" in table  # bold: its target missed
    assert "(benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-25/README.md)" in table
    assert len(table.splitlines()) <= 14  # compact: the full tables live on the results page
    page = render_run_page(str(Path(path).parent), [(path, _gpu_payload(0.42))])
    assert "MFU = FLOPs / (step time" in page and "| 512 | BERT large | mlm | full |" in page
    assert "| headline | L=512 MLM MFU | 0.420 | >= 0.5 | MISSED | [json](headline.json) |" in page


def _modernbert_payload(created: str, ratio: float) -> dict:
    base = {"kind": "train", "objective": "mlm", "length": 512, "wall_s": 30.0, "shards": "full"}
    rows = [{**base, "row": "mlm L=512", "arch": "bert", "size": "large", "tokens_per_s": 1000.0, "mfu": 0.4,
             "tokens_vs_bert": None, "mfu_vs_bert": None},
            {**base, "row": "modernbert mlm L=512", "arch": "modernbert", "size": "large-24",
             "tokens_per_s": 1000.0 * ratio, "mfu": 0.39, "tokens_vs_bert": ratio, "mfu_vs_bert": 0.975},
            {**base, "row": "modernbert mlm L=512 packed", "arch": "modernbert", "size": "large-24", "shards": "packed",
             "tokens_per_s": 1500.0, "mfu": 0.35, "tokens_vs_bert": 1.25, "mfu_vs_bert": 1.1},
            {**base, "row": "modernbert capt L=128", "objective": "capt", "length": 128, "arch": "modernbert",
             "size": "large-24", "error": "OutOfMemoryError: CUDA out of memory"}]
    targets = [{"name": "L=512 ModernBERT mlm useful tokens/s vs BERT-large on packed shards", "measured": 1.25,
                "target": ">= 1.3", "met": False}]
    return {**_gpu_payload(0.4), "stage": "modernbert", "created": created, "targets": targets, "rows": rows}


def test_table_shows_each_stages_newest_result_and_the_modernbert_ratios():
    """The plans run on different leases: the core result stays in the table beside a later ModernBERT
    result of the same device, and an older ModernBERT result is replaced by the newer one."""
    core = ("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-25/headline.json", _gpu_payload(0.42))
    old = ("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-26/modernbert.json",
           _modernbert_payload("2026-11-26T00:00:00+00:00", 1.111))
    new = ("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-27/modernbert.json",
           _modernbert_payload("2026-11-27T00:00:00+00:00", 1.234))
    table = render_table([core, new, old])
    assert "nvidia-h100-80gb-hbm3-2026-11-25/README.md" in table and "nvidia-h100-80gb-hbm3-2026-11-27/README.md" in table
    assert "-2026-11-26" not in table and "1.11" not in table
    modern = next(ln for ln in table.splitlines() if ln.startswith("| ModernBERT large-24 / BERT-large"))
    assert "| - / - | 1.23 / **1.25** |" in modern  # full rows, then packed shards (its target missed)
    assert "0 targets met, 2 missed" in table
    page = render_run_page("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-27", [new])
    header = next(ln for ln in page.splitlines() if ln.startswith("| L |"))
    assert "| model |" in header and "| shards |" in header and "| vs BERT | MFU vs BERT |" in header
    row = next(ln for ln in page.splitlines() if "ModernBERT large-24 | mlm | full" in ln)
    assert "| 1.234 | 0.975 |" in row and "1,234" in row
    assert "OutOfMemoryError" in next(ln for ln in page.splitlines() if "ModernBERT large-24 | capt" in ln)
    assert "for ModernBERT" in page


def test_a_results_page_keeps_its_analysis_and_regenerates_its_tables(tmp_path):
    """`--collect` / `--table` write each results folder's page: created with a title when absent; later
    only the block between its markers changes, the hand-written analysis around it stays."""
    from benchmarks.gpu_suite.collect import PAGE_END, PAGE_START, regenerate_run_pages

    folder = "benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-25"
    (tmp_path / folder).mkdir(parents=True)
    payloads = [(f"{folder}/headline.json", _gpu_payload(0.42))]
    (page,) = regenerate_run_pages(tmp_path, payloads)
    text = page.read_text()
    assert text.startswith("# GPU results: nvidia-h100-80gb-hbm3-2026-11-25") and "42.0%" in text
    page.write_text(text.replace(PAGE_START, "## Analysis\n\nwritten by hand\n\n" + PAGE_START) + "\nafter\n")
    assert regenerate_run_pages(tmp_path, payloads) == []  # nothing new: unchanged
    assert regenerate_run_pages(tmp_path, [(f"{folder}/headline.json", _gpu_payload(0.55))]) == [page]
    text = page.read_text()
    assert "written by hand" in text and text.endswith("after\n") and "55.0%" in text and "42.0%" not in text
    assert text.count(PAGE_START) == text.count(PAGE_END) == 1


def test_readme_table_is_regenerated_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{TABLE_START}\nstale 99% MFU\n{TABLE_END}\nafter\n")
    assert regenerate_readme(readme, []) is True
    text = readme.read_text()
    assert "stale" not in text and NOT_MEASURED in text and text.startswith("before\n") and text.endswith("after\n")
    assert regenerate_readme(readme, []) is False
    (tmp_path / "other.md").write_text("no markers\n")
    with pytest.raises(CollectError, match="markers"):
        regenerate_readme(tmp_path / "other.md", [])


def test_readme_table_matches_the_committed_results(tmp_path):
    """No GPU number in the README or on a results page unless a committed results file holds it."""
    from benchmarks.gpu_suite.collect import RUN_PAGE, regenerate_run_pages

    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    payloads = tracked_payloads(ROOT)
    assert regenerate_readme(copy, payloads) is False
    folders = {str(Path(p).parent) for p, _ in payloads}
    for folder in folders:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / RUN_PAGE).write_text((ROOT / folder / RUN_PAGE).read_text())
    assert folders and regenerate_run_pages(tmp_path, payloads) == []
