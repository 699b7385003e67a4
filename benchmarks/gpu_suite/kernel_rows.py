"""The environment probe, the fused-loss rows and `pytest -m gpu`.

Requirements (`check_requirements`, run by every command before its first row): each library the
code imports (`REQUIRED`) at the minimum `setup.cfg`'s install_requires gives it (read from there:
one home), a CUDA device on a GPU run, and `torch.mm(bf16, bf16, out_dtype=float32)` (torch >= 2.8;
COCO-LM's sampling GEMM calls it on CUDA with no fallback), probed on the GPU or, on the dry run,
on the meta device. Anything missing stops the command before any compute (exit 1), its file saying
what and with which versions.

`env` row: the requirements table and a short correctness check of every fused loss
(`bench_kernels.OPS`) at one size (16k tokens; V = 30,522, H = 1,024): the kernel on bf16 inputs
against the fp32 reference on the same values, relative error ||kernel - ref|| / ||ref|| of the
loss (< `LOSS_TOL`) and of every gradient (< `GRAD_TOL`: the fused cross-entropy rounds dL/dlogits
to bf16 before the backward GEMMs), MLM accuracy within `ACCURACY_TOL`. It also compiles the
kernels the later rows use.

`kernel` rows: `bench_kernels.measure_impls` (the one kernel benchmark): forward + backward median time
(CUDA events) and peak memory
above the inputs of one or more cases at 16k or 64k tokens in sequences of 512 (every token a row of
the vocabulary projection, the peers' convention), for `triton` (ours), `eager_bf16` (the reference
on the bf16 inputs), `eager_fp32`, `liger` (`liger_fused_linear_cross_entropy`) and `cce`
(`cut_cross_entropy.linear_cross_entropy`, no bias). A peer not installed is named, not measured.
"""
from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from benchmarks.gpu_suite.plan import REPO

#: The libraries the code needs on the GPU machine (distribution names; minimums: setup.cfg's install_requires).
REQUIRED = ("torch", "triton", "deepspeed", "transformers", "tokenizers", "numpy", "pyarrow", "xxhash", "pyyaml",
            "safetensors")
LIBRARIES = REQUIRED + ("liger_kernel", "cut_cross_entropy")
#: Distribution name -> module name where they differ.
IMPORT_NAMES = {"pyyaml": "yaml"}
MM_OUT_DTYPE = "torch.mm(bf16, bf16, out_dtype=float32)"
LOSS_TOL = 1e-3
GRAD_TOL = 2e-2
ACCURACY_TOL = 1e-3
TOKENS = {"16k": 32, "64k": 128}  # -> sequences of 512


class EnvironmentError_(RuntimeError):
    """The image lacks something the code needs (the message lists it, with the versions found)."""


def versions() -> dict[str, Optional[str]]:
    """Python and library versions (None: not importable). `__version__`, else the distribution's metadata."""
    import platform
    from importlib import metadata

    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for lib in LIBRARIES:
        try:
            module = __import__(IMPORT_NAMES.get(lib, lib))
            out[lib] = getattr(module, "__version__", None) or metadata.version(lib)
        except Exception:  # noqa: BLE001 - absent or broken: recorded as None, the requirements say why
            out[lib] = None
    return out


def minimums(setup_cfg: Path = REPO / "setup.cfg") -> dict[str, str]:
    """Distribution name -> version specifier ("" = any) of setup.cfg's install_requires."""
    from packaging.requirements import Requirement

    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = [ln.strip() for ln in parser["options"]["install_requires"].splitlines() if ln.strip()]
    return {Requirement(ln).name.lower(): str(Requirement(ln).specifier) for ln in lines}


def mm_out_dtype_probe() -> tuple[bool, str]:
    """(does `torch.mm(bf16, bf16, out_dtype=float32)` run, where it was probed)."""
    import torch

    from pipeline.kernels.linear_cross_entropy import _mm_fp32_out_supported

    device = torch.device("cuda" if torch.cuda.is_available() else "meta")
    return _mm_fp32_out_supported(device), device.type


def check_requirements(need_cuda: bool, found: Optional[dict[str, Optional[str]]] = None,
                       mm_out_dtype: Optional[tuple[bool, str]] = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(one row per requirement, the problems); `found` and `mm_out_dtype` default to this machine's."""
    import torch
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


def require_environment(dry_run: bool) -> list[dict[str, Any]]:
    """The requirement rows; raises `EnvironmentError_` naming everything missing."""
    rows, problems = check_requirements(need_cuda=not dry_run)
    if problems:
        raise EnvironmentError_("the image lacks what the code needs: " + "; ".join(problems)
                                + f" (versions found: {versions()})")
    return rows


def shape_for(size: str, dry_run: bool) -> dict[str, Any]:
    from benchmarks.kernels.bench_kernels import SHAPES

    if dry_run:  # two tiny sizes standing for 16k and 64k
        return {**SHAPES["small"], "batch": 2 if size == "16k" else 4}
    return {**SHAPES["full"], "batch": TOKENS[size], "mask_rate": 1.0, "pairs": TOKENS[size]}


def _rel_err(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _loss_and_grads(fn, args, grad_pos):
    leaves = [a.detach().clone().requires_grad_() if i in grad_pos else a for i, a in enumerate(args)]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward()
    return [o.detach() for o in outs], [leaves[i].grad for i in grad_pos]


def correctness(case: str, device, dry_run: bool) -> dict[str, Any]:
    """One fused loss at 16k tokens: loss and gradient relative errors, bf16 kernel vs fp32 reference."""
    import torch

    from benchmarks.kernels.bench_kernels import build_case, implementation

    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16 dot
    shape = shape_for("16k", dry_run)
    out: dict[str, Any] = {"case": case, "dtype": str(low).replace("torch.", ""), "tokens": shape["batch"] * shape["seq_len"]}
    try:
        args, grad_pos, _ = build_case(case, shape, device, low, seed=1)
        ref_args = [a.float() if i in grad_pos or (hasattr(a, "is_floating_point") and a.is_floating_point()) else a
                    for i, a in enumerate(args)]
        ref, ref_grads = _loss_and_grads(implementation(case, "torch"), ref_args, grad_pos)
        got, grads = _loss_and_grads(implementation(case, "triton"), args, grad_pos)
        out["loss_rel_err"] = _rel_err(got[0], ref[0])
        out["grad_rel_err_max"] = max(_rel_err(g, r) for g, r in zip(grads, ref_grads))
        ok = out["loss_rel_err"] < LOSS_TOL and out["grad_rel_err_max"] < GRAD_TOL and bool(torch.isfinite(got[0]))
        if len(got) > 1:
            out["accuracy_abs_err"] = abs(float(got[1]) - float(ref[1]))
            ok = ok and out["accuracy_abs_err"] <= ACCURACY_TOL
        out["ok"] = ok
    except Exception as err:  # noqa: BLE001 - one case failing (an OOM, a compile error) is its result
        out.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def env_row(ctx, row) -> dict[str, Any]:
    from benchmarks.kernels.bench_kernels import OPS

    requirements, _ = check_requirements(need_cuda=not ctx.dry_run)
    checks = [correctness(case, ctx.device, ctx.dry_run) for case in OPS]
    return {"requirements": requirements, "correctness": checks, "all_correct": all(c["ok"] for c in checks)}


def kernel_row(ctx, row) -> dict[str, Any]:
    """Every (case, impl) of the row (`bench_kernels.measure_impls`): ms, peak MiB and the ratios to eager."""
    import torch

    from benchmarks.kernels.bench_kernels import measure_impls

    cuda = ctx.device.type == "cuda"
    low = torch.bfloat16 if cuda else torch.float32  # the Triton interpreter has no bf16 dot
    cases = row.arg("case")
    shape, skipped = shape_for(row.arg("size"), ctx.dry_run), {}
    cases = (cases,) if isinstance(cases, str) else tuple(cases)
    results = [r for case in cases
               for r in measure_impls(case, row.arg("impls"), shape, ctx.device, low, *((2, 10) if cuda else (1, 1)),
                                      refs=("eager_bf16", "eager_fp32"), skipped=skipped)]
    out = {"size": row.arg("size"), "tokens": shape["batch"] * shape["seq_len"], "results": results,
           "not_measured": skipped}
    if row.arg("profile"):  # where our kernel's forward + backward spends its time
        out["breakdown"] = {case: profile_kernel(case, shape, ctx.device, low) for case in cases}
    return out


def profile_kernel(case: str, shape: dict[str, Any], device, dtype) -> dict[str, Any]:
    """One profiled forward + backward of our fused loss (`triton`) after a warm-up one
    (`benchmarks.common.breakdown`: CUDA time per category, the largest kernels)."""
    import torch

    from benchmarks.common.breakdown import profile_window
    from benchmarks.kernels.bench_kernels import build_case, implementation

    args, grad_pos, kwargs = build_case(case, shape, device, dtype)
    leaves = [a.detach().requires_grad_() if i in grad_pos else a for i, a in enumerate(args)]
    fn = implementation(case, "triton")

    def step() -> None:
        out = fn(*leaves, **kwargs)
        (out[0] if isinstance(out, tuple) else out).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()
    result = profile_window(step, 1, device.type == "cuda")
    del args, leaves
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def pytest_row(ctx, row) -> dict[str, Any]:
    """`pytest -m gpu` over the test files that hold a gpu marker (the dry run: the kernel tests'),
    in a subprocess bounded by the row's `timeout_s`. GPU tests also marked `slow` (whole training runs, e.g.
    bf16 validation and resume) do not fit the lease's row and are deselected; the result counts them."""
    paths = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text(errors="replace"))
    if ctx.dry_run:  # every file would cost minutes of imports on one core
        paths = [p for p in paths if p.startswith("tests/kernels/")]
    return run_pytest(paths, "gpu and not slow", row.arg("timeout_s", 60))


#: What a failing pytest row keeps of each failure's short traceback (`--tb=short`), and how many it keeps:
#: enough to name the failing line and its assertion or exception; the JSON stays small.
TRACEBACK_CHARS, TRACEBACKS = 1500, 5


def run_pytest(paths: list[str], marker: str, timeout: float, cwd: Path = REPO) -> dict[str, Any]:
    """`pytest -m MARKER -q -rfE --tb=short PATHS` in a subprocess: exit code, summary line, the FAILED /
    ERROR lines with their messages (`-rfE`) and, per failure, the tail of its short traceback (at most
    `TRACEBACKS` of `TRACEBACK_CHARS` each), so a failure on a lent device can be diagnosed from the JSON."""
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider", *paths]
    try:
        # a wide terminal: pytest cuts each -rfE line (the exception message) to the terminal's width
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**os.environ, "COLUMNS": "300"})
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return {"command": "pytest " + " ".join(cmd[3:]), "exit": None, "summary": f"timed out after {timeout} s",
                "tracebacks": failure_tracebacks(out)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|skipped|failed|deselected|error)", ln)),
                   lines[-1] if lines else proc.stderr[-300:])
    return {"command": "pytest " + " ".join(cmd[3:]), "exit": proc.returncode, "summary": summary.strip("= "),
            "failures": "; ".join([ln[:300] for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10]),
            "tracebacks": failure_tracebacks(proc.stdout)}


def failure_tracebacks(stdout: str) -> list[dict[str, str]]:
    """[{test, traceback}] from pytest's FAILURES / ERRORS sections (`___ name ___` headers), each the
    tail of its section (where the assertion or the exception is), bounded by `TRACEBACK_CHARS`."""
    out: list[dict[str, str]] = []
    section, name, body = None, None, []

    def close() -> None:
        if name is not None and len(out) < TRACEBACKS:
            text = "\n".join(body).strip()
            out.append({"test": name, "traceback": text[-TRACEBACK_CHARS:]})

    for line in stdout.splitlines():
        banner = re.fullmatch(r"=+ (FAILURES|ERRORS|short test summary info|.*(passed|failed|error).*) =+", line)
        if banner:
            close()
            section, name, body = banner.group(1), None, []
            continue
        header = re.fullmatch(r"_{3,} (.+?) _{3,}", line)
        if section in ("FAILURES", "ERRORS") and header:
            close()
            name, body = header.group(1), []
        elif name is not None:
            body.append(line)
    close()
    return out
