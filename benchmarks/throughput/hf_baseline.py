"""The `hf-bert` row of `bench_throughput.py --hf-baseline`: `transformers.BertForMaskedLM` in a plain torch loop.

    python benchmarks/throughput/hf_baseline.py --shards DIR --size large --seq-len 128 --micro-batch 256 \\
        --precision bf16 --steps 10 --warmup 3 --out RUN_DIR

Same model shape (`model.size` preset, the shards' vocabulary and length), same data (our reader
and BERT masking collator over the same shards, the same micro-batches in the same order), same
precision and micro-batch as the pipeline's rows, and what a careful plain-torch user would write:
SDPA attention (`attn_implementation="sdpa"`), `torch.optim.AdamW(fused=True)` on a GPU, bf16 /
fp16 by autocast over fp32 weights (fp16 with a `GradScaler`), pinned batches copied without
blocking, `zero_grad(set_to_none=True)`. Nothing else is tuned: Hugging Face's head projects every
token onto the vocabulary, as `BertForMaskedLM` does.

Output: `RUN_DIR/metrics.jsonl`, one record per step in the training loop's format (`step_time_s`,
`tokens_per_s`, `samples_per_s`, `tflops_per_device`, `mfu` on a known GPU, peak memory), so
`bench_throughput.summarize_records` reads it like a pipeline run. FLOPs per step are
`pipeline.train.metrics.mlm_step_flops` — the useful work of the same model (head on the predicted
rows only), the formula our FLOP counter applies to our MLM runs — so MFU compares like with like.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

if __package__ in (None, ""):  # run as a script: make `pipeline` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.train.engine import PRECISIONS  # noqa: E402

ROW_NAME = "hf-bert"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf_baseline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", required=True, help="shard directory (the one the pipeline's rows read)")
    p.add_argument("--size", default="tiny", help="model size preset (pipeline.model.encoder.SIZE_PRESETS)")
    p.add_argument("--seq-len", type=int, required=True, help="must equal the shards' seq_len")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before them (allocator, cuBLAS heuristics)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), help="AdamW betas (the preset's optim.betas)")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW eps (the preset's optim.eps)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (the preset's)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (the run's grad_accum)")
    p.add_argument("--seed", type=int, default=0, help="data order and masking seed (the pipeline's train.seed)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader collation workers")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl is written there")
    return p


def precision_context(precision: str, device: torch.device):
    """Autocast for bf16 / fp16 (fp32 weights and optimizer, as `transformers.Trainer` does); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def fused_adamw(params, lr: float, device: torch.device, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """torch's fused AdamW (one kernel for all parameters); the for-each version where fused is unsupported."""
    params = list(params)
    hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    try:
        return torch.optim.AdamW(params, **hyper, fused=True)
    except (RuntimeError, TypeError) as err:
        if device.type == "cuda":
            raise
        print(f"note: fused AdamW unavailable on {device.type} ({err}); using the for-each version", file=sys.stderr)
        return torch.optim.AdamW(params, **hyper, foreach=True)


def run(args: argparse.Namespace) -> list[dict]:
    return run_steps(args)[0]


def run_steps(args: argparse.Namespace, profile_steps: int = 0) -> tuple[list[dict], Optional[dict]]:
    """The timed steps' records and, with `profile_steps`, the breakdown of that many more steps run
    under the profiler after them (`benchmarks.common.breakdown`; None without)."""
    from transformers import BertForMaskedLM

    from benchmarks.common.breakdown import profile_window

    from pipeline.data.batch import move_batch
    from pipeline.data.config import BatchPlan
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import PretrainBatches, ShardDataset
    from pipeline.export.hf_adapter import bert_config
    from pipeline.model.config import ModelConfig
    from pipeline.train.metrics import MetricsWriter, device_peak_flops, mlm_step_flops, peak_memory_gb

    dataset = ShardDataset(args.shards)
    if dataset.seq_len != args.seq_len:
        raise ValueError(f"--seq-len {args.seq_len}: the shards in {args.shards} have seq_len {dataset.seq_len}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    encoder = ModelConfig(size=args.size).encoder_config(dataset.vocab_size, dataset.seq_len, dataset.special_tokens)
    torch.manual_seed(args.seed)
    model = BertForMaskedLM._from_config(bert_config(encoder, dataset.special_tokens), attn_implementation="sdpa")
    model.to(device).train()
    accum = getattr(args, "grad_accum", 1)
    optimizer = fused_adamw(model.parameters(), args.lr, device, getattr(args, "betas", (0.9, 0.999)),
                            getattr(args, "eps", 1e-8), getattr(args, "weight_decay", 0.01))
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    collator = CorruptionCollator(("masked",), dataset.special_tokens, dataset.vocab_size, args.seed)
    batches = PretrainBatches(dataset, collator, BatchPlan(args.micro_batch, accum, 1), 0, args.seed,
                              num_workers=args.num_workers, pin_memory=cuda)
    peak = device_peak_flops(args.precision)
    writer = MetricsWriter(args.out, enabled=True, resume_step=0, tensorboard=False)
    records = []

    def one_step() -> tuple[int, int, torch.Tensor]:
        """One optimizer step (`accum` micro-batches), synchronized: (tokens, predicted rows, last loss)."""
        tokens = predicted = 0
        for _ in range(accum):  # gradients summed over the micro-batches, each loss scaled by 1/accum
            batch = next(batches)
            tokens += int(batch["attention_mask"].sum())  # host tensors: no device sync
            predicted += int(batch["mlm_positions"].numel())
            batch = move_batch(batch, device)
            with precision_context(args.precision, device):
                loss = model(input_ids=batch["masked_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["mlm_labels"]).loss
            (scaler.scale(loss / accum) if scaler is not None else loss / accum).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return tokens, predicted, loss

    breakdown = None
    try:
        for step in range(1, args.warmup + args.steps + 1):
            started = time.perf_counter()
            tokens, predicted, loss = one_step()
            elapsed = time.perf_counter() - started
            flops = mlm_step_flops(args.micro_batch * accum, args.seq_len, encoder.hidden_size, encoder.ffn_size,
                                   encoder.num_layers, predicted, encoder.vocab_size)
            record = {"loss": float(loss.detach()), "step_time_s": elapsed, "tokens_per_s": tokens / elapsed,
                      "samples_per_s": args.micro_batch * accum / elapsed, "tflops_per_device": flops / elapsed / 1e12,
                      **peak_memory_gb()}
            if peak:
                record["mfu"] = flops / elapsed / peak
            writer.write(step, record)
            records.append({"step": step, **record})
        if profile_steps:
            breakdown = profile_window(one_step, profile_steps, cuda)
    finally:
        writer.close()
    return records, breakdown


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.micro_batch < 1:
        print("error: --steps >= 1, --warmup >= 0 and --micro-batch >= 1 required", file=sys.stderr)
        return 2
    try:
        records = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    last = records[-1]
    print(json.dumps({"row": ROW_NAME, "steps": len(records), "tokens_per_s": last["tokens_per_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
