"""The GPU suite's CPU rehearsal (`--dry-run`), its plan check and the filing of results.

The rehearsal runs every stage of every plan (the core plan and the ModernBERT plan) at tiny shapes on
the CPU in its own process, as the device commands do, and must write the same files; the plan check
must fail a stage over its budget. The README's performance table must be exactly what the committed
results give (today: "not measured yet").
"""
from __future__ import annotations

import json
import os
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
    regenerate_readme,
    render_table,
    tracked_payloads,
)

from pipeline.config.run import load_config
from pipeline.data.config import plan_batches

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("dry")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the suite must switch the interpreter on itself
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    return out, proc


def payload(out: Path, stage: str) -> dict:
    return json.loads((out / stage / f"{stage}.json").read_text())


def test_dry_run_runs_every_stage_and_the_plan_fits(rehearsal):
    out, proc = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: every stage ran and the plan fits" in proc.stdout
    assert {s.name for s in plan.ALL_STAGES} >= {"throughput-128", "throughput-modernbert-512"}
    for stage in plan.ALL_STAGES:
        data = payload(out, stage.name)
        assert data["dry_run"] is True and data["device"]["name"] == "cpu"
        files = sorted(p.name for p in (out / stage.name).iterdir())
        assert files == sorted(data["files"]) and len(files) <= plan.MAX_STAGE_FILES
        assert data["wall_s"] <= stage.dry_budget_s
        assert data["source"]["commit"] and data["versions"]["torch"]
        assert "--dry-run" in data["command"]
        md = (out / stage.name / f"{stage.name}.md").read_text()
        assert md.startswith(f"# GPU suite: {stage.name}") and "Commit:" in md
        # performance targets are never judged on the CPU
        assert all(t["met"] is None for t in data["targets"] if not t["name"].startswith(("correct", "pytest",
                   "training exits", "resumed", "converted")))


def test_dry_run_env_checks_every_kernel_case(rehearsal):
    from benchmarks.kernels.bench_kernels import OPS

    data = payload(rehearsal[0], "env")
    rows = data["tables"]["kernel correctness (kernel vs fp32 reference)"]
    assert [r["case"] for r in rows] == list(OPS)
    assert all(r["ok"] and r["grad_rel_err_max"] < 1e-5 for r in rows), rows
    requirements = {r["requirement"]: r for r in data["tables"]["requirements"]}
    assert set(requirements) >= {"torch", "triton", "deepspeed", "transformers", "pyarrow", "xxhash", "pyyaml",
                                 "safetensors", "torch.mm(bf16, bf16, out_dtype=float32)"}
    assert all(r["ok"] for r in requirements.values()), requirements
    assert data["tables"]["pytest -m gpu"][0]["exit"] == 0  # on the CPU every gpu test is collected and skipped


def test_requirements_hold_on_this_machines_real_versions():
    """The real check, on this machine: every library the code needs is found at setup.cfg's minimum,
    and torch has the `mm(..., out_dtype=float32)` overload COCO-LM's sampling GEMM calls."""
    from benchmarks.gpu_suite.env_stage import MM_OUT_DTYPE, REQUIRED, check_requirements, minimums
    from benchmarks.gpu_suite.stage_io import versions

    rows, problems = check_requirements(need_cuda=False)
    assert problems == []
    found, specs = versions(), minimums()
    libraries = {r["requirement"]: r for r in rows if r["requirement"] in REQUIRED}
    assert list(libraries) == list(REQUIRED)
    for lib, row in libraries.items():
        assert row["found"] == found[lib] and row["minimum"] == (specs[lib] or "any") and row["ok"]
    assert specs["pyarrow"] == ">=15" and specs["xxhash"] == ">=3.0" and specs["torch"] == ">=2.4"
    (mm,) = [r for r in rows if r["requirement"] == MM_OUT_DTYPE]
    assert mm["ok"] and mm["found"] == "runs (probed on meta)"  # no GPU here: the overload, on the meta device


def test_requirements_fail_fast_naming_each_missing_thing_with_its_version(monkeypatch):
    from types import SimpleNamespace

    from benchmarks.gpu_suite import env_stage
    from benchmarks.gpu_suite.stage_io import versions

    old = {**versions(), "pyarrow": "14.0.2", "xxhash": None, "torch": "2.7.1+cu126", "safetensors": "0.4.5"}
    _, problems = env_stage.check_requirements(False, found=old, mm_out_dtype=(False, "cuda"))
    assert problems == ["pyarrow 14.0.2 (need >=15)", "xxhash not importable (need >=3.0)",
                        "torch.mm(bf16, bf16, out_dtype=float32) missing on cuda in torch 2.7.1+cu126"]
    monkeypatch.setattr(env_stage, "versions", lambda: old)
    monkeypatch.setattr(env_stage, "mm_out_dtype_probe", lambda: (False, "cuda"))
    with pytest.raises(env_stage.EnvironmentError_, match=r"pyarrow 14.0.2 \(need >=15\).*'torch': '2.7.1\+cu126'"):
        env_stage.require_environment(SimpleNamespace(dry_run=True))


def test_dry_run_kernels_has_every_case_and_implementation(rehearsal):
    from benchmarks.kernels.bench_kernels import OPS

    data = payload(rehearsal[0], "kernels")
    rows = data["tables"]["fused losses: forward + backward"]
    measured = {(r["size"], r["case"], r["impl"]) for r in rows if r.get("ms")}
    for size in ("16k", "64k"):
        for case in OPS:
            for impl in ("triton", "eager_fp32", "eager_bf16", "compile"):
                assert (size, case, impl) in measured, (size, case, impl)
    skipped = {s["what"]: s["reason"] for s in data["skipped"]}
    assert skipped["16k/linear_cross_entropy/liger"] == skipped["64k/linear_cross_entropy/cce"] == "dry run: peers need CUDA"
    assert "16k/token_contrastive_loss/liger" not in skipped  # no peer computes it: no row, not a skip
    assert {t["name"] for t in data["targets"]} >= {"64k fused linear CE time / Liger's",
                                                    "16k token InfoNCE speed-up over eager"}


@pytest.mark.parametrize("stage", ["throughput-128", "throughput-512"])
def test_dry_run_throughput_has_every_row_in_one_process(rehearsal, stage):
    data = payload(rehearsal[0], stage)
    (rows,) = data["tables"].values()
    assert [r["row"] for r in rows] == ["mlm", "hf-bert", "taco", "capt", "cocolm", "infoword"]
    assert {(r["arch"], r["size"]) for r in rows} == {("bert", "tiny")}
    assert all("tokens_vs_bert" not in r for r in rows)  # no other family in the core stages
    for r in rows:
        assert "error" not in r, r
        assert r["measured_steps"] == data["settings"]["steps"] and r["tokens_per_s"] > 0
    mlm = rows[0]
    assert mlm["tokens_vs_mlm"] == pytest.approx(1.0)
    hf = rows[1]
    assert hf["optim"] == mlm["optim"]  # the baseline uses the MLM preset's AdamW settings
    assert {r["grad_accum"] for r in rows} == {data["settings"]["accum"]}  # hf-bert included
    for r in rows:
        if r["row"] != "hf-bert":  # each row trained with its preset's engine file
            assert r["engine"] == load_config(r["preset"]).deepspeed.config
            assert r["preset_grad_accum"] == plan_batches(load_config(r["preset"]).data, 1).grad_accum
    assert rows[2]["tokens_vs_hf_bert"] == pytest.approx(rows[2]["tokens_per_s"] / hf["tokens_per_s"])
    assert any("MFU = FLOPs" in n for n in data["notes"])
    assert (rehearsal[0] / stage / f"{stage}_profile.md").read_text().count("\n|") >= 3


@pytest.mark.parametrize("length", [128, 512])
@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("paired", [False, True])
def test_throughput_rows_keep_their_presets_engine_and_share_one_accumulation(tmp_path, length, dry_run, paired):
    """The GPU rows measure each preset's own DeepSpeed settings (ZeRO-1 for the large presets, not
    a suite-wide override); batch, precision and accumulation are the stage's, the same in every row.
    The ModernBERT stages change only the family and the size to one of the same shape."""
    from benchmarks.gpu_suite.throughput_stage import OBJECTIVES, overrides, settings
    from benchmarks.throughput.bench_throughput import bert_partner_size

    s = settings(length, dry_run, paired)
    assert set(s["sizes"]) == ({"bert", "modernbert"} if paired else {"bert"})
    if paired:
        assert bert_partner_size("modernbert", s["sizes"]["modernbert"]) == s["sizes"]["bert"]
        assert s["sizes"] == ({"bert": "capt-small", "modernbert": "small"} if dry_run
                              else {"bert": "large", "modernbert": "large-24"})
    for preset in OBJECTIVES.values():
        configs = {arch: load_config(preset, overrides(s, tmp_path / "shards", tmp_path / "run", arch))
                   for arch in s["sizes"]}
        for arch, cfg in configs.items():
            assert (cfg.model.arch, cfg.model.size) == (arch, s["sizes"][arch])
            assert cfg.deepspeed.config == load_config(preset).deepspeed.config == "zero1", preset
            assert cfg.deepspeed.precision == s["precision"] and cfg.data.micro_batch_size == s["micro_batch"]
            assert plan_batches(cfg.data, 1).grad_accum == s["accum"]
        if paired:  # the pair differs in the model only
            bert, modern = configs["bert"], configs["modernbert"]
            assert (bert.optim, bert.data, bert.objectives, bert.objective_options, bert.deepspeed) == \
                (modern.optim, modern.data, modern.objectives, modern.objective_options, modern.deepspeed)


@pytest.mark.parametrize("length", [128, 512])
def test_dry_run_modernbert_stage_pairs_every_objective_with_its_bert_row(rehearsal, length):
    """The ModernBERT plan's stage: each objective's BERT row, then its ModernBERT row of the same shape,
    with the same recipe, engine, batch and accumulation; the ratio is taken to that partner only."""
    from benchmarks.gpu_suite.throughput_stage import OBJECTIVES

    stage = f"throughput-modernbert-{length}"
    data = payload(rehearsal[0], stage)
    (rows,) = data["tables"].values()
    assert [(r["arch"], r["row"]) for r in rows] == [(a, o) for o in OBJECTIVES for a in ("bert", "modernbert")]
    assert data["settings"]["sizes"] == {"bert": "capt-small", "modernbert": "small"}  # same 6 x 256 x 4 shape
    for bert, modern in zip(rows[::2], rows[1::2]):
        assert "error" not in bert and "error" not in modern, (bert, modern)
        assert (bert["size"], modern["size"]) == ("capt-small", "small")
        for key in ("preset", "engine", "grad_accum", "seq_len", "precision", "micro_batch", "optim"):
            assert bert[key] == modern[key], key
        assert modern["measured_steps"] == data["settings"]["steps"] and modern["tokens_per_s"] > 0
        assert modern["tokens_vs_bert"] == pytest.approx(modern["tokens_per_s"] / bert["tokens_per_s"])
        assert bert["tokens_vs_bert"] is None and modern["mfu_vs_bert"] is None  # no MFU on the CPU
        assert "tokens_vs_hf_bert" not in modern
    mlm = {r["arch"]: r for r in rows if r["row"] == "mlm"}
    capt = rows[5]
    assert capt["tokens_vs_mlm"] == pytest.approx(capt["tokens_per_s"] / mlm["modernbert"]["tokens_per_s"])
    assert data["targets"] == [] and any("for ModernBERT" in n for n in data["notes"])
    files = set(data["files"])
    assert {f"{stage}_tokens.png", f"{stage}_vs_bert.png"} <= files and f"{stage}_profile.md" not in files


def test_dry_run_sanity_resumes_exactly_and_converts(rehearsal):
    data = payload(rehearsal[0], "sanity")
    (facts,) = data["tables"]["training sanity"]
    assert facts["exit_a"] == facts["exit_b"] == 0 and facts["nonfinite_losses"] == 0
    assert facts["resume_rel_diff"] == 0.0  # bitwise on the CPU
    assert facts["logits_rel_err"] < 1e-5 and facts["logits_std"] > 1e-3
    verdicts = {t["name"]: t["met"] for t in data["targets"]}
    assert verdicts["resumed step-N loss: relative difference"] is True
    assert verdicts["converted logits: relative error"] is True


def test_collect_refuses_a_dry_run(rehearsal, tmp_path):
    with pytest.raises(CollectError, match="dry run"):
        collect([rehearsal[0] / "env"], root=tmp_path)
    assert not (tmp_path / "benchmarks").exists()


def test_collect_names_a_missing_field(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"stage": "env", "dry_run": False}))
    with pytest.raises(CollectError, match=r"env.json: missing field\(s\) \['created'"):
        collect([tmp_path], root=tmp_path)


@pytest.mark.parametrize("name", ["core", "modernbert"])
def test_the_real_plans_fit_every_limit(name):
    stages = plan.PLANS[name]
    assert plan.check_plan(stages) == []
    assert all(len(s.command()) <= plan.COMMAND_LIMIT for s in stages)
    assert sum(plan.INSTALL_S + s.budget_s for s in stages) <= plan.PLAN_LIMIT_S
    assert all(plan.INSTALL_S + s.budget_s <= plan.STAGE_LIMIT_S for s in stages)
    text = plan.describe(stages, name)
    assert all(s.command() in text for s in stages) and f"GPU plan {name!r}" in text


def test_the_plans_together_would_not_fit_one_lease():
    """Why the ModernBERT rows are a plan of their own: beside the core stages they break the limit."""
    assert plan.check_plan(plan.ALL_STAGES)[-1].startswith("plan:")
    assert [s.name for s in plan.ALL_STAGES] == [s.name for p in plan.PLANS.values() for s in p]
    assert plan.stage_named("throughput-modernbert-128") in plan.MODERNBERT_STAGES


def test_check_plan_fails_a_stage_over_its_budget():
    over = plan.check_plan(measured_s={"kernels": plan.stage_named("kernels").dry_budget_s + 1}, dry_run=True)
    assert len(over) == 1 and over[0].startswith("kernels: took") and "dry-run budget" in over[0]
    assert plan.check_plan(measured_s={"kernels": plan.stage_named("kernels").dry_budget_s - 1}, dry_run=True) == []
    gpu_over = plan.check_plan(measured_s={"env": plan.stage_named("env").budget_s + 5})
    assert gpu_over and gpu_over[0].startswith("env: took")


def test_check_plan_fails_each_limit():
    big = plan.Stage("big", "too long", plan.STAGE_LIMIT_S, 1, "x:y")
    problems = plan.check_plan([big, big, big, big])
    assert any(p.startswith("big: budget") for p in problems)
    assert any(p.startswith("plan:") for p in problems)
    wordy = plan.Stage("x" * plan.COMMAND_LIMIT, "long name", 1, 1, "x:y")
    assert any("characters" in p for p in plan.check_plan([wordy]))
    assert plan.check_plan(carry_bytes=plan.CARRY_LIMIT_BYTES + 1)[0].startswith("carry:")
    assert plan.check_plan(files_written={"env": plan.MAX_STAGE_FILES + 1})[0].startswith("env: wrote")
    with pytest.raises(KeyError, match="no such stage"):
        plan.check_plan(measured_s={"nope": 1})


def _gpu_payload(mfu: float) -> dict:
    return {"stage": "throughput-512", "dry_run": False, "created": "2026-11-25T00:00:00+00:00", "seq_len": 512,
            "command": "cmd", "source": {"commit": "abc1234def"}, "versions": {"torch": "2.11", "triton": "3.6"},
            "device": {"name": "NVIDIA H100 80GB HBM3", "cuda_available": True},
            "tables": {"BERT-large L=512": [{"row": "mlm", "tokens_per_s": 1000.0, "mfu": mfu}]},
            "targets": [{"name": "L=512 MLM MFU", "measured": mfu, "target": ">= 0.5", "met": mfu >= 0.5}]}


def test_table_shows_only_gpu_results():
    dry = {**_gpu_payload(0.6), "dry_run": True}
    assert render_table([("benchmarks/results/gpu/x/throughput-512.json", dry)]) == NOT_MEASURED + "\n"
    table = render_table([("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-25/throughput-512.json",
                           _gpu_payload(0.42))])
    assert "NVIDIA H100 80GB HBM3" in table and "42.0%" in table and "MISSED" in table and "abc1234def" in table
    assert "MFU = FLOPs / (step time" in table


def _modernbert_payload(created: str, ratio: float) -> dict:
    rows = [{"row": "mlm", "arch": "bert", "size": "large", "tokens_per_s": 1000.0, "mfu": 0.4,
             "tokens_vs_bert": None, "mfu_vs_bert": None},
            {"row": "mlm", "arch": "modernbert", "size": "large-24", "tokens_per_s": 1000.0 * ratio, "mfu": 0.39,
             "tokens_vs_bert": ratio, "mfu_vs_bert": 0.975},
            {"row": "capt", "arch": "modernbert", "size": "large-24", "error": "OutOfMemoryError: CUDA out of memory"}]
    return {**_gpu_payload(0.4), "stage": "throughput-modernbert-512", "created": created, "targets": [],
            "tables": {"BERT-large vs ModernBERT large-24 L=512": rows}}


def test_table_shows_each_stages_newest_result_and_the_modernbert_ratios():
    """The two plans run on different leases: the core plan's result stays in the table beside a later
    ModernBERT result of the same device, and an older ModernBERT result is replaced by the newer one."""
    core = ("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-25/throughput-512.json", _gpu_payload(0.42))
    old = ("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-26/throughput-modernbert-512.json",
           _modernbert_payload("2026-11-26T00:00:00+00:00", 1.111))
    new = ("benchmarks/results/gpu/nvidia-h100-80gb-hbm3-2026-11-27/throughput-modernbert-512.json",
           _modernbert_payload("2026-11-27T00:00:00+00:00", 1.234))
    table = render_table([core, new, old])
    assert "nvidia-h100-80gb-hbm3-2026-11-25" in table and "nvidia-h100-80gb-hbm3-2026-11-27" in table
    assert "-2026-11-26" not in table and "1.111" not in table
    lines = table.splitlines()
    header = next(ln for ln in lines if ln.startswith("| L |"))
    assert "| model |" in header and "| vs BERT | MFU vs BERT |" in header
    modern = next(ln for ln in lines if "ModernBERT large-24 | mlm" in ln)
    assert "| 1.234 | 0.975 |" in modern and "1,234" in modern
    bert = next(ln for ln in lines if "BERT large | mlm" in ln and "ModernBERT" not in ln)
    assert bert.count("|  |") >= 2  # a BERT row has no ratio to itself
    assert "OutOfMemoryError" in next(ln for ln in lines if "ModernBERT large-24 | capt" in ln)
    assert "for ModernBERT" in table and "MISSED" in table  # both formulas; the core stage's target


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
    """No GPU number in the README unless a committed results file holds it."""
    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    assert regenerate_readme(copy, tracked_payloads(ROOT)) is False
