"""Stage `kernels`: every fused loss the objectives use, forward + backward time and peak memory,
against eager torch (fp32 and bf16 inputs), `torch.compile` of the eager code, Liger-Kernel's fused
linear cross-entropy and Cut Cross-Entropy where they apply, at 16k and 64k tokens.

Cases (`benchmarks.kernels.bench_kernels.OPS`; inputs from its `build_case`): linear cross-entropy
(MLM, generator), the same with MLM accuracy, COCO-LM's corrective LM, BERT-NCE with per-row
negatives and over a shared negative set (InfoWord's `num_negatives: all`), token InfoNCE (TACO,
K = 50) and sequence InfoNCE with a memory queue of 8,192 (CAPT). Shapes: T tokens = 16,384 or
65,536 in sequences of 512, every token a row of the vocabulary-projection losses (the peers'
convention; MLM itself projects 15% of them), V = 30,522, H = 1,024, one sequence pair per 512 tokens.

Implementations: `eager_fp32` (the reference on fp32 inputs), `eager_bf16` (the reference on the
bf16 inputs, which it upcasts), `compile` (`torch.compile(reference, dynamic=False)`), `triton`
(ours), `liger` (`liger_fused_linear_cross_entropy`, with `return_token_accuracy` for the accuracy
case), `cce` (`cut_cross_entropy.linear_cross_entropy`, default `filter_eps`; it has no bias, so its
row omits the bias add). Peers run only where they compute the same loss, and are skipped with the
reason when not installed. Rows are ordered so the judged ones come first: when the stage budget is
spent, what is left (the compile rows of the larger size first) is skipped and named.

Time: median of `repeats` steps (CUDA events) after `warmup`; memory: peak allocated during one
step above what the inputs hold (`bench_kernels.measure`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from benchmarks.gpu_suite.stage_io import StageContext
from benchmarks.gpu_suite import targets as T

SIZES = {"16k": 32, "64k": 128}  # tokens -> sequences of 512
PEERS = {"liger": ("linear_cross_entropy", "linear_cross_entropy_with_accuracy"), "cce": ("linear_cross_entropy",)}
IMPL_ORDER = ("triton", "eager_bf16", "eager_fp32", "liger", "cce")


def shape_for(size: str, dry_run: bool) -> dict[str, Any]:
    from benchmarks.kernels.bench_kernels import SHAPES

    if dry_run:  # two tiny sizes standing for 16k and 64k
        return {**SHAPES["small"], "batch": 2 if size == "16k" else 4}
    batch = SIZES[size]
    return {**SHAPES["full"], "batch": batch, "mask_rate": 1.0, "pairs": batch}


def peer(impl: str, case: str) -> Callable:
    """The peer's function with our reference's signature (hidden, weight, bias, targets)."""
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        if case == "linear_cross_entropy_with_accuracy":
            def liger_acc(h, w, b, t):
                out = liger(h, w, t, bias=b, return_token_accuracy=True)
                return out.loss, out.token_accuracy
            return liger_acc
        return lambda h, w, b, t: liger(h, w, t, bias=b)
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy as cce

        return lambda h, w, b, t: cce(h, w, t)
    raise KeyError(impl)


def peer_missing(impl: str) -> Optional[str]:
    module = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}[impl]
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001
        return f"{module} not importable ({type(err).__name__}: {err})"
    return None


def make_fn(case: str, impl: str, dry_run: bool) -> Callable:
    import torch

    from benchmarks.kernels.bench_kernels import implementation

    if impl in ("eager_fp32", "eager_bf16"):
        return implementation(case, "torch")
    if impl == "compile":
        torch._dynamo.reset()  # a fresh compile per row: past the recompile limit dynamo would run eager silently
        # The rehearsal traces with dynamo but skips inductor's C++ build (minutes on one CPU core).
        return torch.compile(implementation(case, "torch"), dynamic=False, backend="eager" if dry_run else "inductor")
    if impl == "triton":
        return implementation(case, "triton")
    return peer(impl, case)


def plan_rows(dry_run: bool) -> list[tuple[str, str, str]]:
    """(size, case, impl) in the order they run: every judged row first, compile rows last."""
    from benchmarks.kernels.bench_kernels import OPS

    rows = [(size, case, impl) for size in SIZES for case in OPS for impl in IMPL_ORDER
            if impl not in PEERS or case in PEERS[impl]]
    return rows + [(size, case, "compile") for size in SIZES for case in OPS]


def measure_all(ctx: StageContext) -> list[dict[str, Any]]:
    import torch

    from benchmarks.kernels.bench_kernels import build_case, measure

    device = ctx.device
    cuda = device.type == "cuda"
    low = torch.bfloat16 if cuda else torch.float32  # the Triton interpreter has no bf16 dot
    warmup, repeats = (2, 10) if cuda else (1, 1)
    missing = {impl: peer_missing(impl) for impl in PEERS}
    if not cuda:
        missing = {impl: "dry run: peers need CUDA" for impl in PEERS}
    rows: list[dict[str, Any]] = []
    inputs: dict[tuple[str, str, str], tuple] = {}
    for size, case, impl in plan_rows(ctx.dry_run):
        label = f"{size}/{case}/{impl}"
        if impl in missing and missing[impl]:
            ctx.skip(label, missing[impl])
            continue
        if not ctx.has_time(15):
            ctx.skip(label, "stage budget spent")
            continue
        shape = shape_for(size, ctx.dry_run)
        dtype = torch.float32 if impl == "eager_fp32" else low
        key = (size, case, str(dtype))
        if key not in inputs:
            inputs.clear()  # one case's inputs at a time (64k fp32 inputs are GBs)
            if cuda:
                torch.cuda.empty_cache()
            inputs[key] = build_case(case, shape, device, dtype)
        args, grads, kwargs = inputs[key]
        row: dict[str, Any] = {"size": size, "case": case, "impl": impl, "dtype": str(dtype).replace("torch.", ""),
                               "tokens": shape["batch"] * shape["seq_len"]}
        try:
            row["ms"], row["peak_mib"] = measure(make_fn(case, impl, ctx.dry_run), args, grads, kwargs, device,
                                                 warmup, repeats)
        except Exception as err:  # noqa: BLE001 - an OOM or compile failure is this row's result
            row.update(ms=None, peak_mib=None, error=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"{label}: {row.get('ms')} ms, {row.get('peak_mib')} MiB {row.get('error', '')}", flush=True)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per row: time and memory against eager bf16 (same inputs) and eager fp32 of the same size and case."""
    base = {(r["size"], r["case"], r["impl"]): r for r in rows}
    for r in rows:
        for ref in ("eager_bf16", "eager_fp32"):
            other = base.get((r["size"], r["case"], ref), {})
            r[f"speedup_vs_{ref}"] = T.ratio(other.get("ms"), r.get("ms"))
            r[f"mem_below_{ref}"] = T.ratio(other.get("peak_mib"), r.get("peak_mib"))


def judge(rows: list[dict[str, Any]], applicable: bool) -> list[dict[str, Any]]:
    get = {(r["size"], r["case"], r["impl"]): r for r in rows}

    def value(size: str, case: str, impl: str, key: str) -> Optional[float]:
        return get.get((size, case, impl), {}).get(key)

    out = []
    for size in SIZES:
        lce = "linear_cross_entropy"
        out += [
            T.target(f"{size} fused linear CE peak memory / CCE's", T.ratio(value(size, lce, "triton", "peak_mib"),
                     value(size, lce, "cce", "peak_mib")), "<=", T.LCE_MEM_VS_CCE, applicable),
            T.target(f"{size} fused linear CE memory below eager fp32", value(size, lce, "triton", "mem_below_eager_fp32"),
                     ">=", T.LCE_MEM_BELOW_EAGER_FP32, applicable),
            T.target(f"{size} fused linear CE time / Liger's", T.ratio(value(size, lce, "triton", "ms"),
                     value(size, lce, "liger", "ms")), "<=", T.LCE_TIME_VS_LIGER, applicable),
            T.target(f"{size} token InfoNCE memory below eager", value(size, "token_contrastive_loss", "triton",
                     "mem_below_eager_bf16"), ">=", T.TOKEN_INFONCE_MEM, applicable, "eager on the same bf16 inputs"),
            T.target(f"{size} token InfoNCE speed-up over eager", value(size, "token_contrastive_loss", "triton",
                     "speedup_vs_eager_bf16"), ">=", T.TOKEN_INFONCE_SPEED, applicable, "eager on the same bf16 inputs"),
        ]
    return out


def charts(rows: list[dict[str, Any]]) -> dict[str, Callable]:
    def grouped(metric: str, ylabel: str) -> Callable:
        def draw(path) -> None:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            from benchmarks.common.report import _save_figure

            size = "64k" if any(r["size"] == "64k" and r.get(metric) for r in rows) else "16k"
            cases = list(dict.fromkeys(r["case"] for r in rows))
            impls = [i for i in (*IMPL_ORDER, "compile") if any(r["impl"] == i for r in rows)]
            fig, ax = plt.subplots(figsize=(10, 4.5))
            width = 0.8 / max(1, len(impls))
            for j, impl in enumerate(impls):
                vals = [next((r.get(metric) or 0 for r in rows if (r["size"], r["case"], r["impl"]) == (size, c, impl)), 0)
                        for c in cases]
                ax.bar([i + j * width for i in range(len(cases))], vals, width, label=impl)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [c.replace("_", " ") for c in cases],
                          rotation=20, ha="right", fontsize=7)
            ax.set_ylabel(ylabel)
            ax.set_title(f"fused losses, {size} tokens: {ylabel} (lower is better)")
            ax.legend(fontsize=7)
            _save_figure(fig, path)
        return draw

    return {"time": grouped("ms", "ms per forward+backward"), "memory": grouped("peak_mib", "peak MiB")}


def run(ctx: StageContext) -> int:
    from benchmarks.gpu_suite.env_stage import require_environment

    require_environment(ctx)
    rows = measure_all(ctx)
    targets = judge(rows, applicable=not ctx.dry_run)
    if ctx.dry_run:
        ctx.notes.append("dry run: tiny shapes, fp32 inputs (no bf16 dot in the interpreter), Triton kernels in the "
                         "interpreter, compile with dynamo's eager backend; times are not performance, nothing judged")
    ctx.notes.append("token InfoNCE: K = 50 candidates per anchor (TACO); queue InfoNCE: CAPT's queue of 8,192, "
                     "one pair per 512 tokens; its share of the MLM step is judged by the throughput stages")

    def profile() -> None:  # the fused linear cross-entropy, the loss with the most targets
        import torch

        from benchmarks.kernels.bench_kernels import build_case, measure

        args, grads, kwargs = build_case("linear_cross_entropy", shape_for("16k", ctx.dry_run), ctx.device,
                                         torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
        measure(make_fn("linear_cross_entropy", "triton", ctx.dry_run), args, grads, kwargs, ctx.device, 0, 1)

    ctx.write({"fused losses: forward + backward": rows}, targets, charts=charts(rows), profile=profile)
    return 0
