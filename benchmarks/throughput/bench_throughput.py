"""Throughput of every objective against MLM: tokens/s, step time, MFU, peak memory, overhead ratio.

Each configuration (objective x encoder family x size x length x ZeRO stage x precision x micro-batch)
is one real `python -m pipeline.train` run in a fresh process (its `tiny-<objective>` preset, the
requested size); step time, tokens/s, MFU and peak memory are the training loop's own `metrics.jsonl`
after `--warmup` steps, and MLM runs in the same invocation, so `overhead_vs_mlm` compares runs
taken side by side. A failed configuration (say, out of memory) is recorded and the sweep goes on.
Every flag, the ratios (`vs_hf_bert`, `tokens_vs_bert`, `mfu_vs_bert`), the MFU formula and the
targets: benchmarks/README.md#throughput-bench_throughputpy (one home for the prose).

    python benchmarks/throughput/bench_throughput.py --objectives mlm,taco,capt,cocolm,infoword --sizes tiny \\
        --seq-lens 128 --zero 1 --precision fp32 --steps 10 --out benchmarks/results/cpu
    python benchmarks/throughput/bench_throughput.py --sizes large --seq-lens 128,512 --precision bf16 \\
        --micro-batch 32 --options paper --out results/h100            # one GPU, synthetic data

Output: `<out>/throughput.json`, `throughput.md` and PNG bar charts (tokens/s, overhead vs MLM,
and MFU when measured), with hardware and library versions.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.report_files import bar_chart, write_report  # noqa: E402
from pipeline.train.exit_record import last_error_line  # noqa: E402
from benchmarks.common.runs import (MFU_FORMULA, add_arch_ratios, family_sizes, parse_list,  # noqa: E402
                                   quiet_overrides)

OPTIONS_MODES = ("tiny", "paper")
HF_ROW = "hf-bert"


@dataclass(frozen=True)
class BenchCase:
    """One measured configuration."""

    objective: str
    preset: str  # model size preset of the family (ModelConfig.size_presets)
    seq_len: int
    zero: int
    precision: str
    micro_batch: int
    arch: str = "bert"  # model.arch

    @property
    def label(self) -> str:
        family = "" if self.arch == "bert" else f"{self.arch}-"  # BERT labels as before the families
        return f"{family}{self.objective}-{self.preset}-L{self.seq_len}-z{self.zero}-{self.precision}-mb{self.micro_batch}"


def train_overrides(case: BenchCase, shards_dir: Path, run_dir: Path, steps: int, world_size: int,
                    options: str, extra: Sequence[str], num_workers: int = 0, grad_accum: int = 1) -> list[str]:
    """Dotted overrides of `pipeline.train` for one case (on top of the `tiny-<objective>` preset):
    global batch = micro x `grad_accum` x world size."""
    overrides = [
        f"model.arch={case.arch}", f"model.size={case.preset}", f"data.shards_dir={shards_dir}",
        f"data.seq_len={case.seq_len}",
        f"data.micro_batch_size={case.micro_batch}",
        f"data.global_batch_size={case.micro_batch * grad_accum * world_size}",
        f"deepspeed.config=zero{case.zero}", f"deepspeed.precision={case.precision}",
        *quiet_overrides(run_dir, steps), f"data.num_workers={num_workers}",
    ]
    if options == "paper":
        overrides.append(f"objective_options={json.dumps(paper_objective_options(case.objective, case.preset))}")
    return overrides + list(extra)


def preset_grad_accum(objectives: Sequence[str]) -> int:
    """Micro-batches per optimizer step of the `tiny-<objective>` presets the runs load, on one rank
    (`pipeline.data.config.plan_batches`, the one home of the batch arithmetic); one rank, so that a
    multi-node sweep keeps it and scales weakly. The presets must agree: `overhead_vs_mlm` compares
    steps of equal size."""
    from pipeline.train.run_config import load_config
    from pipeline.data.config import plan_batches

    found = {o: plan_batches(load_config(f"tiny-{o}").data, 1).grad_accum for o in objectives}
    if len(set(found.values())) != 1:
        raise ValueError(f"the presets' gradient accumulation differs ({found}): choose one with --grad-accum N")
    return next(iter(found.values()))


#: The paper recipe whose objective options `--options paper` uses (one home: the paper presets).
PAPER_PRESETS = {"mlm": None, "mlm-nce": None, "taco": "taco-small", "capt": "capt-small",
                 "cocolm": "cocolm-base", "infoword": "infoword-base"}


def paper_objective_options(objective: str, size: str) -> dict:
    """`objective_options` of the objective's paper preset (`pipeline/config/presets/`); COCO-LM's
    generator depth follows the model size (`cocolm-large` for `large` and ModernBERT's `large-24` /
    `large`). Objectives without a paper preset run with their constructor defaults."""
    from pipeline.config.loader import available_presets, load_raw
    from pipeline.train.run_config import RunConfig

    preset = PAPER_PRESETS.get(objective)
    if preset is None:
        return {}
    if objective == "cocolm" and size.startswith("large") and "cocolm-large" in available_presets():
        preset = "cocolm-large"
    return dict(load_raw(preset, RunConfig).get("objective_options") or {})


def summarize_records(records: Sequence[dict], warmup: int) -> dict:
    """Throughput numbers from a run's metrics records, over the steps after `warmup`.

    Step time is the median (robust to one slow step, e.g. a garbage collection); tokens/s is
    total tokens over total time of the measured steps; MFU and TFLOP/s are their means; memory is
    the peak at the end (accelerator memory allocated, or the process's peak RSS on CPU).
    """
    measured = [r for r in records if r.get("step", 0) > warmup and "step_time_s" in r]
    if not measured:
        raise ValueError(f"no metrics after the {warmup} warm-up steps (run too short?)")
    times = [r["step_time_s"] for r in measured]
    tokens = [r["tokens_per_s"] * r["step_time_s"] for r in measured]
    out = {
        "measured_steps": len(measured),
        "step_time_s": statistics.median(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "tokens_per_step": round(statistics.fmean(tokens)),  # micro x accumulation x ranks x tokens per row
        "samples_per_s": statistics.fmean(r["samples_per_s"] for r in measured),
        "tflops_per_device": statistics.fmean(r["tflops_per_device"] for r in measured),
        "mfu": statistics.fmean(r["mfu"] for r in measured) if all("mfu" in r for r in measured) else None,
    }
    last = records[-1]
    if "peak_mem_gb" in last:
        out.update(peak_mem_gb=last["peak_mem_gb"], memory="cuda max allocated")
    else:
        out.update(peak_mem_gb=last.get("peak_rss_gb"), memory="cpu peak rss")
    return out


def add_overhead_ratios(rows: list[dict]) -> None:
    """`overhead_vs_mlm` = step time / step time of MLM with the same family, size, length, ZeRO, precision, batch."""
    def key(row: dict) -> tuple:
        return (row.get("arch", "bert"),) + tuple(row[k] for k in ("preset", "seq_len", "zero", "precision",
                                                                   "micro_batch"))

    mlm = {key(r): r["step_time_s"] for r in rows if r["objective"] == "mlm" and r.get("step_time_s")}
    for row in rows:
        base = mlm.get(key(row))
        row["overhead_vs_mlm"] = row["step_time_s"] / base if base and row.get("step_time_s") else None


def add_hf_ratios(rows: list[dict]) -> list[str]:
    """`vs_hf_bert` = tokens/s over the hf-bert row's of the same size, length, precision and micro-batch
    (BERT rows only: the baseline is BertForMaskedLM); returns one printable line per row that has one."""
    def key(row: dict) -> tuple:
        return (row.get("arch", "bert"),) + tuple(row[k] for k in ("preset", "seq_len", "precision", "micro_batch"))

    base = {key(r): r["tokens_per_s"] for r in rows if r["objective"] == HF_ROW and r.get("tokens_per_s")}
    lines = []
    for row in rows:
        ref = base.get(key(row)) if row["objective"] != HF_ROW else None
        row["vs_hf_bert"] = row["tokens_per_s"] / ref if ref and row.get("tokens_per_s") else None
        if row["vs_hf_bert"] is not None:
            lines.append(f"{row['objective']} {row['preset']} L{row['seq_len']} {row['precision']} mb{row['micro_batch']}"
                         f" z{row['zero']}: {row['tokens_per_s']:.0f} / {ref:.0f} tokens/s = "
                         f"{row['vs_hf_bert']:.2f}x {HF_ROW}")
    return lines


def run_case(case: BenchCase, shards_dir: Path, work_dir: Path, args: argparse.Namespace) -> dict:
    """Run one case through `pipeline.train`; returns its report row (with `error` on failure)."""
    from pipeline.train.checkpoint.tags import read_latest
    from pipeline.train.metrics import read_jsonl
    from pipeline.train.run_meta import RunMeta

    run_dir = work_dir / "runs" / case.label
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if case.objective == HF_ROW:
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "hf_baseline.py"), "--shards", str(shards_dir),
               "--size", case.preset, "--seq-len", str(case.seq_len), "--micro-batch", str(case.micro_batch),
               "--precision", case.precision, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--grad-accum", str(args.grad_accum), "--num-workers", str(args.num_workers), "--out", str(run_dir)]
    else:
        overrides = train_overrides(case, shards_dir, run_dir, args.warmup + args.steps, args.world_size,
                                    args.options, args.set, args.num_workers, args.grad_accum)
        launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
        cmd = [*launcher, "-m", "pipeline.train", "--config", f"tiny-{case.objective}", *overrides]
    row: dict = {**asdict(case), "nodes": args.nodes, "world_size": args.world_size, "grad_accum": args.grad_accum,
                 "error": None}
    log_path = work_dir / "logs" / f"{case.label}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    row["wall_s"] = round(time.perf_counter() - started, 1)
    if code != 0:
        row["error"] = f"timed out after {args.timeout}s" if code is None else \
            f"exit {code}: {last_error_line(log_path.read_text(errors='replace'))}"
        print(f"  {case.label}: FAILED ({row['error']}); log: {log_path}", flush=True)
        return row
    row.update(summarize_records(read_jsonl(run_dir / "metrics.jsonl"), args.warmup))
    tag = read_latest(run_dir / "checkpoints")
    if tag is not None:  # the world size the run really had (the launcher decides it)
        row["world_size"] = RunMeta.read(tag).world_size
    if not args.keep_runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"  {case.label}: {row['step_time_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s"
          + (f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""), flush=True)
    return row


def resolve_shards(args: argparse.Namespace, out: Path) -> dict[int, Path]:
    """Sequence length -> shard directory: the given `--shards`, else synthetic ones under `<out>/data/`."""
    from pipeline.data.shards import read_manifest

    if args.shards:
        by_len: dict[int, Path] = {}
        for d in args.shards:
            manifest = read_manifest(d)  # names the directory if it is not a complete build
            by_len[manifest.seq_len] = Path(d)
        missing = [s for s in args.seq_lens if s not in by_len]
        if missing:
            raise ValueError(f"--seq-lens {missing}: no --shards directory has that seq_len (have {sorted(by_len)})")
        return by_len
    from benchmarks.data.synthetic_shards import write_synthetic_shards

    rows = max(256, 2 * args.world_size * max(args.micro_batches) * args.grad_accum * (args.warmup + args.steps))
    by_len = {}
    for seq_len in args.seq_lens:
        by_len[seq_len] = out / "data" / f"synthetic-L{seq_len}-V{args.vocab_size}"
        write_synthetic_shards(by_len[seq_len], args.vocab_size, seq_len, rows=rows)
    return by_len


def arch_sizes(archs: Sequence[str], sizes: Sequence[str]) -> list[tuple[str, str]]:
    """(family, size) pairs of `--archs` x `--sizes`: a plain size for every listed family that has it,
    `family:size` for that family only. ValueError names a size no listed family has."""
    pairs = []
    for item in sizes:
        family, _, size = item.rpartition(":")
        if family and family not in archs:
            raise ValueError(f"--sizes {item}: {family} is not in --archs {','.join(archs)}")
        found = [a for a in ([family] if family else archs) if size in family_sizes(a)]
        if not found:
            raise ValueError(f"--sizes {item}: no size {size!r} in "
                             + "; ".join(f"{a}: {sorted(family_sizes(a))}" for a in ([family] if family else archs)))
        pairs += [(a, size) for a in found if (a, size) not in pairs]
    return pairs


def cases(args: argparse.Namespace) -> Iterable[BenchCase]:
    objectives = list(dict.fromkeys(["mlm", *args.objectives] if args.with_mlm else args.objectives))
    for (arch, preset), seq_len, precision, micro in itertools.product(args.arch_sizes, args.seq_lens, args.precision,
                                                                       args.micro_batches):
        if args.hf_baseline and arch == "bert":  # no ZeRO in a plain torch loop: one row per shape, recorded as stage 0
            yield BenchCase(HF_ROW, preset, seq_len, 0, precision, micro)
        for zero, objective in itertools.product(args.zero, objectives):
            yield BenchCase(objective, preset, seq_len, zero, precision, micro, arch)


def build_parser() -> argparse.ArgumentParser:
    env_int = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
    p = argparse.ArgumentParser(prog="bench_throughput.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", default="mlm,taco,capt,cocolm,infoword", help="comma-separated objective names")
    p.add_argument("--no-mlm", dest="with_mlm", action="store_false", help="do not add the MLM baseline")
    p.add_argument("--archs", default="bert", help="encoder families (model.arch), e.g. bert,modernbert")
    p.add_argument("--sizes", default="tiny", help="size presets, each run for every family of --archs that has it "
                                                   "(bert: tiny, taco-small, capt-small, base, large; modernbert: tiny, "
                                                   "small, base, large, large-24); family:size for one family only")
    p.add_argument("--seq-lens", default="128", help="sequence lengths, e.g. 128,512")
    p.add_argument("--zero", default="1", help="ZeRO stages, e.g. 1,2,3")
    p.add_argument("--precision", default="fp32", help="fp32, bf16, fp16 (comma-separated)")
    p.add_argument("--micro-batch", default="8", help="micro-batch sizes per device (comma-separated)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per configuration")
    p.add_argument("--grad-accum", default="preset",
                   help="micro-batches per optimizer step: 'preset' (the tiny-<objective> presets' on one rank) or N")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (allocator, autotuning, caches)")
    p.add_argument("--options", choices=OPTIONS_MODES, default="tiny", help="objective options: tiny presets' or papers'")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra pipeline.train override")
    p.add_argument("--hf-baseline", action="store_true",
                   help=f"add a '{HF_ROW}' row (transformers.BertForMaskedLM, plain torch loop) per shape")
    p.add_argument("--num-workers", type=int, default=None,
                   help="data.num_workers of every run (default: 2 with a GPU, 0 without)")
    p.add_argument("--shards", action="append", default=[], metavar="DIR", help="shard dir (one per seq len)")
    p.add_argument("--vocab-size", type=int, default=30522, help="vocabulary of synthetic shards")
    p.add_argument("--launcher", default="", help='command replacing "python", e.g. "torchrun --nproc_per_node 2"')
    p.add_argument("--world-size", type=int, default=env_int("SLURM_NTASKS", 1), help="ranks the launcher starts")
    p.add_argument("--nodes", type=int, default=env_int("SLURM_JOB_NUM_NODES", 1), help="nodes (recorded)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    p.add_argument("--work-dir", default="", help="run directories and logs (default: <out>/work)")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory (checkpoint, metrics)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", default="throughput", help="report file name stem")
    return p


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.objectives = parse_list(args.objectives)
        args.archs = parse_list(args.archs)
        args.sizes = parse_list(args.sizes)
        args.seq_lens = parse_list(args.seq_lens, int)
        args.zero = parse_list(args.zero, int)
        args.precision = parse_list(args.precision)
        args.micro_batches = parse_list(args.micro_batch, int)
    except ValueError as err:
        parser.error(str(err))
    from pipeline.config.loader import available_presets
    from pipeline.model.arch import ARCHS
    from pipeline.train.engine import PRECISIONS

    bad = [o for o in args.objectives if f"tiny-{o}" not in available_presets()]
    if bad:
        known = sorted(p[5:] for p in available_presets() if p.startswith("tiny-"))
        parser.error(f"--objectives {bad}: no tiny-<objective> preset; choose from {known}")
    if any(s.replace(" ", "").startswith("model.arch=") for s in args.set):  # one home for the family: the case
        parser.error("--set model.arch=...: choose the encoder families with --archs (e.g. --archs modernbert)")
    try:
        if any(a not in ARCHS for a in args.archs):
            raise ValueError(f"--archs {args.archs}: each must be one of {list(ARCHS)}")
        args.arch_sizes = arch_sizes(args.archs, args.sizes)
    except ValueError as err:
        parser.error(str(err))
    for flag, values, allowed in (("--zero", args.zero, [1, 2, 3]), ("--precision", args.precision, list(PRECISIONS))):
        if any(v not in allowed for v in values):
            parser.error(f"{flag} {values}: each must be one of {allowed}")
    if args.steps < 1 or args.warmup < 0 or args.world_size < 1:
        parser.error("--steps >= 1, --warmup >= 0 and --world-size >= 1 required")
    if args.grad_accum == "preset":
        try:
            args.grad_accum = preset_grad_accum(["mlm", *args.objectives] if args.with_mlm else args.objectives)
        except ValueError as err:
            parser.error(str(err))
    elif not args.grad_accum.isdigit() or int(args.grad_accum) < 1:
        parser.error(f"--grad-accum {args.grad_accum!r}: 'preset' or an integer >= 1")
    else:
        args.grad_accum = int(args.grad_accum)
    if args.hf_baseline and (args.world_size != 1 or args.launcher):
        parser.error("--hf-baseline compares one device: use it without --launcher and with --world-size 1")
    if args.num_workers is None:
        import torch

        args.num_workers = 2 if torch.cuda.is_available() else 0
    elif args.num_workers < 0:
        parser.error("--num-workers must be >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        shards = resolve_shards(args, out)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    work = Path(args.work_dir) if args.work_dir else out / "work"
    rows = []
    all_cases = list(cases(args))
    for i, case in enumerate(all_cases, 1):
        print(f"[{i}/{len(all_cases)}] {case.label}", flush=True)
        rows.append(run_case(case, shards[case.seq_len], work, args))
    add_overhead_ratios(rows)
    ratio_lines = add_hf_ratios(rows)
    arch_lines = add_arch_ratios(rows)
    for row in rows:
        family = "" if row["arch"] == "bert" else f"{row['arch']}:"
        row["config"] = f"{family}{row['objective']}/{row['preset']}/L{row['seq_len']}/z{row['zero']}/{row['precision']}"
    data = {s: str(d) for s, d in shards.items()}
    notes = [f"{args.warmup} warm-up steps, then {args.steps} measured steps per configuration; step time = median; "
             f"{args.grad_accum} micro-batches per optimizer step",
             f"objective options: {args.options}; data: {'given shards' if args.shards else 'synthetic shards'} {data}",
             "overhead_vs_mlm = step time / MLM's step time (same family, size, length, ZeRO stage, precision, batch; "
             "measured in this run)", MFU_FORMULA]
    if len(args.archs) > 1:
        notes.append("tokens_vs_bert / mfu_vs_bert = tokens/s / MFU of a ModernBERT row over the BERT row of the same "
                     "shape (layers, hidden, heads: bert_partner_size), objective, length, ZeRO stage, precision and "
                     "micro-batch, measured in this run; none where no such BERT row ran")
        notes += arch_lines
    if args.hf_baseline:
        notes.append(f"{HF_ROW}: transformers.BertForMaskedLM (SDPA attention, fused AdamW, autocast for bf16/fp16, "
                     "plain torch loop, one device, no ZeRO) on the same shards and micro-batches; vs_hf_bert = "
                     "tokens/s / its tokens/s")
        notes += ratio_lines
    print(MFU_FORMULA)
    for line in ratio_lines + arch_lines:
        print(line)
    paths = write_report(args.name, rows, out, "Pretraining throughput per objective", bar=("config", "tokens_per_s"),
                         notes=notes, extra={"args": vars(args)})
    ok = [r for r in rows if r.get("error") is None]
    bar_chart(ok, "config", "overhead_vs_mlm", out / f"{args.name}_overhead.png", "Step time relative to MLM")
    if any(r.get("mfu") is not None for r in ok):
        bar_chart(ok, "config", "mfu", out / f"{args.name}_mfu.png", "Model FLOPs utilisation")
    if not args.keep_runs:
        shutil.rmtree(work / "runs", ignore_errors=True)
    print(f"wrote {paths['json']}, {paths['md']}, {paths.get('png')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
