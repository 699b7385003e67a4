"""Stages `throughput-128` and `throughput-512`: BERT-large, bf16, one GPU; MLM, TACO, CAPT, COCO-LM,
InfoWord and `hf-bert`, all rows of one length in one warm process.

Each pipeline row is the real training loop (`pipeline.train.loop.train`: DeepSpeed engine with the
preset's own engine file - ZeRO-1 for every large preset, fp32 gradient accumulation under bf16,
`ds_configs/README.md` - the objective's own large recipe for its options and optimizer,
`model.size=large`) called in this process one after the other, so the CUDA context, DeepSpeed's
fused-op build, Triton's autotuning and the allocator are warm after the first row, not paid per row
as with a process per row (`benchmarks/throughput/bench_throughput.py`). Every row has the same
micro-batch (16,384 tokens: 128 x 128 or 32 x 512; 32 is capt-large's micro-batch) and gradient
accumulation (`GRAD_ACCUM` micro-batches per optimizer step), `WARMUP` steps then `STEPS` timed
ones, measured by the loop's own metrics (`bench_throughput.summarize_records`); peak memory is
reset before each row. Each row records its engine file, its accumulation and the accumulation its
preset takes on one GPU (`preset_grad_accum`: 32 for taco-base, 128 for cocolm-/infoword-large, 256
for capt-large), which the stage cannot use: 30 timed steps of 256 micro-batches are 128x the
micro-batches of `GRAD_ACCUM` = 2 and would not fit the stage's budget
(`benchmarks.gpu_suite.plan`). With an optimizer step every 2 micro-batches instead of every
32-256, the rows' tokens/s and MFU are a lower bound on the presets' (the step's optimizer update
is paid over fewer tokens). `hf-bert` is `benchmarks/throughput/hf_baseline.py` (transformers'
BertForMaskedLM, SDPA, fused AdamW with the MLM preset's betas / eps / weight decay, the same
micro-batch and accumulation) in the same process. Data: synthetic shards of the BERT vocabulary
(30,522) written here (speed does not depend on token values; InfoWord's shared negative set is
then close to its largest).

MFU: `bench_throughput.MFU_FORMULA`, the training loop's FLOP counter (every encoder pass an
objective makes) over the H100/H200 bf16 dense peak. The queue InfoNCE's share of the MLM step is
the CAPT loss (Triton kernel, one pair per sequence of the micro-batch, queue 8,192) timed here over
the MLM step time per micro-batch.

Stages `throughput-modernbert-128` / `-512` (the `modernbert` plan, `benchmarks.gpu_suite.plan`): the
same rows with `model.arch=modernbert model.size=large-24` (24 x 1024 x 16 heads, GeGLU 2624, window
128, global every 3rd layer) beside their BERT-large partners, objective by objective (`PAIRED_ORDER`:
BERT then ModernBERT, MLM first), in one warm process. Only the architecture differs within a pair:
preset, optimizer, engine, micro-batch, accumulation, length and precision are the row's recipe and
the stage's. Each ModernBERT row gets `tokens_vs_bert` and `mfu_vs_bert` against its partner
(`bench_throughput.add_arch_ratios`; none when the partner did not run), and `tokens_vs_mlm` against
ModernBERT's own MLM row. No hf-bert row (its peer would be transformers' ModernBertForMaskedLM) and
no targets: issue 30 asks for the ratios, not a threshold. The dry run pairs BERT `capt-small` with
ModernBERT `small` (6 x 256 x 4 heads), the smallest pair of equal shape, so the ratio is rehearsed.
"""
from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.gpu_suite import targets as T
from benchmarks.gpu_suite.stage_io import StageContext

OBJECTIVES = {"mlm": "mlm-capt-large", "taco": "taco-base", "capt": "capt-large", "cocolm": "cocolm-large",
              "infoword": "infoword-large"}
HF_ROW = "hf-bert"
#: MLM and hf-bert first: the rows most targets need run before the budget can run out.
ROW_ORDER = ("mlm", HF_ROW, "taco", "capt", "cocolm", "infoword")
#: The ModernBERT stages' rows, (family, objective): each BERT row just before its ModernBERT partner,
#: so a spent budget cuts whole pairs (at most one row without its partner), MLM first.
PAIRED_ORDER = tuple((arch, objective) for objective in OBJECTIVES for arch in ("bert", "modernbert"))
#: model.size per family: the same 24 x 1024 x 16-head shape (`bench_throughput.bert_partner_size`).
SIZES = {"bert": "large", "modernbert": "large-24"}
#: What a ModernBERT row shares with its BERT partner besides the objective and the shape.
PAIR_MATCH = ("seq_len", "engine", "precision", "micro_batch", "grad_accum")
MICRO_BATCH = {128: 128, 512: 32}
GRAD_ACCUM = 2
WARMUP, STEPS = 8, 30
VOCAB = 30522
#: The rehearsal: tiny model (the paired stages: the smallest same-shape pair), short sequences, a few
#: steps (CPU, fp32).
DRY = dict(sizes={"bert": "tiny"}, paired_sizes={"bert": "capt-small", "modernbert": "small"},
           seq_len={128: 32, 512: 64}, micro_batch=2, warmup=1, steps=2, vocab=1001)


def settings(length: int, dry_run: bool, paired: bool = False) -> dict[str, Any]:
    """The stage's shape, batch, steps and precision; `sizes`: model.size per family it runs."""
    if dry_run:
        return dict(sizes=DRY["paired_sizes" if paired else "sizes"], seq_len=DRY["seq_len"][length],
                    micro_batch=DRY["micro_batch"], accum=GRAD_ACCUM, warmup=DRY["warmup"], steps=DRY["steps"],
                    vocab=DRY["vocab"], precision="fp32", workers=0)
    return dict(sizes=SIZES if paired else {"bert": SIZES["bert"]}, seq_len=length, micro_batch=MICRO_BATCH[length],
                accum=GRAD_ACCUM, warmup=WARMUP, steps=STEPS, vocab=VOCAB, precision="bf16", workers=2)


def overrides(s: dict[str, Any], shards: Path, run_dir: Path, arch: str = "bert") -> list[str]:
    """The row's changes to its preset: family and size, shards, shape, batch and precision of the stage,
    run control. The DeepSpeed engine file is the preset's (what the recipe trains with)."""
    total = s["warmup"] + s["steps"]
    return [f"model.arch={arch}", f"model.size={s['sizes'][arch]}", f"data.shards_dir={shards}",
            f"data.seq_len={s['seq_len']}",
            f"data.micro_batch_size={s['micro_batch']}", f"data.global_batch_size={s['micro_batch'] * s['accum']}",
            f"deepspeed.precision={s['precision']}", f"train.total_steps={total}",
            "train.log_every=1", f"train.checkpoint_every={total}", "train.keep_last=1", "train.resume=never",
            "train.tensorboard=false", "train.progress_bar=false", f"train.output_dir={run_dir}",
            f"data.num_workers={s['workers']}", f"optim.warmup_steps={max(1, s['warmup'])}"]


def _fresh_memory() -> dict[str, float]:
    """Free what the last row left and reset the peak; returns what is still allocated (GiB).

    A finished `train()` leaves its DeepSpeed engine alive: the optimizer's gradient hooks on the
    parameters are C++ references the garbage collector cannot see through, so every row would keep
    its model and optimizer states (GBs at BERT-large) until the process ends. `destroy()` on the
    engines still alive removes those hooks and buffers (measured on the CPU: without it one more
    model stays alive per row, with it at most the last one)."""
    import torch

    gc.collect()
    try:
        from deepspeed import DeepSpeedEngine

        with warnings.catch_warnings():  # isinstance on every object touches torch's deprecated module attributes
            warnings.simplefilter("ignore")
            engines = [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]
        for engine in engines:
            engine.destroy()
        del engines
    except ImportError:  # the hf-bert row alone needs no DeepSpeed
        pass
    gc.collect()
    if not torch.cuda.is_available():
        return {}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"resident_before_gb": round(torch.cuda.memory_allocated() / 2**30, 2)}


def _peak_above_start(row: dict[str, Any]) -> None:
    """The row's own peak: peak allocated less what was resident when it started (CUDA only)."""
    if row.get("peak_mem_gb") is not None and "resident_before_gb" in row:
        row["peak_above_start_gb"] = round(row["peak_mem_gb"] - row["resident_before_gb"], 2)


def _shape(s: dict[str, Any], arch: str) -> dict[str, Any]:
    """What identifies a row's model and batch in its table (and pairs it: `PAIR_MATCH`)."""
    return {"arch": arch, "size": s["sizes"][arch], "seq_len": s["seq_len"], "precision": s["precision"],
            "micro_batch": s["micro_batch"]}


def pipeline_row(objective: str, s: dict[str, Any], shards: Path, work: Path, arch: str = "bert") -> dict[str, Any]:
    from benchmarks.throughput.bench_throughput import summarize_records
    from pipeline.config.run import load_config
    from pipeline.data.config import plan_batches
    from pipeline.train.loop import train
    from pipeline.train.metrics import read_jsonl

    run_dir = work / f"{arch}-{objective}"
    shutil.rmtree(run_dir, ignore_errors=True)
    row: dict[str, Any] = {"row": objective, **_shape(s, arch), "preset": OBJECTIVES[objective], **_fresh_memory()}
    started = time.monotonic()
    cfg = load_config(OBJECTIVES[objective], overrides(s, shards, run_dir, arch))
    row["optim"] = {"lr": cfg.optim.lr, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
                    "weight_decay": cfg.optim.weight_decay}
    row.update(engine=cfg.deepspeed.config, grad_accum=plan_batches(cfg.data, 1).grad_accum,
               preset_grad_accum=plan_batches(load_config(OBJECTIVES[objective]).data, 1).grad_accum)
    code = train(cfg)
    if code != 0:
        raise RuntimeError(f"pipeline.train exit {code}")
    row.update(summarize_records(read_jsonl(run_dir / "metrics.jsonl"), s["warmup"]))
    _peak_above_start(row)
    row["wall_s"] = round(time.monotonic() - started, 1)
    shutil.rmtree(run_dir, ignore_errors=True)  # a BERT-large checkpoint is GBs
    return row


def hf_row(s: dict[str, Any], shards: Path, work: Path, optim: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.throughput import hf_baseline
    from benchmarks.throughput.bench_throughput import summarize_records

    row: dict[str, Any] = {"row": HF_ROW, **_shape(s, "bert"), "preset": "BertForMaskedLM (sdpa)",
                           "grad_accum": s["accum"], **_fresh_memory()}
    started = time.monotonic()
    args = Namespace(shards=str(shards), size=s["sizes"]["bert"], seq_len=s["seq_len"], micro_batch=s["micro_batch"],
                     precision=s["precision"], steps=s["steps"], warmup=s["warmup"], lr=optim["lr"],
                     betas=tuple(optim["betas"]), eps=optim["eps"], weight_decay=optim["weight_decay"],
                     grad_accum=s["accum"], seed=1234, num_workers=s["workers"], out=str(work / HF_ROW))
    row.update(summarize_records(hf_baseline.run(args), s["warmup"]), optim=optim)
    _peak_above_start(row)
    row["wall_s"] = round(time.monotonic() - started, 1)
    return row


def add_ratios(rows: list[dict[str, Any]], paired: bool = False) -> list[str]:
    """`tokens_vs_mlm` / `mfu_vs_mlm` against the MLM row of the same family; without `paired` (the core
    stages, BERT only) `tokens_vs_hf_bert` against hf-bert; with it, `tokens_vs_bert` / `mfu_vs_bert` of
    each ModernBERT row against its BERT partner (`bench_throughput.add_arch_ratios`, whose printable
    lines are returned)."""
    from benchmarks.throughput.bench_throughput import add_arch_ratios

    by = {(r["arch"], r["row"]): r for r in rows}
    for r in rows:
        mlm = by.get((r["arch"], "mlm"), {})
        r["tokens_vs_mlm"] = T.ratio(r.get("tokens_per_s"), mlm.get("tokens_per_s"))
        r["mfu_vs_mlm"] = T.ratio(r.get("mfu"), mlm.get("mfu"))
        if not paired:
            r["tokens_vs_hf_bert"] = T.ratio(r.get("tokens_per_s"), by.get(("bert", HF_ROW), {}).get("tokens_per_s"))
    return add_arch_ratios(rows, name="row", size="size", match=PAIR_MATCH) if paired else []


def queue_infonce_ms(s: dict[str, Any], device) -> float:
    """Median ms of CAPT's queue InfoNCE (Triton) forward + backward for one micro-batch of pairs."""
    import torch

    from benchmarks.kernels.bench_kernels import SHAPES, build_case, implementation, measure

    full = SHAPES["small" if device.type == "cpu" else "full"]
    shape = {**full, "pairs": s["micro_batch"]}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args, grads, kwargs = build_case("sequence_contrastive_loss", shape, device, dtype)
    ms, _ = measure(implementation("sequence_contrastive_loss", "triton"), args, grads, kwargs, device,
                    *((3, 20) if device.type == "cuda" else (1, 1)))
    return ms


def judge(rows: list[dict[str, Any]], length: int, queue_share: Optional[float], applicable: bool) -> list[dict]:
    by = {r["row"]: r for r in rows}
    out = [T.target(f"L={length} MLM MFU", by.get("mlm", {}).get("mfu"), ">=", T.MFU_MLM[length], applicable),
           T.target(f"L={length} MLM tokens/s vs hf-bert", by.get("mlm", {}).get("tokens_vs_hf_bert"), ">=",
                    T.MLM_VS_HF, applicable)]
    for objective in OBJECTIVES:
        if objective != "mlm":
            out.append(T.target(f"L={length} {objective} MFU / MLM's", by.get(objective, {}).get("mfu_vs_mlm"), ">=",
                                T.OBJECTIVE_MFU_VS_MLM, applicable))
    out.append(T.target(f"L={length} queue InfoNCE share of the MLM step", queue_share, "<=",
                        T.QUEUE_SHARE_OF_MLM_STEP, applicable, "CAPT loss per micro-batch / MLM step time per micro-batch"))
    return out


def charts(rows: list[dict[str, Any]], title: str, paired: bool) -> dict[str, Callable]:
    from benchmarks.common.report import bar_chart

    done = [{**r, "label": f"{r['arch']} {r['row']}" if paired else r["row"]} for r in rows if r.get("tokens_per_s")]
    out = {"tokens": lambda p: bar_chart(done, "label", "tokens_per_s", p, f"{title}: tokens/s")}
    if any(r.get("mfu") for r in done):
        out["mfu"] = lambda p: bar_chart(done, "label", "mfu", p, f"{title}: MFU")
    if paired and any(r.get("tokens_vs_bert") for r in done):
        out["vs_bert"] = lambda p: bar_chart(done, "label", "tokens_vs_bert", p, f"{title}: tokens/s vs BERT")
    return out


def table_title(s: dict[str, Any], dry_run: bool, paired: bool) -> str:
    sizes = " vs ".join(f"BERT-{size}" if arch == "bert" else f"ModernBERT {size}" for arch, size in s["sizes"].items())
    return f"{sizes} L={s['seq_len']}" + (" (dry run)" if dry_run else "")


def run_length(ctx: StageContext, length: int, paired: bool = False) -> int:
    """One stage: every row of one length in this process (`paired`: the ModernBERT stages' pairs), the
    ratios, and for the core stages the queue InfoNCE share, the targets and the profile."""
    from benchmarks.data.synthetic_shards import write_synthetic_shards
    from benchmarks.gpu_suite.env_stage import require_environment
    from benchmarks.throughput.bench_throughput import MFU_FORMULA

    require_environment(ctx)
    s = settings(length, ctx.dry_run, paired)
    order = PAIRED_ORDER if paired else tuple(("bert", name) for name in ROW_ORDER)
    work = Path(tempfile.mkdtemp(prefix=f"gpu_suite_{ctx.stage.name}_"))
    rows: list[dict[str, Any]] = []
    queue_share = None
    try:
        shards = work / "shards"
        rows_needed = max(256, 2 * s["micro_batch"] * s["accum"] * (s["warmup"] + s["steps"]))
        write_synthetic_shards(shards, s["vocab"], s["seq_len"], rows=rows_needed)
        mlm_optim = None
        for arch, name in order:
            label = name if not paired else f"{arch} {name}"
            if not ctx.has_time(25):
                ctx.skip(f"row {label}", "stage budget spent")
                continue
            try:
                if name == HF_ROW:
                    if mlm_optim is None:
                        raise RuntimeError("no MLM row: the hf-bert row takes its optimizer settings from it")
                    row = hf_row(s, shards, work, mlm_optim)
                else:
                    row = pipeline_row(name, s, shards, work, arch)
                    mlm_optim = row["optim"] if (arch, name) == ("bert", "mlm") else mlm_optim
            except Exception as err:  # noqa: BLE001 - an OOM or a failed run is that row's result
                row = {"row": name, **_shape(s, arch),
                       "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
            rows.append(row)
            print(f"row {label}: " + json.dumps({k: v for k, v in row.items() if k != "optim"}, default=str), flush=True)
        pair_lines = add_ratios(rows, paired)
        mlm = next((r for r in rows if r["row"] == "mlm" and r.get("step_time_s")), None)
        if not paired and mlm is not None and ctx.has_time(10):
            ms = queue_infonce_ms(s, ctx.device)
            queue_share = ms / (mlm["step_time_s"] * 1e3 / s["accum"])
            ctx.notes.append(f"queue InfoNCE: {ms:.3f} ms per micro-batch of {s['micro_batch']} pairs (queue 8,192)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets = [] if paired else judge(rows, length, queue_share, applicable=not ctx.dry_run)
    ctx.notes += [MFU_FORMULA, f"settings: {s}; every row {s['steps']} timed steps after {s['warmup']} warm-up steps, "
                  f"one process",
                  f"every row{'' if paired else ' (hf-bert too)'} accumulates {s['accum']} micro-batches per optimizer "
                  "step, its preset 32-256 on one GPU (preset_grad_accum; not within the stage's budget): an optimizer "
                  f"update every {s['accum']} micro-batches makes tokens/s and MFU here a lower bound on the presets'; "
                  "engine: each preset's own DeepSpeed file (engine)"]
    if paired:
        ctx.notes += ["tokens_vs_bert / mfu_vs_bert: a ModernBERT row's tokens/s / MFU over its BERT partner's (same "
                      "objective and preset, same-shape size, length, engine, precision, micro-batch and accumulation; "
                      "measured in this process just before it); none where the partner did not run; tokens_vs_mlm: "
                      "against the MLM row of the same family; no targets (issue 30 asks for the ratios)"] + pair_lines
    if ctx.dry_run:
        ctx.notes.append("dry run: small models, short sequences, fp32 on the CPU; times are not performance, "
                         "nothing judged")

    def profile() -> None:  # two MLM steps of the same recipe
        from pipeline.config.run import load_config
        from pipeline.train.loop import train

        pwork = Path(tempfile.mkdtemp(prefix="gpu_suite_profile_"))
        try:
            short = {**s, "warmup": 1, "steps": 1}
            write_synthetic_shards(pwork / "shards", s["vocab"], s["seq_len"], rows=256)
            train(load_config(OBJECTIVES["mlm"], overrides(short, pwork / "shards", pwork / "run")))
        finally:
            shutil.rmtree(pwork, ignore_errors=True)

    title = table_title(s, ctx.dry_run, paired)
    # the paired stages judge nothing, so a profile (written only for a missed target) would never be written
    ctx.write({title: rows}, targets, charts=charts(rows, title, paired), profile=None if paired else profile,
              extra={"settings": s, "seq_len": length})
    return 0


def run_128(ctx: StageContext) -> int:
    return run_length(ctx, 128)


def run_512(ctx: StageContext) -> int:
    return run_length(ctx, 512)


def run_modernbert_128(ctx: StageContext) -> int:
    return run_length(ctx, 128, paired=True)


def run_modernbert_512(ctx: StageContext) -> int:
    return run_length(ctx, 512, paired=True)
