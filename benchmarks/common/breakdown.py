"""Where a step's time goes: a short `torch.profiler` window over a few steps, summed into categories.

    breakdown = profile_window(step, steps=2, cuda=True)   # step(): one optimizer step, synchronized

On a GPU every kernel of the window (CUDA events) is put in one category by its name
(`category`): attention, GEMM, fused loss (Triton), norm, elementwise / reduction, optimizer,
communication, memcpy / memset, other. The window's wall time minus the union of the kernels'
intervals is `device idle`: the GPU waiting for the host (Python, launches, a host sync, a
compilation, a cuDNN graph build, the data loader). On the CPU (the suite's dry run) the same
categories are summed over the operators' self CPU time. The summary: milliseconds per step of
each category and of device idle, each as a share of the wall time, the three largest (`largest`),
the longest kernels and the host operators with the most self CPU time (a long one is where the
host held the device up).

The window is its own steps (after the timed ones): the profiler's overhead never reaches a timed
number. Anything the profiler cannot do on a machine becomes the breakdown's `error`, not the row's.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, NamedTuple, Optional

#: (category, name fragments; lower case, first match wins). Kernel names on an H100/H200 with torch
#: 2.11: cuBLAS `nvjet_*` / `sm90_xmma_gemm_*` / `cutlass*gemm*`; SDPA `flash_fwd*` / `fmha_cutlass*` /
#: `cudnn_generated_fort_native_sdpa*`; our Triton losses `_softmax_xent_rows_kernel`, `_scores_kernel`, ...
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "_attn", "mha_")),
    ("gemm", ("gemm", "nvjet", "xmma", "cublas", "wgmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
              "aten::linear", "aten::baddbmm")),
    ("fused loss (Triton)", ("_softmax_xent", "_gathered_", "_scores_kernel", "_scaled_matmul", "_row_norms",
                             "_normalize_backward", "cross_entropy", "_cce_", "liger")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lamb")),
    ("communication", ("nccl", "c10d::", "all_reduce", "allreduce", "all_gather")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "batch_norm")),
    ("memcpy / memset", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
    ("elementwise / reduction", ("elementwise", "vectorized", "unrolled", "reduce", "softmax", "dropout", "gelu",
                                 "triton_poi", "triton_red", "triton_per", "index", "gather", "scatter", "cat",
                                 "fill", "where", "arange", "aten::")),
)
OTHER = "other"
DEVICE_IDLE = "device idle (waiting for the host)"
TOP = 8


class Interval(NamedTuple):
    """One profiled event: its name, start and end (microseconds), on the device or the host;
    `self_us`: host events' self time (their children excluded)."""

    name: str
    start: float
    end: float
    device: bool
    self_us: float = 0.0


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, parts in CATEGORIES if any(p in low for p in parts)), OTHER)


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams may overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(events: list[Interval], wall_s: float, steps: int) -> dict[str, Any]:
    """The breakdown (module docstring) of `steps` steps that took `wall_s` seconds. Device events
    when there are any (a GPU window), else the host operators' self times."""
    device = [e for e in events if e.device]
    per_step = 1e-3 / max(steps, 1)  # microseconds of the window -> ms per step
    wall_ms = wall_s * 1e3 / max(steps, 1)
    sums: dict[str, float] = {}
    if device:
        for e in device:
            sums[category(e.name)] = sums.get(category(e.name), 0.0) + (e.end - e.start) * per_step
        busy = union_us((e.start, e.end) for e in device) * per_step
        idle = max(0.0, wall_ms - busy)
        costs = {**sums, DEVICE_IDLE: idle}
    else:
        for e in events:
            sums[category(e.name)] = sums.get(category(e.name), 0.0) + e.self_us * per_step
        busy = idle = None
        costs = dict(sums)
    ranked = sorted(costs.items(), key=lambda kv: -kv[1])
    kernels: dict[str, list[float]] = {}
    for e in device:
        kernels.setdefault(e.name, []).append(e.end - e.start)
    host: dict[str, float] = {}
    for e in events:
        if not e.device:
            host[e.name] = host.get(e.name, 0.0) + e.self_us
    return {
        "steps": steps, "source": "cuda kernels" if device else "cpu operators (self time)",
        "wall_ms_per_step": round(wall_ms, 3),
        "device_busy_ms_per_step": None if busy is None else round(busy, 3),
        "device_idle_ms_per_step": None if idle is None else round(idle, 3),
        "ms_per_step": {k: round(v, 3) for k, v in ranked},
        "share_of_wall": {k: round(v / wall_ms, 4) if wall_ms > 0 else None for k, v in ranked},
        "largest": [{"cost": k, "ms_per_step": round(v, 3), "share_of_wall": round(v / wall_ms, 4) if wall_ms > 0 else None}
                    for k, v in ranked[:3]],
        "top_kernels": [{"name": name[:100], "category": category(name), "calls": len(d),
                         "ms_per_step": round(sum(d) * per_step, 3)}
                        for name, d in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:TOP]],
        "top_host_ops": [{"name": name[:100], "self_ms_per_step": round(us * per_step, 3)}
                         for name, us in sorted(host.items(), key=lambda kv: -kv[1])[:5]],
    }


def intervals(prof: Any) -> list[Interval]:
    """A finished `torch.profiler.profile`'s events as `Interval`s (device kernels, memcpy / memset, host
    ops with their self time). Read from the raw Kineto events: `prof.events()` would build a Python
    event tree of the whole window first (seconds for the ~10^5 events of two BERT-large steps)."""
    from torch.autograd import DeviceType

    device, host = [], []
    for e in prof.profiler.kineto_results.events():
        start, end = e.start_ns() / 1e3, e.end_ns() / 1e3
        if e.device_type() != DeviceType.CPU:
            if not e.is_user_annotation():  # a record_function range drawn on the device: not device work
                device.append(Interval(e.name(), start, end, True))
        else:
            host.append((e.start_thread_id(), start, -end, e.name()))
    return device + self_times(host)


def self_times(host: list[tuple[int, float, float, str]]) -> list[Interval]:
    """Host events (thread, start, -end, name) -> `Interval`s whose `self_us` is their duration minus
    their direct children's (events nest per thread: a child starts and ends inside its parent)."""
    out: list[Interval] = []
    stack: list[list] = []  # [name, start, end, self_us] of the open events of the current thread
    thread = None
    for tid, start, neg_end, name in sorted(host):
        end = -neg_end
        if tid != thread:
            out += [Interval(n, s0, e0, False, self_us) for n, s0, e0, self_us in stack]
            stack, thread = [], tid
        while stack and stack[-1][2] <= start:
            n, s0, e0, self_us = stack.pop()
            out.append(Interval(n, s0, e0, False, self_us))
        if stack:
            stack[-1][3] -= end - start
        stack.append([name, start, end, end - start])
    out += [Interval(n, s0, e0, False, self_us) for n, s0, e0, self_us in stack]
    return out


def profile_window(step: Callable[[], None], steps: int, cuda: bool) -> dict[str, Any]:
    """Run `step()` `steps` times under `torch.profiler` (CPU, and CUDA when `cuda`) and summarize
    them; `{"error": ...}` when the profiler fails here (the row's timings stand regardless)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
        return summarize(intervals(prof), wall, steps)
    except Exception as err:  # noqa: BLE001 - a profiler that cannot run here leaves the row's numbers alone
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}


def breakdown_line(b: Optional[dict[str, Any]]) -> str:
    """`attention 41% / gemm 30% / device idle 12%` (the three largest), or why there is none."""
    if not b:
        return ""
    if "error" in b:
        return f"breakdown failed: {b['error']}"
    return " / ".join(f"{x['cost']} {x['share_of_wall']:.0%}" if x["share_of_wall"] is not None else x["cost"]
                      for x in b["largest"])
