"""Training rows: BERT-large (or ModernBERT large-24) steps of one objective, `hf-bert`, and the queue
InfoNCE's share of a CAPT step; bf16 on one GPU, one warm process for every row of a command.

A `train` row times the loop's own step and nothing else (`benchmarks.common.runs.timed_steps`: the run
built as `pipeline.train` builds it, `Run.train_step` for `WARMUP` + `STEPS` unlogged optimizer steps - no
accuracy, health metrics, metrics line, checkpoint or profiler; each step synchronized and timed alone;
median step time, spread, tokens/s and MFU as `common.runs.MFU_FORMULA` gives it). The optimizer is
`optim.impl=torch`: torch's fused AdamW through DeepSpeed's client-optimizer path, so nothing is
compiled just in time on the device (DeepSpeed's FusedAdam builds with ninja on first use, 30-90 s).

Every row has the same micro-batch (16,384 tokens: 128 x 128 or 32 x 512) and `GRAD_ACCUM`
micro-batches per optimizer step; each records the accumulation its preset takes on one GPU
(`preset_grad_accum`, 32-256): an update every 2 micro-batches makes tokens/s and MFU a lower bound
on the presets'. `hf` is `benchmarks/throughput/hf_baseline.py` (BertForMaskedLM, SDPA, fused AdamW
with the MLM row's settings, same shards, micro-batch and accumulation). A ModernBERT row gets
`tokens_vs_bert` / `mfu_vs_bert` against the BERT row of the same objective and shape measured just
before it (`common.runs.add_arch_ratios`). Data: synthetic shards of the BERT vocabulary.
"""
from __future__ import annotations

import shutil
from argparse import Namespace
from pathlib import Path
from typing import Any

from benchmarks.common.runs import add_arch_ratios, fresh_memory, quiet_overrides, summarize, timed_steps

PRESETS = {"mlm": "mlm-capt-large", "taco": "taco-base", "capt": "capt-large", "cocolm": "cocolm-large",
           "infoword": "infoword-large", "electra": "electra-large"}
SIZES = {"bert": "large", "modernbert": "large-24"}
#: What a ModernBERT row shares with its BERT partner besides the objective and the shape.
PAIR_MATCH = ("seq_len", "engine", "precision", "micro_batch", "grad_accum", "shards")
MICRO_BATCH = {128: 128, 512: 32}
GRAD_ACCUM = 2
#: 3 warm-up steps (allocator, cuBLAS heuristics, Triton autotuning) and 10 timed ones: each row
#: reports its spread so a lease shows whether 10 are enough.
WARMUP, STEPS = 3, 10
#: A row with `profile` runs this many more steps under the profiler after its timed ones: its
#: `breakdown` (`benchmarks.common.breakdown`: CUDA time per category, device idle, the three largest).
PROFILE_STEPS = 2
#: Packed shards (`packed` rows): documents of log-normal length (median `PACKED_MEDIAN` x L, sigma
#: `PACKED_SIGMA`) packed by `data_prep.packing.Packer` in `doc` mode, so rows end padded where a
#: document ends: the encoder unpads them (varlen) and tokens/s counts real tokens only.
PACKED_MEDIAN, PACKED_SIGMA = 0.5, 1.0
VOCAB = 30522
OPTIMIZER = "torch.optim.AdamW(fused=True) via DeepSpeed's client-optimizer path (optim.impl=torch; nothing JIT-built)"
#: The rehearsal: tiny models (paired: the smallest same-shape pair), short sequences, fp32 on the CPU.
DRY = dict(sizes={"bert": "tiny"}, paired_sizes={"bert": "capt-small", "modernbert": "small"},
           seq_len={128: 32, 512: 64}, micro_batch=2, warmup=1, steps=2, vocab=1001, profile=1)


def settings(length: int, dry_run: bool, paired: bool = False, profile: bool = False) -> dict[str, Any]:
    """The row's shape, batch, steps and precision; `sizes`: model.size per family; `profile`: the
    steps profiled after the timed ones (0 without a breakdown)."""
    if dry_run:
        return dict(sizes=DRY["paired_sizes" if paired else "sizes"], seq_len=DRY["seq_len"][length],
                    micro_batch=DRY["micro_batch"], accum=GRAD_ACCUM, warmup=DRY["warmup"], steps=DRY["steps"],
                    vocab=DRY["vocab"], precision="fp32", workers=0, profile=DRY["profile"] if profile else 0)
    return dict(sizes=SIZES if paired else {"bert": SIZES["bert"]}, seq_len=length, micro_batch=MICRO_BATCH[length],
                accum=GRAD_ACCUM, warmup=WARMUP, steps=STEPS, vocab=VOCAB, precision="bf16", workers=2,
                profile=PROFILE_STEPS if profile else 0)


def overrides(s: dict[str, Any], shards: Path, run_dir: Path, arch: str = "bert") -> list[str]:
    """The row's changes to its preset: family and size, shards, shape, batch, precision, optimizer
    implementation and run control; the DeepSpeed engine file stays the preset's."""
    total = s["warmup"] + s["steps"] + s["profile"]
    return [f"model.arch={arch}", f"model.size={s['sizes'][arch]}", f"data.shards_dir={shards}",
            f"data.seq_len={s['seq_len']}", f"data.micro_batch_size={s['micro_batch']}",
            f"data.global_batch_size={s['micro_batch'] * s['accum']}", f"deepspeed.precision={s['precision']}",
            "optim.impl=torch", *quiet_overrides(run_dir, total, log_every=total), f"data.num_workers={s['workers']}",
            f"optim.warmup_steps={max(1, s['warmup'])}"]


def shards_for(ctx, s: dict[str, Any], packed: bool = False) -> Path:
    """Synthetic shards of the row's length, written once per command: full rows, or (`packed`) documents
    packed by the project's packer in `doc` mode (`write_packed_shards`; rows padded where documents end)."""
    from benchmarks.data.synthetic_shards import write_packed_shards, write_synthetic_shards

    path = ctx.work / f"{'packed' if packed else 'shards'}-L{s['seq_len']}"
    if not (path / "manifest.json").is_file():
        rows = max(256, 2 * s["micro_batch"] * s["accum"] * (WARMUP + STEPS + PROFILE_STEPS))
        if packed:
            write_packed_shards(path, s["vocab"], s["seq_len"], rows=rows, median=PACKED_MEDIAN, sigma=PACKED_SIGMA)
        else:
            write_synthetic_shards(path, s["vocab"], s["seq_len"], rows=rows)
    return path


def real_token_fraction(shards: Path) -> float:
    """Real (non-pad) tokens / all token slots of a shard directory (its manifest's counts)."""
    from pipeline.data.shards import read_manifest

    manifest = read_manifest(shards)
    return round(1 - manifest.stats["padding_tokens"] / manifest.total_tokens, 4)


def shape(s: dict[str, Any], arch: str) -> dict[str, Any]:
    return {"arch": arch, "size": s["sizes"][arch], "seq_len": s["seq_len"], "precision": s["precision"],
            "micro_batch": s["micro_batch"]}


def train_row(ctx, row) -> dict[str, Any]:
    from pipeline.train.run_config import load_config
    from pipeline.data.config import plan_batches

    objective, length, arch = row.arg("objective"), row.arg("length"), row.arg("arch", "bert")
    packed = bool(row.arg("packed"))
    s = settings(length, ctx.dry_run, ctx.paired, profile=bool(row.arg("profile")))
    shards = shards_for(ctx, s, packed)
    run_dir = ctx.work / f"{arch}-{objective}-L{length}{'-packed' if packed else ''}"
    out: dict[str, Any] = {"objective": objective, **shape(s, arch), "preset": PRESETS[objective],
                           "shards": "packed" if packed else "full",
                           **fresh_memory()}
    try:
        cfg = load_config(PRESETS[objective], overrides(s, shards, run_dir, arch))
        out["optim"] = {"lr": cfg.optim.lr, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
                        "weight_decay": cfg.optim.weight_decay}
        out.update(engine=cfg.deepspeed.config, grad_accum=plan_batches(cfg.data, 1).grad_accum,
                   preset_grad_accum=plan_batches(load_config(PRESETS[objective]).data, 1).grad_accum)
        out.update(timed_steps(cfg, s["warmup"], s["steps"], s["profile"]))
        if packed:
            out["real_token_fraction"] = real_token_fraction(shards)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if out.get("peak_mem_gb") is not None and "resident_before_gb" in out:
        out["peak_above_start_gb"] = round(out["peak_mem_gb"] - out["resident_before_gb"], 2)
    if objective == "mlm" and arch == "bert" and not packed:
        ctx.cache[("mlm_optim", length)] = out["optim"]
    if objective == "capt" and arch == "bert":
        ctx.cache["capt"] = {**out, "length": length}
    return out


def hf_row(ctx, row) -> dict[str, Any]:
    """`hf-bert`: transformers' BertForMaskedLM with the MLM row's AdamW settings (that row runs first)."""
    from benchmarks.throughput import hf_baseline
    from pipeline.train.metrics import device_peak_flops

    length = row.arg("length")
    optim = ctx.cache.get(("mlm_optim", length))
    if optim is None:
        raise RuntimeError(f"no MLM row at L={length} before it: hf-bert takes its optimizer settings from that row")
    s = settings(length, ctx.dry_run, ctx.paired, profile=bool(row.arg("profile")))
    out: dict[str, Any] = {"objective": "mlm", **shape(s, "bert"), "preset": "BertForMaskedLM (sdpa)",
                           "grad_accum": s["accum"], "optim": optim, **fresh_memory()}
    args = Namespace(shards=str(shards_for(ctx, s)), size=s["sizes"]["bert"], seq_len=s["seq_len"],
                     micro_batch=s["micro_batch"], precision=s["precision"], steps=s["steps"], warmup=s["warmup"],
                     lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"], weight_decay=optim["weight_decay"],
                     grad_accum=s["accum"], seed=1234, num_workers=s["workers"], out=str(ctx.work / "hf-bert"))
    records, breakdown = hf_baseline.run_steps(args, s["profile"])
    records = [r for r in records if r["step"] > s["warmup"]]
    out.update(summarize([r["step_time_s"] for r in records], [r["tokens_per_s"] * r["step_time_s"] for r in records],
                         [r["tflops_per_device"] * 1e12 * r["step_time_s"] for r in records],
                         device_peak_flops(s["precision"]), s["micro_batch"] * s["accum"]))
    shutil.rmtree(ctx.work / "hf-bert", ignore_errors=True)
    return out if breakdown is None else {**out, "breakdown": breakdown}


def queue_row(ctx, row) -> dict[str, Any]:
    """CAPT's queue InfoNCE (Triton, queue 8,192, one pair per sequence of the micro-batch), forward +
    backward, over the CAPT row's step time per micro-batch (same command, same length)."""
    import torch

    from benchmarks.kernels.bench_kernels import SHAPES, measure_impls

    capt = ctx.cache.get("capt")
    if not capt or not capt.get("step_time_s"):
        raise RuntimeError("no CAPT row measured before it in this command")
    cuda = ctx.device.type == "cuda"
    shape_ = {**SHAPES["full" if cuda else "small"], "pairs": capt["micro_batch"]}
    result, = measure_impls("sequence_contrastive_loss", ["triton"], shape_, ctx.device,
                            torch.bfloat16 if cuda else torch.float32, *((3, 20) if cuda else (1, 1)), refs=())
    if result["ms"] is None:
        raise RuntimeError(result["error"])
    ms = result["ms"]
    step_ms = capt["step_time_s"] * 1e3 / capt["grad_accum"]
    return {"length": capt["length"], "seq_len": capt["seq_len"], "micro_batch": capt["micro_batch"], "queue_ms": ms,
            "capt_ms_per_micro_batch": step_ms, "share": ms / step_ms}


def add_ratios(rows: list[dict[str, Any]], paired: bool) -> list[str]:
    """On the finished training rows: `tokens_vs_mlm` / `mfu_vs_mlm` against the MLM row of the same
    family and length; without `paired`, `tokens_vs_hf_bert` against hf-bert of that length; with it,
    `tokens_vs_bert` / `mfu_vs_bert` of each ModernBERT row against its BERT partner (the printable
    lines of `common.runs.add_arch_ratios` are returned)."""
    from benchmarks.gpu_suite.targets import ratio

    train = [r for r in rows if r["kind"] in ("train", "hf") and "error" not in r]
    by = {(r["kind"], r["arch"], r["objective"], r["seq_len"], r.get("shards", "full")): r for r in train}
    for r in train:
        shards = r.get("shards", "full")
        mlm = by.get(("train", r["arch"], "mlm", r["seq_len"], shards), {})
        r["tokens_vs_mlm"] = ratio(r.get("tokens_per_s"), mlm.get("tokens_per_s"))
        r["mfu_vs_mlm"] = ratio(r.get("mfu"), mlm.get("mfu"))
        if not paired:
            hf = by.get(("hf", "bert", "mlm", r["seq_len"], "full"), {})
            r["tokens_vs_hf_bert"] = ratio(r.get("tokens_per_s"), hf.get("tokens_per_s"))
    if not paired:
        return []
    return add_arch_ratios([r for r in train if r["kind"] == "train"], name="objective", size="size", match=PAIR_MATCH)
