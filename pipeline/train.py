"""`python -m pipeline.train --config PRESET_OR_YAML [section.key=value ...]`: the pretraining loop.

One file, top to bottom: config -> validation (before any compute) -> ranks -> data -> model ->
DeepSpeed engine -> resume -> steps -> metrics -> checkpoints. The same code runs with no launcher
(one process), under `torchrun`, the `deepspeed` launcher, `srun` or `mpirun`
(`pipeline.distributed.discover` reads the environment; `--mpi` asks mpi4py when the MPI
implementation exports nothing we know).

A step = `grad_accum` micro-batches, each `engine(batch) -> engine.backward -> engine.step`
(DeepSpeed averages the gradients over micro-batches and ranks and updates at the boundary). The
learning rate is set from the step number before every step (`pipeline.optim.lr_at`), and torch's
generators are reseeded from (seed, step, rank), so a resumed run repeats the uninterrupted one
bit for bit.

Exit codes: 0 done; 2 bad config or unusable checkpoint (message on stderr, before compute);
3 stopped by the non-finite loss guard; 75 (`REQUEUE_EXIT_CODE`) checkpointed after SIGTERM/SIGUSR1.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import random
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import yaml

from pipeline.checkpoint import (
    CHECKPOINT_DIR,
    REQUEUE_EXIT_CODE,
    CheckpointError,
    PreemptionHandler,
    ResumeTarget,
    TrainState,
    find_resume_checkpoint,
    load_checkpoint,
    plan_resume,
    save_checkpoint,
)
from pipeline.config import (
    ConfigError,
    RunConfig,
    RunPlan,
    build_deepspeed_config,
    check_run,
    config_hash,
    describe_config,
    load_config,
)
from pipeline.metrics import FlopCounter, MetricsWriter, ThroughputMeter, device_peak_flops, peak_memory_gb
from pipeline.optim import build_optimizer, lr_at, resolve_impl, set_lr, use_apex_layernorm
from pipeline.run_meta import RunMeta

log = logging.getLogger("pipeline.train")
EXIT_CONFIG_ERROR = 2
EXIT_NONFINITE = 3


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="preset name in pipeline/configs/ (e.g. taco-small) or a YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.total_steps=1000 data.shards_dir=DIR")
    parser.add_argument("--check", action="store_true", help="validate config, data and checkpoint, then exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--help-config", action="store_true", help="list every config field with its documentation")
    parser.add_argument("--mpi", action="store_true", help="take rank / world size from mpi4py")
    args = parser.parse_args(argv)
    if not args.config and not args.help_config:
        parser.error("--config is required")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.help_config:
        print(describe_config())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            return 0
        if args.mpi:
            export_mpi4py_ranks()
        return train(cfg, check_only=args.check)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NONFINITE


def export_mpi4py_ranks() -> None:
    """`--mpi`: rank / world size / local rank from mpi4py, exported as torch's env variables, with
    rank 0's host and a free port as the rendezvous (`pipeline.distributed`'s MPI rendezvous)."""
    from mpi4py import MPI

    from pipeline.distributed import _mpi_rendezvous

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), LOCAL_RANK=str(local))
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        addr, port = _mpi_rendezvous()  # collective: every rank calls it
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", port)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed torch (CPU + CUDA), numpy and random from (seed, step, rank): dropout of step `step`
    is a pure function of these, so no RNG state has to be checkpointed."""
    digest = hashlib.blake2b(f"dropout:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    torch.manual_seed(value)
    np.random.seed(value % 2**32)
    random.seed(value)


def build_model(cfg: RunConfig, plan: RunPlan):
    """PretrainModel with shapes from the preset + overrides and vocabulary/length from the shards."""
    from pipeline.model import build_encoder_config
    from pipeline.pretrainer import PretrainModel

    overrides = {k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "num_heads", "ffn_size")
                 if getattr(cfg.model, k) is not None}
    try:
        encoder_config = build_encoder_config(
            cfg.model.size, **overrides, vocab_size=plan.manifest.vocab_size,
            max_position=cfg.model.max_position or plan.manifest.seq_len, dropout=cfg.model.dropout,
            attention_dropout=cfg.model.attention_dropout, pad_token_id=plan.manifest.special_tokens["pad"])
        return PretrainModel(encoder_config, cfg.objectives, plan.manifest.special_tokens, cfg.objective_options,
                             seed=cfg.train.seed, kernels=cfg.model.kernels)
    except ValueError as err:  # objective / encoder constructors validate their options
        raise ConfigError(str(err)) from err


def train(cfg: RunConfig, check_only: bool = False) -> int:
    """Run (or, with `check_only`, just validate) the training described by `cfg`; returns the exit code."""
    from pipeline.distributed import discover

    # ---- 1. everything that can be checked before compute ------------------------------------
    world = discover()
    cuda = torch.cuda.is_available()
    plan = check_run(cfg, world.world_size, cuda)
    cfg.train.output_dir = cfg.train.output_dir or str(Path("runs") / cfg.name)
    output_dir = Path(cfg.train.output_dir)
    ckpt_root = output_dir / CHECKPOINT_DIR
    config_dict = cfg.to_dict()
    resume_dir = find_resume_checkpoint(cfg.train.resume, ckpt_root)
    target: Optional[ResumeTarget] = None
    if resume_dir is not None:
        target = plan_resume(resume_dir, config_dict, plan.manifest_hash, world.world_size, plan.zero_stage,
                             cfg.train.allow_config_change)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank, for any world size
    model = build_model(cfg, plan)  # objective constructors validate their options: fail before compute
    if check_only:
        print(f"ok: {cfg.name}: {plan.batch}, ZeRO {plan.zero_stage}, "
              f"{'resume from ' + str(resume_dir) if resume_dir else 'fresh start'}")
        return 0
    # The signal handler goes in before any slow start-up work, so a preemption signal that arrives
    # while ranks rendezvous or the engine builds still ends in a checkpoint and the requeue code.
    with torch_process_state(cfg.train.deterministic), PreemptionHandler() as preemption:
        return run_training(cfg, plan, model, target, config_dict, preemption)


@contextlib.contextmanager
def torch_process_state(deterministic: bool) -> Iterator[None]:
    """Process-wide torch settings of one run, restored afterwards (so runs can follow each other in
    one process, as in tests): `train.deterministic` (torch's deterministic kernels), and
    `torch.nn.functional.linear`, which DeepSpeed's ZeRO-3 replaces process-wide by its
    memory-efficient version ("persists unless manually reset")."""
    import torch.utils.deterministic

    linear = torch.nn.functional.linear
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for deterministic matmuls
        torch.use_deterministic_algorithms(True, warn_only=True)
        # NaN-filling every new tensor is a debugging aid, not needed for determinism, and costs
        # a page-touching pass over every allocation (DeepSpeed's flat buffers included).
        torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = previous[2]
        torch.nn.functional.linear = linear


def run_training(cfg: RunConfig, plan: RunPlan, model, target: Optional[ResumeTarget], config_dict: dict,
                 preemption: PreemptionHandler) -> int:
    """Phases 2-3 of `train`: ranks, engine, resume, the loop. Returns the exit code."""
    import deepspeed

    from pipeline.corruption import CorruptionCollator
    from pipeline.data import PretrainBatches, ShardDataset
    from pipeline.distributed import init_distributed

    output_dir = Path(cfg.train.output_dir)
    ckpt_root = output_dir / CHECKPOINT_DIR
    cuda = torch.cuda.is_available()

    # ---- 2. ranks, data, model, engine --------------------------------------------------------
    info = init_distributed()
    is_main = info.is_main
    if not is_main:
        logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dataset = ShardDataset(cfg.data.shards_dir)

    if cfg.model.layernorm == "apex":
        log.info("apex FusedLayerNorm replaced %d LayerNorms", use_apex_layernorm(model))
    flop_counter = FlopCounter(model)
    offload = plan.engine.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    optimizer = build_optimizer(model, cfg.optim, device.type, offload)
    ds_config = build_deepspeed_config(cfg, plan, load_universal=bool(target and target.universal))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    state = TrainState()
    if target is not None:
        state = load_checkpoint(engine, target, is_main)
        model.load_extra_state_from_checkpoint(state.objective_state)
        log.info("resumed from %s at step %d (%d samples)", target.tag_dir, state.step, state.consumed_samples)

    collator = CorruptionCollator(model.views, dataset.special_tokens, dataset.vocab_size, cfg.train.seed,
                                  **cfg.data.corruption)
    batches = PretrainBatches(dataset, collator, plan.batch.micro_batch_size, plan.batch.grad_accum, info.rank,
                              info.world_size, cfg.train.seed, consumed_samples=state.consumed_samples,
                              num_workers=cfg.data.num_workers)
    writer = MetricsWriter(output_dir, is_main, state.step, cfg.train.tensorboard)
    meter = ThroughputMeter(info.world_size, device_peak_flops(cfg.deepspeed.precision))
    meta = RunMeta(
        encoder_config=model.config.to_dict(), objectives=dict(cfg.objectives),
        objective_options=dict(cfg.objective_options), special_tokens=dict(dataset.special_tokens),
        tokenizer_dir=str(dataset.tokenizer_dir.resolve()), data_dir=str(Path(cfg.data.shards_dir).resolve()),
        manifest_hash=plan.manifest_hash, config_hash=config_hash(config_dict), config=config_dict,
        zero_stage=plan.zero_stage, world_size=info.world_size)
    if is_main:
        log.info("%s: %s, ZeRO %d, %s, optimizer %s, %d parameters", cfg.name, plan.batch, plan.zero_stage,
                 cfg.deepspeed.precision, resolve_impl(cfg.optim, device.type, offload),
                 sum(p.numel() for p in model.parameters()))

    def checkpoint(last_metrics: dict) -> None:
        state.objective_state = model.extra_state_for_checkpoint()
        meta.step, meta.consumed_samples, meta.tokens_seen = state.step, state.consumed_samples, state.tokens_seen
        meta.last_metrics = {k: v for k, v in last_metrics.items() if isinstance(v, (int, float))}
        save_checkpoint(engine, ckpt_root, state, meta, cfg.train.keep_last, is_main)

    # ---- 3. the loop ------------------------------------------------------------------------------
    from tqdm.auto import tqdm

    total, accum = cfg.train.total_steps, plan.batch.grad_accum
    last_metrics: dict = {}
    bar = tqdm(total=total, initial=state.step, disable=not (is_main and cfg.train.progress_bar), desc=cfg.name,
               dynamic_ncols=True, mininterval=1.0)
    try:
        while state.step < total:
            step = state.step + 1
            model.set_progress(step, total)
            reseed(cfg.train.seed, step, info.rank)
            lr = lr_at(step, cfg.optim, total)
            set_lr(optimizer, lr)

            sums, nonfinite_local, tokens_local = forward_backward(engine, batches, accum, device)

            # One small all-reduce per step: guard flags, preemption, tokens and FLOPs of all ranks.
            status = torch.stack([nonfinite_local, *(torch.tensor(float(v), dtype=torch.float64, device=device)
                                 for v in (preemption.requested, tokens_local, flop_counter.pop()))])
            if dist.is_initialized() and info.world_size > 1:
                dist.all_reduce(status)
            nonfinite, preempted, tokens, flops = status.tolist()
            applied = engine.was_step_applied()
            if nonfinite and applied:
                raise NonFiniteLossError(f"step {step}: the loss is not finite but DeepSpeed applied the update; "
                                         "this DeepSpeed version does not skip non-finite steps")
            state.step, state.consumed_samples = step, batches.consumed_samples
            state.tokens_seen += int(tokens)
            state.skipped_steps += int(not applied)
            bad = nonfinite > 0 or (not applied and cfg.deepspeed.precision != "fp16")  # fp16: overflow is routine
            state.nonfinite_steps += int(bad)
            state.nonfinite_in_row = state.nonfinite_in_row + 1 if bad else 0
            meter.add_step(plan.batch.global_batch_size, int(tokens), flops)
            bar.update(1)

            if step % cfg.train.log_every == 0 or step == total or bad:
                last_metrics = gather_metrics(sums, accum * info.world_size, device)
                grad_norm = engine.get_global_grad_norm()
                last_metrics.update(
                    lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                    consumed_samples=state.consumed_samples, tokens_seen=state.tokens_seen,
                    skipped_steps=state.skipped_steps, nonfinite_steps=state.nonfinite_steps,
                    **meter.report(), **peak_memory_gb())
                if cfg.deepspeed.precision == "fp16":
                    last_metrics["loss_scale"] = float(getattr(engine.optimizer, "loss_scale", float("nan")))
                writer.write(step, last_metrics)
                bar.set_postfix(loss=f"{last_metrics.get('loss', float('nan')):.4f}", lr=f"{lr:.2e}")
                if is_main and not cfg.train.progress_bar:
                    log.info("step %d/%d loss %.4f lr %.3e %.0f tok/s", step, total,
                             last_metrics.get("loss", float("nan")), lr, last_metrics["tokens_per_s"])
            if state.nonfinite_in_row >= cfg.train.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"{state.nonfinite_in_row} consecutive steps (up to step {step}) had a non-finite loss or "
                    f"gradients and were skipped (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); "
                    "lower optim.lr, raise optim.warmup_steps, or use fp32/bf16, then resume from the last "
                    "checkpoint")
            if step % cfg.train.checkpoint_every == 0 or step == total or preempted:
                checkpoint(last_metrics)
                meter.reset()  # keep the save time out of the throughput numbers
            if preempted:
                log.info("preempted (%s): checkpoint at step %d written; exiting with %d",
                         preemption.signal_name or "signal on another rank", step, REQUEUE_EXIT_CODE)
                return REQUEUE_EXIT_CODE
    finally:
        bar.close()
        writer.close()
        flop_counter.remove()
    return 0


def forward_backward(engine, batches, accum: int, device: torch.device) -> tuple[dict, torch.Tensor, int]:
    """One optimizer step: `accum` micro-batches of forward, backward and `engine.step()` (DeepSpeed
    scales each loss by 1/accum, averages over ranks, and updates — or skips an update whose gradients
    are not finite — at the boundary). Returns (summed metrics, count of non-finite losses, non-pad tokens)."""
    sums: dict[str, torch.Tensor] = {}
    nonfinite = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for _ in range(accum):
        batch = next(batches)
        tokens += int(batch["attention_mask"].sum())
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss, parts = engine(batch)
        nonfinite += (~torch.isfinite(loss.detach())).double()
        engine.backward(loss)
        engine.step()
        for key, value in parts.items():
            sums[key] = sums.get(key, 0.0) + value.detach().float()
    return sums, nonfinite, tokens


def gather_metrics(sums: dict[str, torch.Tensor], count: int, device: torch.device) -> dict[str, float]:
    """Mean of each metric over the step's micro-batches and ranks (one all-reduce)."""
    keys = sorted(sums)
    if not keys:
        return {}
    values = torch.stack([sums[k].to(device) for k in keys]).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return {k: v / count for k, v in zip(keys, values.tolist())}


if __name__ == "__main__":
    sys.exit(main())
