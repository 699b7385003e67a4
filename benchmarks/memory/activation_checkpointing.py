"""Activation checkpointing on a GPU: the suite's row (`benchmarks.gpu_suite`, command `more`, kind
"checkpointing"): the largest micro-batch that fits with and without `model.activation_checkpointing`, and
the tokens/s at each (`gpu_suite_row`), on the training model as `pipeline.train` builds it (`build_model`).

The CPU measurement of the peak activation memory per setting (torch.profiler's CPU allocator events) is
committed in `benchmarks/results/activation_checkpointing.*` (its script is retired: results/README.md,
"Retired scripts"); `tests/benchmarks/test_activation_checkpointing_bench.py` checks the same fall of the peak.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Optional

import numpy as np
import torch

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
#: model.arch -> model.size: the families' tiny shapes (hidden 64, 2 heads), deepened with `layers`.
FAMILIES = {"bert": "tiny", "modernbert": "tiny"}


def build_model(arch: str, layers: Optional[int], seq_len: int, vocab: int, setting: str, window: Optional[int],
                size: Optional[str] = None, kernels: str = "torch") -> torch.nn.Module:
    """The training model (`build_pretrain_model`, MLM) of `arch` (size preset `size`, default the tiny one,
    at `layers` layers when given) with `setting` as `model.activation_checkpointing`; dropout 0.1 everywhere."""
    from pipeline.train.run_config import load_config
    from pipeline.pretrain.build import build_pretrain_model

    overrides = [f"model.arch={arch}", f"model.size={size or FAMILIES[arch]}", "model.dropout=0.1",
                 "model.attention_dropout=0.1", f"model.activation_checkpointing={setting}"]
    if layers:
        overrides.append(f"model.num_layers={layers}")
    if arch == "modernbert" and window:
        overrides.append(f"model.local_attention={window}")
    cfg = load_config("tiny-mlm", overrides)  # the field's own validation (k within the layers) runs here
    encoder = cfg.model.encoder_config(vocab, seq_len, SPECIAL)
    return build_pretrain_model(encoder, {"mlm": 1.0}, SPECIAL, {}, seed=0, kernels=kernels,
                                activation_checkpointing=cfg.model.activation_checkpointing)


def micro_batch(model: torch.nn.Module, batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One collated MLM micro-batch of full rows (`[CLS] ... [SEP]`), the same for every setting (seed 0)."""
    from pipeline.data.corruption import CorruptionCollator

    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL), vocab, size=(batch, seq_len))
    ids[:, 0], ids[:, -1] = SPECIAL["cls"], SPECIAL["sep"]
    collator = CorruptionCollator(model.views, SPECIAL, vocab, seed=1, plans=model.host_plans())
    return collator.collate(ids, np.ones((batch, seq_len), dtype=bool), np.arange(batch))


# ---- the GPU suite's row (`benchmarks.gpu_suite`, command `more`: kind "checkpointing") ------------------------

#: (family, size preset, row length, first micro-batch tried, cap): BERT-large at L=512 and ModernBERT
#: large-24 at 8,192 tokens (`modernbert-long-2phase`'s second phase); the dry run's tiny stand-ins.
GPU_CASES = (("bert", "large", 512, 8, 1024), ("modernbert", "large-24", 8192, 1, 128))
DRY_CASES = (("bert", "tiny", 64, 1, 4), ("modernbert", "tiny", 128, 1, 4))
GPU_SETTINGS = ("none", "all")
GPU_VOCAB = 30522
#: Bytes per parameter a bf16 DeepSpeed run holds besides the bf16 weights and gradients: the fp32 master
#: copy, Adam's two moments and the fp32 gradient accumulation buffer (4 + 8 + 4); reserved while probing.
OPTIMIZER_BYTES_PER_PARAM = 16
TIMED_STEPS = 3


def set_checkpointing(model: torch.nn.Module, setting: str) -> None:
    """Switch `model.activation_checkpointing` on a built model (the stacks' period; weights untouched)."""
    from pipeline.model.checkpointing import checkpoint_period

    period = checkpoint_period(setting, model.config.num_layers)
    for module in model.modules():
        if hasattr(module, "checkpoint_period"):
            module.checkpoint_period = period


def fwd_bwd(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> float:
    """One forward + backward; returns its wall seconds (synchronised)."""
    from pipeline.data.batch import move_batch

    batch = move_batch(batch, device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss, _ = model(batch, sampling_seed=1)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def largest_fitting(model, device, seq_len: int, first: int, cap: int, until: float) -> tuple[int, str, dict]:
    """Double the micro-batch from `first` until a step runs out of memory, passes `cap` or the time `until`
    (monotonic) passes; returns the largest that ran, what stopped the search (`out of memory`, `cap`,
    `time`: a lower bound) and the batches built (reused for the timing)."""
    fits, batches, size, stopped = 0, {}, first, "cap"
    while size <= cap:
        if time.monotonic() >= until:
            stopped = "time"
            break
        batches[size] = micro_batch(model, size, seq_len, GPU_VOCAB, seed=size)
        try:
            fwd_bwd(model, batches[size], device)
            fits = size
        except torch.cuda.OutOfMemoryError:
            batches.pop(size)
            stopped = "out of memory"
            break
        finally:
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        size *= 2
    return fits, stopped, batches


def gpu_suite_row(ctx: Any, row: Any) -> dict[str, Any]:
    """BERT-large at L=512 and ModernBERT large-24 at 8,192 tokens, each without and with checkpointing every
    layer: the largest power-of-two micro-batch whose forward + backward fits (bf16 weights and autocast, the
    optimizer state of a bf16 ZeRO-1 run reserved: `OPTIMIZER_BYTES_PER_PARAM`), and the forward + backward
    tokens/s at that micro-batch (median of up to `TIMED_STEPS`; no optimizer step, which costs the same either
    way). One model per family (built on the device), the setting switched in place. On a lease the row keeps to
    its estimate (`row.gpu_s`): each of the four searches gets an equal share of what is left of it, half for
    doubling, the rest for timing; a search stopped by the clock is a lower bound ("time")."""
    device = ctx.device
    cuda = device.type == "cuda"
    cases = DRY_CASES if ctx.dry_run else GPU_CASES
    row_end = time.monotonic() + row.gpu_s
    results = []
    for arch, size, seq_len, first, cap in cases:
        with device:  # initialised where it runs: a CPU init of a 24-layer large model takes seconds of the row
            model = build_model(arch, None, seq_len, GPU_VOCAB, "none", None, size=size,
                                kernels="auto" if cuda else "torch")
        if cuda:
            model = model.to(torch.bfloat16)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        reserve = torch.empty(params * OPTIMIZER_BYTES_PER_PARAM, dtype=torch.uint8, device=device) if cuda else None
        for setting in GPU_SETTINGS:
            set_checkpointing(model, setting)
            started = time.monotonic()
            left = len(cases) * len(GPU_SETTINGS) - len(results)  # searches left, this one included
            share = float("inf") if ctx.dry_run else max(0.0, row_end - started) / left
            fits, stopped, batches = largest_fitting(model, device, seq_len, first, cap, started + 0.5 * share)
            out: dict[str, Any] = {"family": arch, "size": size, "seq_len": seq_len, "checkpointing": setting,
                                   "largest_micro_batch": fits, "search_stopped_by": stopped}
            if fits:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                times: list[float] = []
                while len(times) < TIMED_STEPS and (not times or time.monotonic() < started + share):
                    times.append(fwd_bwd(model, batches[fits], device))
                out["timed_steps"] = len(times)
                out["tokens_per_s"] = fits * seq_len / sorted(times)[len(times) // 2]
                if cuda:
                    out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            out["wall_s"] = round(time.monotonic() - started, 1)
            results.append(out)
            del batches
        del model, reserve
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for r in results:
        base = next(b for b in results if b["family"] == r["family"] and b["checkpointing"] == "none")
        r["micro_batch_vs_none"] = r["largest_micro_batch"] / base["largest_micro_batch"] if base["largest_micro_batch"] else None
        r["tokens_vs_none"] = (r["tokens_per_s"] / base["tokens_per_s"]
                               if r.get("tokens_per_s") and base.get("tokens_per_s") else None)
    summary = "; ".join(f"{r['family']} L={r['seq_len']} {r['checkpointing']}: micro-batch {r['largest_micro_batch']}"
                        f"{'' if r['search_stopped_by'] == 'out of memory' else '+'}, {r.get('tokens_per_s') or 0:,.0f} tokens/s"
                        for r in results)
    return {"results": results, "summary": summary,
            "method": f"forward+backward, {'bf16 weights + autocast' if cuda else 'fp32 (dry run)'}, "
                      f"{OPTIMIZER_BYTES_PER_PARAM} B/param of optimizer "
                      f"state reserved; micro-batch doubled from the first until out of memory (else the cap or the row's time: "
                      f"'+', a lower bound); "
                      f"tokens/s the median of up to {TIMED_STEPS} steps at the largest"}
