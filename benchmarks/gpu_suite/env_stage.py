"""Stage `env`: what the machine has, whether the code can run there, and whether every fused kernel
is right at BERT-large shapes.

1. Requirements (`check_requirements`, also run first by every other stage): each library the code
   imports (`REQUIRED`), at the minimum version `setup.cfg`'s install_requires gives it (read from
   there: one home), on a GPU run a CUDA device, and `torch.mm(bf16, bf16, out_dtype=float32)`
   (torch >= 2.8): COCO-LM's sampling GEMM calls it on CUDA with no fallback
   (`pipeline.objectives.cocolm.sampling_logits`). It is probed on the GPU; on the dry run, with no
   GPU, on the meta device (the overload exists in this torch; its CUDA kernel is not checked).
   Anything missing ends the stage at once, with the versions found, after its files are written
   (exit 1).
2. `pytest -m gpu` (every GPU-only test of the project; on the dry run the kernel tests' gpu
   markers, which skip without CUDA).
3. Correctness: every case of `benchmarks.kernels.bench_kernels.OPS` (each fused loss and layout)
   at BERT-large shapes (V = 30,522, H = 1,024; 64k tokens, TACO a quarter of them because its
   reference gathers [N, K, H] fp32), kernel on bf16 inputs against the fp32 reference on the same
   values: relative error ||kernel - ref|| / ||ref|| of the loss (tolerance 1e-3) and of every
   gradient (2e-2: the fused cross-entropy rounds dL/dlogits to bf16 before the backward GEMMs and
   returns bf16 gradients); MLM accuracy (with-accuracy case) within 1e-3 of the reference's.
"""
from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from benchmarks.gpu_suite.plan import REPO
from benchmarks.gpu_suite.stage_io import StageContext, versions
from benchmarks.gpu_suite.targets import target

#: The libraries the code needs on the GPU machine (distribution names; minimums: setup.cfg's install_requires).
REQUIRED = ("torch", "triton", "deepspeed", "transformers", "tokenizers", "numpy", "pyarrow", "xxhash", "pyyaml",
            "safetensors")
MM_OUT_DTYPE = "torch.mm(bf16, bf16, out_dtype=float32)"
LOSS_TOL = 1e-3
GRAD_TOL = 2e-2
ACCURACY_TOL = 1e-3


class EnvironmentError_(RuntimeError):
    """The image lacks something the code needs (the message lists it, with the versions found)."""


def minimums(setup_cfg: Path = REPO / "setup.cfg") -> dict[str, str]:
    """Distribution name -> version specifier ("" = any) of setup.cfg's install_requires."""
    from packaging.requirements import Requirement

    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = [ln.strip() for ln in parser["options"]["install_requires"].splitlines() if ln.strip()]
    return {Requirement(ln).name.lower(): str(Requirement(ln).specifier) for ln in lines}


def mm_out_dtype_probe() -> tuple[bool, str]:
    """(does `torch.mm(bf16, bf16, out_dtype=float32)` run, where it was probed): on the GPU when
    there is one, else on the meta device (the overload exists; no kernel runs)."""
    import torch

    from pipeline.kernels.linear_cross_entropy import _mm_fp32_out_supported

    device = torch.device("cuda" if torch.cuda.is_available() else "meta")
    return _mm_fp32_out_supported(device), device.type


def check_requirements(need_cuda: bool, found: Optional[dict[str, Optional[str]]] = None,
                       mm_out_dtype: Optional[tuple[bool, str]] = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(one row per requirement, the problems); problems empty when everything is there. `found`
    (library versions) and `mm_out_dtype` (the probe's answer) default to this machine's."""
    from packaging.specifiers import SpecifierSet

    found = versions() if found is None else found
    specs = minimums()
    rows, problems = [], []
    for lib in REQUIRED:
        have, spec = found.get(lib), specs[lib]
        ok = have is not None and SpecifierSet(spec).contains(have, prereleases=True)
        rows.append({"requirement": lib, "minimum": spec or "any", "found": have or "not importable", "ok": ok})
        if not ok:
            problems.append(f"{lib} {have or 'not importable'} (need {spec or 'any version'})")
    import torch

    cuda = torch.cuda.is_available()
    rows.append({"requirement": "CUDA device", "minimum": "needed" if need_cuda else "dry run: not needed",
                 "found": torch.cuda.get_device_name(0) if cuda else "none", "ok": cuda or not need_cuda})
    if need_cuda and not cuda:
        problems.append("no CUDA device visible to torch")
    supported, where = mm_out_dtype_probe() if mm_out_dtype is None else mm_out_dtype
    rows.append({"requirement": MM_OUT_DTYPE, "minimum": "needed (COCO-LM's sampling GEMM, torch >= 2.8)",
                 "found": f"{'runs' if supported else 'missing'} (probed on {where})", "ok": supported})
    if not supported:
        problems.append(f"{MM_OUT_DTYPE} missing on {where} in torch {found.get('torch')}")
    return rows, problems


def require_environment(ctx: StageContext) -> None:
    """Every stage's first step: stop with the list of what is missing (exit 1) before any compute."""
    _, problems = check_requirements(need_cuda=not ctx.dry_run)
    if problems:
        raise EnvironmentError_("the image lacks what the code needs: " + "; ".join(problems)
                                + f" (versions found: {versions()})")


def run_gpu_tests(ctx: StageContext) -> dict[str, Any]:
    """`pytest -m gpu` over the test files that hold a gpu marker (collecting every test module would
    import the dev extras the image may lack), in a subprocess bounded by the remaining budget."""
    paths = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text(errors="replace"))
    if ctx.dry_run:  # the rehearsal: the kernel tests only (every file would cost minutes of imports on one core)
        paths = [p for p in paths if p.startswith("tests/kernels/")]
    timeout = max(30.0, ctx.time_left() * 0.5)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *paths]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[2:]), "exit": None, "summary": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|skipped|failed|deselected|error)", ln)),
                   lines[-1] if lines else proc.stderr[-300:])
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10]
    return {"command": "pytest " + " ".join(cmd[3:]), "exit": proc.returncode, "summary": summary.strip("= "),
            "failures": "; ".join(failed)}


def _rel_err(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def correctness_rows(ctx: StageContext) -> list[dict[str, Any]]:
    """One row per kernel case: relative errors of the loss and every gradient, bf16 kernel vs fp32 reference."""
    import torch

    from benchmarks.kernels.bench_kernels import OPS, SHAPES, build_case, implementation

    device = ctx.device
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16 dot
    rows = []
    for case in OPS:
        if not ctx.has_time(20):
            ctx.skip(f"correctness {case}", "stage budget spent")
            continue
        shape = dict(SHAPES["small" if ctx.dry_run else "full"])
        if case == "token_contrastive_loss" and not ctx.dry_run:
            shape["batch"] //= 4
        row: dict[str, Any] = {"case": case, "dtype": str(low).replace("torch.", ""),
                               "tokens": shape["batch"] * shape["seq_len"]}
        try:
            args, grad_pos, _ = build_case(case, shape, device, low, seed=1)
            ref_args = [a.float() if i in grad_pos or (hasattr(a, "is_floating_point") and a.is_floating_point())
                        else a for i, a in enumerate(args)]
            ref_out, ref_grads = _loss_and_grads(implementation(case, "torch"), ref_args, grad_pos)
            out, grads = _loss_and_grads(implementation(case, "triton"), args, grad_pos)
            row["loss_rel_err"] = _rel_err(out[0], ref_out[0])
            row["grad_rel_err_max"] = max(_rel_err(g, r) for g, r in zip(grads, ref_grads))
            ok = row["loss_rel_err"] < LOSS_TOL and row["grad_rel_err_max"] < GRAD_TOL and bool(torch.isfinite(out[0]))
            if len(out) > 1:
                row["accuracy_abs_err"] = abs(float(out[1]) - float(ref_out[1]))
                ok = ok and row["accuracy_abs_err"] <= ACCURACY_TOL
            row["ok"] = ok
        except Exception as err:  # noqa: BLE001 - one case failing (an OOM, a compile error) is its row
            row.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(f"correctness {case}: {row}", flush=True)
    return rows


def _loss_and_grads(fn, args, grad_pos):
    leaves = [a.detach().clone().requires_grad_() if i in grad_pos else a for i, a in enumerate(args)]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward()
    return [o.detach() for o in outs], [leaves[i].grad for i in grad_pos]


def run(ctx: StageContext) -> int:
    requirement_rows, problems = check_requirements(need_cuda=not ctx.dry_run)
    tables: dict[str, list] = {"requirements": requirement_rows}
    targets: list[dict[str, Any]] = []
    if problems:
        ctx.notes.append("stopped before any compute: " + "; ".join(problems))
        ctx.write(tables, targets)
        print("error: the image lacks: " + "; ".join(problems), file=sys.stderr)
        return 1
    tests = run_gpu_tests(ctx)
    tables["pytest -m gpu"] = [tests]
    applicable = True  # correctness is judged on the rehearsal too (tiny shapes, the interpreter)
    targets.append(target("pytest -m gpu passes", None if tests["exit"] is None else float(tests["exit"] == 0),
                          ">=", 1.0, applicable, tests["summary"]))
    rows = correctness_rows(ctx)
    tables["kernel correctness (kernel vs fp32 reference)"] = rows
    for row in rows:
        targets.append(target(f"correct {row['case']}", float(row["ok"]), ">=", 1.0, applicable,
                              row.get("error", f"loss {row.get('loss_rel_err', 0):.1e}, grad {row.get('grad_rel_err_max', 0):.1e}")))
    ctx.notes.append(f"tolerances: loss relative error < {LOSS_TOL:g}, every gradient < {GRAD_TOL:g}, "
                     f"accuracy within {ACCURACY_TOL:g}; kernel on bf16 inputs, reference on their fp32 values")
    if ctx.dry_run:
        ctx.notes.append("dry run: tiny shapes, fp32, kernels in the Triton interpreter; nothing judged")
    ctx.write(tables, targets)
    return 0 if all(t["met"] is not False for t in targets) else 1

