"""Fused Triton loss kernels against the torch reference: time and peak memory, side by side.

    python -m benchmarks.kernels.bench_kernels                # CUDA, BERT-large shapes, bf16
    python -m benchmarks.kernels.bench_kernels --small        # tiny shapes; on CPU the kernels run in the
                                                      # Triton interpreter (a smoke test, not a timing)

Each op (`pipeline.kernels.functional.<op>` vs `pipeline.kernels.<file>.<op>`) runs forward +
backward with three implementations: the reference in eager mode (`torch`), the reference under
`torch.compile` (`compile`) and the Triton kernel (`triton`). Reported per row: median
milliseconds per forward+backward step, peak memory allocated during one step above what the
inputs already hold (CUDA only), and both as ratios against eager torch. The issue's targets are
checked from the ratios measured in this one run and printed at the end (and stored in the JSON).
This module is the one kernel benchmark: the GPU suite's kernel rows (`gpu_suite/kernel_rows.py`) call
`measure_impls` with the peers (`liger`, `cce`) and eager bf16 / fp32 as the implementations, and judge
the same `TARGETS` (`gpu_suite/targets.py` reads its kernel thresholds from here).

BERT-large shapes (issue 5): batch x length 128 x 512, 15% of tokens predicted (9,830 rows),
vocabulary 30,522, hidden 1,024, K = 50 negatives (TACO: every token of the batch is an anchor),
sequence contrast over B = 128 pairs with a queue of 8,192 fp32 rows (CAPT's queue is fp32).
Output: `<out>/<name>.json`, `.md`, `.png` via `pipeline.report_files.write_report`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

SHAPES = {
    "full": dict(batch=128, seq_len=512, mask_rate=0.15, vocab=30522, hidden=1024, k=50, pairs=128, queue=8192),
    "small": dict(batch=2, seq_len=24, mask_rate=0.5, vocab=1001, hidden=48, k=7, pairs=5, queue=40),
}
OPS = ("linear_cross_entropy", "linear_cross_entropy_with_accuracy", "corrective_lm_loss",
       "sampled_softmax_cross_entropy", "sampled_softmax_shared", "token_contrastive_loss", "sequence_contrastive_loss")
#: Cases that are another layout of a `functional` op: case name -> op (the rest are named after their op).
CASE_OPS = {"sampled_softmax_shared": "sampled_softmax_cross_entropy"}
IMPLS = ("torch", "compile", "triton")
#: Implementations beside ours: the reference on bf16 or fp32 inputs, and the peers (module that provides each).
EAGER = ("eager_bf16", "eager_fp32")
PEER_MODULES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}
#: Our fused linear cross-entropy with a smaller fp32 scores buffer (`linear_cross_entropy.chunk_budget`):
#: less peak memory, more passes over dW's fp32 accumulator; the GPU suite measures the trade.
CHUNK_VARIANTS = {"triton_chunk64": 64 * 2**20, "triton_chunk128": 128 * 2**20}
#: (op, metric, minimum) from issues 5 and 41 (the GPU suite's, one table); metric = "mem" (eager peak /
#: triton peak) or "speed" (eager ms / triton ms).
TARGETS = (
    ("linear_cross_entropy", "mem", 4.0), ("linear_cross_entropy", "speed", 1.0),
    ("token_contrastive_loss", "mem", 10.0), ("token_contrastive_loss", "speed", 3.0),
    ("sequence_contrastive_loss", "speed", 2.0),
)


def target_minimum(op: str, metric: str) -> float:
    return next(m for o, k, m in TARGETS if (o, k) == (op, metric))
TAU = 0.1


def build_case(op: str, shape: dict, device, dtype, seed: int = 0) -> tuple[list, list[int], dict]:
    """Inputs of `op` at `shape`: (positional args, positions that require grad, keyword args)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dt)

    def ids(high, *size):
        return torch.randint(0, high, size, generator=gen).to(device)

    tokens, hidden, vocab, k = shape["batch"] * shape["seq_len"], shape["hidden"], shape["vocab"], shape["k"]
    rows = max(1, int(tokens * shape["mask_rate"]))
    if op in ("linear_cross_entropy", "linear_cross_entropy_with_accuracy", "corrective_lm_loss",
              "sampled_softmax_cross_entropy", "sampled_softmax_shared"):
        head = [randn(rows, hidden), randn(vocab, hidden, scale=0.05), randn(vocab, scale=0.02)]
        targets = ids(vocab, rows)
        if op in ("linear_cross_entropy", "linear_cross_entropy_with_accuracy"):
            return head + [targets], [0, 1, 2], {}
        if op == "sampled_softmax_shared":
            return head + [targets, *_shared_negatives(targets, shape["batch"], vocab, gen, device)], [0, 1, 2], {}
        if op == "corrective_lm_loss":
            copy_prob = torch.rand(rows, generator=gen).to(device)
            corrupted = torch.where(torch.rand(rows, generator=gen).to(device) < 0.5, targets, ids(vocab, rows))
            return head + [copy_prob, corrupted, targets], [0, 1, 2], {}
        return head + [targets, ids(vocab, rows, k)], [0, 1, 2], {}
    if op == "token_contrastive_loss":
        anchors = torch.arange(tokens, device=device)
        positives = (anchors + ids(5, tokens) - 2).clamp(0, tokens - 1)
        return [randn(tokens, hidden), anchors, positives, ids(tokens, tokens, k), TAU], [0], {}
    if op == "sequence_contrastive_loss":
        pairs = shape["pairs"]
        queue = torch.nn.functional.normalize(randn(shape["queue"], hidden, dt=torch.float32), dim=-1)
        return [randn(pairs, hidden), randn(pairs, hidden), TAU, queue], [0, 1], {}
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def _shared_negatives(targets, groups: int, vocab: int, gen, device) -> tuple:
    """InfoWord's "every token of the other sequences" (`num_negatives: all`) in the shared layout:
    the rows split into `groups` sequences; each row's negatives are the ids of all other sequences,
    as (negative_ids [U] distinct, negative_counts [G, U] = batch count - own count, anchor_groups [N])."""
    import torch

    rows = targets.shape[0]
    anchor_groups = torch.arange(rows) * groups // rows
    tokens = torch.randint(0, vocab, (rows,), generator=gen)  # the batch's token ids, one per row
    negative_ids, inverse = torch.unique(tokens, return_inverse=True)
    own = torch.zeros(groups, negative_ids.numel(), dtype=torch.long)
    own.index_put_((anchor_groups, inverse), torch.ones(rows, dtype=torch.long), accumulate=True)
    counts = own.sum(0, keepdim=True) - own
    return negative_ids.to(device), counts.to(device), anchor_groups.to(device)


def implementation(op: str, impl: str) -> Callable:
    from pipeline.kernels import functional

    if impl in PEER_MODULES:
        return peer(impl)
    op = CASE_OPS.get(op, op)
    reference = getattr(functional, op)
    if impl in ("torch", *EAGER):
        return reference
    if impl == "compile":
        import torch

        return torch.compile(reference, dynamic=False)
    if impl == "triton":
        from pipeline.kernels import get_op

        return get_op(op, "triton")
    if impl in CHUNK_VARIANTS:
        from pipeline.kernels import get_op
        from pipeline.kernels.linear_cross_entropy import chunk_budget

        fused = get_op(op, "triton")

        def chunked(*args, **kwargs):
            with chunk_budget(CHUNK_VARIANTS[impl]):
                return fused(*args, **kwargs)

        return chunked
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS + tuple(CHUNK_VARIANTS)}")


def peer(impl: str) -> Callable:
    """A peer's fused linear cross-entropy with our reference's signature (hidden, weight, bias, targets)."""
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        return lambda h, w, b, t: liger(h, w, t, bias=b)
    from cut_cross_entropy import linear_cross_entropy as cce

    return lambda h, w, b, t: cce(h, w, t)


def peer_missing(impl: str, cuda: bool) -> Optional[str]:
    """Why a peer cannot be measured here, or None."""
    if not cuda:
        return "dry run: peers need CUDA"
    try:
        __import__(PEER_MODULES[impl])
    except Exception as err:  # noqa: BLE001
        return f"{PEER_MODULES[impl]} not importable ({type(err).__name__}: {err})"
    return None


def measure(fn: Callable, args: list, grad_positions: list[int], kwargs: dict, device, warmup: int, repeats: int
            ) -> tuple[float, Optional[float]]:
    """(median ms of forward + backward, peak MiB above the inputs during one step or None on CPU)."""
    import torch

    leaves = [a.detach().requires_grad_(i in grad_positions) if i in grad_positions else a for i, a in enumerate(args)]

    def step() -> None:
        for i in grad_positions:
            leaves[i].grad = None
        out = fn(*leaves, **kwargs)
        (out[0] if isinstance(out, tuple) else out).backward()  # (loss, accuracy): the metric has no gradient

    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        for i in grad_positions:
            leaves[i].grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    for _ in range(repeats):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak


def measure_impls(case: str, impls: Sequence[str], shape: dict, device, dtype, warmup: int, repeats: int,
                  refs: Sequence[str] = ("torch",), skipped: Optional[dict] = None) -> list[dict[str, Any]]:
    """One case under every implementation of `impls` on the same inputs (`dtype`; `eager_fp32` on fp32
    copies): {case, impl, dtype, ms, peak_mib} each (`error` instead when it fails: an OOM or a compile
    error is that implementation's result), plus `speedup_vs_<ref>` / `mem_below_<ref>` for each of `refs`.
    A peer not installed is named in `skipped`, not measured."""
    import torch

    cuda = device.type == "cuda"
    results = []
    for impl in impls:
        if impl in PEER_MODULES and (missing := peer_missing(impl, cuda)):
            if skipped is not None:
                skipped[f"{case}/{impl}"] = missing
            continue
        dt = torch.float32 if impl == "eager_fp32" else dtype
        args, grads, kwargs = build_case(case, shape, device, dt)
        result: dict[str, Any] = {"case": case, "impl": impl, "dtype": str(dt).replace("torch.", "")}
        try:
            result["ms"], result["peak_mib"] = measure(implementation(case, impl), args, grads, kwargs, device, warmup,
                                                       repeats)
        except Exception as err:  # noqa: BLE001 - an OOM or compile failure is a result, recorded per row
            result.update(ms=None, peak_mib=None, error=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
        del args, grads
        if cuda:
            torch.cuda.empty_cache()
        results.append(result)
    for r in results:  # time and memory against each reference on the same case
        for ref in refs:
            other = next((o for o in results if o["impl"] == ref), {})
            r[f"speedup_vs_{ref}"] = _ratio(other.get("ms"), r.get("ms"))
            r[f"mem_below_{ref}"] = _ratio(other.get("peak_mib"), r.get("peak_mib"))
    return results


def run(ops: list[str], impls: list[str], shape_name: str, device_name: str, dtype_name: str,
        warmup: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    device = torch.device(device_name)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    rows: list[dict[str, Any]] = []
    for op in ops:
        results = measure_impls(op, impls, SHAPES[shape_name], device, dtype, warmup, repeats)
        for r in results:  # this report's column names: eager is the `torch` implementation
            rows.append(dict(label=f"{op}/{r['impl']}", op=op, impl=r["impl"], dtype=dtype_name, shape=shape_name,
                             ms=r["ms"], peak_mib=r["peak_mib"], **({"error": r["error"]} if "error" in r else {}),
                             speedup_vs_eager=r["speedup_vs_torch"], mem_reduction_vs_eager=r["mem_below_torch"]))
        print(", ".join(f"{op}/{r['impl']}: {_fmt(r.get('ms'))} ms / {_fmt(r.get('peak_mib'))} MiB" for r in results),
              flush=True)
    return rows


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or den is None or den <= 0 else num / den


def _fmt(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def check_targets(rows: list[dict[str, Any]], applicable: bool) -> list[dict[str, Any]]:
    """The issue's targets with the measured ratio and pass/fail. They are defined for BERT-large
    shapes on a GPU: elsewhere (`applicable` False) the ratio is listed but `passed` stays None."""
    results = []
    for op, metric, minimum in TARGETS:
        row = next((r for r in rows if r["op"] == op and r["impl"] == "triton"), None)
        key = "mem_reduction_vs_eager" if metric == "mem" else "speedup_vs_eager"
        value = None if row is None else row.get(key)
        passed = None if value is None or not applicable else value >= minimum
        results.append(dict(op=op, metric=key, target=minimum, measured=value, passed=passed))
    return results


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (smoke test; the only choice on CPU)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                        help="input dtype (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (default 20 on CUDA, 2 on CPU)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument("--name", default=None, help="report name (default kernels[_small]_<device>)")
    args = parser.parse_args(argv)

    ops = [o for o in args.ops.split(",") if o]
    impls = [i for i in args.impls.split(",") if i]
    for op in ops:
        if op not in OPS:
            parser.error(f"--ops: unknown op {op!r}; choose from {','.join(OPS)}")
    for impl in impls:
        if impl not in IMPLS:
            parser.error(f"--impls: unknown implementation {impl!r}; choose from {','.join(IMPLS)}")

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if device == "cpu" and not args.small:
        parser.error("BERT-large shapes need a CUDA device; use --small for the CPU smoke test")
    if device == "cpu" and "triton" in impls:
        # The Triton kernels run on CPU only in the interpreter, which must be on before they are imported.
        if any(m.startswith("pipeline.kernels.") for m in sys.modules) and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("on CPU the Triton kernels need TRITON_INTERPRET=1 set before they are imported")
        os.environ["TRITON_INTERPRET"] = "1"
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    repeats = args.repeats or (20 if device == "cuda" else 2)
    shape_name = "small" if args.small else "full"

    rows = run(ops, impls, shape_name, device, dtype, args.warmup, repeats)
    targets = check_targets(rows, applicable=device == "cuda" and not args.small)
    notes = [f"shapes: {SHAPES[shape_name]}", f"median of {repeats} forward+backward steps after {args.warmup} warm-up steps"]
    if device == "cpu":
        notes.append("CPU: Triton kernels run in the interpreter; times are not performance, peak memory is not measured")
    for t in targets:
        verdict = "not checked (targets are for BERT-large shapes on a GPU)" if t["passed"] is None else (
            "PASS" if t["passed"] else "FAIL")
        line = f"{t['op']}: {t['metric']} = {_fmt(t['measured'])} (target >= {t['target']:g}x) -> {verdict}"
        notes.append(line)
        print(line)

    from pipeline.report_files import write_report

    name = args.name or f"kernels{'_small' if args.small else ''}_{device}"
    paths = write_report(name, rows, args.out, title=f"Fused loss kernels vs torch ({shape_name} shapes, {dtype}, {device})",
                         bar=("label", "speedup_vs_eager"), notes=notes, extra={"targets": targets})
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return {"rows": rows, "targets": targets, "paths": paths}


if __name__ == "__main__":
    main()
