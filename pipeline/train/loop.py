"""`python -m pipeline.train --config PRESET_OR_YAML [section.key=value ...]`: the pretraining loop.

Read top to bottom: `main` parses, `train` validates everything it can before compute and builds
the model, `start` brings up ranks, engine, resume and data, and `run` is the loop. The same code
runs with no launcher (one process), under `torchrun`, the `deepspeed` launcher, `srun` or
`mpirun` (`pipeline.distributed.discover` reads the environment; `--mpi` asks mpi4py when the MPI
implementation exports nothing we know). `--resume DIR [overrides]` continues a run from the
configuration saved in its checkpoint (`pipeline.train.resume_run`: extending `train.total_steps`,
with the learning-rate schedule re-stretched to the new total).

A step = `grad_accum` micro-batches, each `engine(batch) -> engine.backward -> engine.step`
(DeepSpeed averages the gradients over micro-batches and ranks and updates at the boundary). The
learning rate is set from the step number before every step (`pipeline.train.optim.lr_at`), and
every random number comes from a stream of `pipeline.seeding`, so a resumed run repeats the
uninterrupted one bit for bit.

Exit codes (docs/guarantees.md): 0 done; 2 bad config, data or unusable checkpoint (message on
stderr, before compute); 3 stopped by the non-finite / divergence guard (no checkpoint of
non-finite or exploded weights is written; the message names the last good one); 4 the run's
output cannot be written (disk full, quota, I/O error at any save, the first included: the
previous checkpoint stays `latest`; or, before compute, `train.output_dir` is a file, read-only or
not creatable); 5 another rank died or hung (the message names it; a dead rank is noticed at the next
collective, a hung one after `train.dist_timeout_s`);
75 (`REQUEUE_EXIT_CODE`) SIGTERM/SIGUSR1: checkpointed for requeue (or, during start-up, nothing
new to save). Signals: `pipeline.train.preemption`.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import yaml

from pipeline import seeding
from pipeline.batch import move_batch
from pipeline.config.checks import ConfigError
from pipeline.config.run import (
    RunConfig,
    RunPlan,
    check_run,
    config_hash,
    describe_recipe,
    describe_run_config,
    load_config,
)
from pipeline.distributed import DistInfo, all_reduce_sum
from pipeline.eval.health import CollapseMonitor, unigram_counts
from pipeline.eval.signals import format_signals, learning_signals
from pipeline.model.build import build_pretrain_model
from pipeline.model.pretrainer import PretrainModel
from pipeline.objectives.base import SAMPLED_SOFTMAX, StepProgress
from pipeline.objectives.registry import mlm_head_training
from pipeline.train.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    CheckpointFinisher,
    CheckpointWriteError,
    ResumeTarget,
    TrainState,
    check_resume_shapes,
    find_resume_checkpoint,
    last_good_tag,
    load_checkpoint,
    newer_tags,
    plan_resume,
    save_checkpoint,
    settle_pending_save,
)
from pipeline.train.checkpoint_writes import check_output_dir
from pipeline.train import exit_record
from pipeline.train.engine import build_deepspeed_config, optimizer_offloaded, restore_tf32, set_tf32
from pipeline.train.guard import NonFiniteGuard, NonFiniteLossError, weight_stats
from pipeline.train.metrics import FlopCounter, MetricsWriter, ThroughputMeter, device_peak_flops, peak_memory_gb
from pipeline.train.optim import build_optimizer, lr_at, resolve_impl, set_lr, use_apex_layernorm
from pipeline.train.phases import before_step
from pipeline.train.preemption import REQUEUE_EXIT_CODE, PreemptionHandler, preemption_scope
from pipeline.train.run_lock import hold_run_dir, released_at_exit
from pipeline.train.run_meta import RunMeta, corpus_summary

log = logging.getLogger("pipeline.train")
EXIT_CONFIG_ERROR = 2
EXIT_NONFINITE = 3
EXIT_SAVE_FAILED = 4
EXIT_RANK_LOST = 5


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="preset name in pipeline/config/presets/ (e.g. taco-small) or a YAML file")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue a run from its saved configuration (DIR: its output directory, checkpoints/ "
                             "or a tag); overrides change it, e.g. train.total_steps=N extends it "
                             "(pipeline.train.resume_run)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.total_steps=1000 data.shards_dir=DIR")
    parser.add_argument("--check", action="store_true", help="validate config, data and checkpoint, then exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--help-config", action="store_true", help="list every config field with its documentation")
    parser.add_argument("--mpi", action="store_true", help="take rank / world size from mpi4py")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="with --check: validate for N ranks instead of this launch's (slurm/submit.sh passes the job's)")
    parser.add_argument("--gpus", action="store_true",
                        help="with --check: validate as on a GPU node (bf16/fp16, triton, offload) from a machine without one")
    # The `deepspeed` launcher passes --local_rank=N (also exported as LOCAL_RANK); older torch
    # launchers pass --local-rank. The rank itself comes from the environment (pipeline.distributed).
    parser.add_argument("--local_rank", "--local-rank", type=int, metavar="N",
                        help="set by the deepspeed launcher; the same as LOCAL_RANK=N")
    args = parser.parse_args(argv)
    if args.resume and args.config:
        parser.error("--resume DIR takes the run's saved config: pass changes as overrides, not --config")
    if not args.config and not args.resume and not args.help_config:
        parser.error("--config (or --resume DIR) is required")
    if args.local_rank is not None:
        env = os.environ.get("LOCAL_RANK")
        if env is not None and env != str(args.local_rank):
            parser.error(f"--local_rank={args.local_rank} but LOCAL_RANK={env}: the launcher disagrees with itself")
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    if (args.world_size is not None or args.gpus) and not args.check:
        parser.error("--world-size and --gpus only go with --check")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.help_config:
        print(describe_run_config())
        return 0
    cfg: Optional[RunConfig] = None
    try:
        if args.resume:
            from pipeline.train.resume_run import load_resumed_config

            cfg, recipe = load_resumed_config(args.resume, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
            recipe = describe_recipe(args.config, cfg)
        if args.print_config:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            return 0
        if args.mpi:
            export_mpi4py_ranks()
        return train(cfg, check_only=args.check, recipe=recipe,
                     check_world_size=args.world_size, check_gpus=args.gpus)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except CheckpointWriteError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_SAVE_FAILED
    except RuntimeError as err:  # a dead or hung rank: one line naming it, not gloo's traceback
        from pipeline.distributed import lost_ranks_message

        message = lost_ranks_message(err, cfg.train.dist_timeout_s) if cfg is not None else ""
        if not message:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_RANK_LOST


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


def build_run_model(cfg: RunConfig, plan: RunPlan, warm_start: bool = True) -> PretrainModel:
    """The run's `PretrainModel`: shape from the config and the shards, initialised from the run seed
    (and, `warm_start`, i.e. not resuming, with `model.mlm_bias_init=unigram`, the output biases from
    the shards' token frequencies), then (`warm_start`) from `model.init_from`'s weights when set.

    The shards' token counts (a bounded row sample, `unigram_counts`) are read here when either the
    output biases or an NCE objective's log q (`log_proposal`, `pipeline.objectives.mlm_nce`) need
    them, without the hash check: this runs before the process group exists, and `start` checks every
    shard's bytes (`open_dataset`, a clear error on every rank) before any step. log q is filled on a
    resume too: the
    checkpoint's value then replaces it (persistent buffer). Where the checkpoint gives none (a run from
    before the buffer, or DeepSpeed's universal loading, which restores parameters only) it stays the
    value computed here: the one the run started with, as long as the shards are the same (a changed
    manifest needs `train.allow_config_change=true`)."""
    manifest = plan.manifest
    encoder_config = cfg.model.encoder_config(manifest.vocab_size, manifest.seq_len, manifest.special_tokens)
    bias_init = cfg.model.mlm_bias_init if warm_start else "zero"  # a resume loads its biases
    counts = None
    if bias_init == "unigram" or SAMPLED_SOFTMAX in mlm_head_training(cfg.objectives).values():
        from pipeline.data.mixture import open_run_data

        counts = unigram_counts(open_run_data(cfg.data, cfg.train.total_steps * plan.batch.global_batch_size, check=False))
    return build_pretrain_model(encoder_config, cfg.objectives, manifest.special_tokens, cfg.objective_options,
                                seed=cfg.train.seed, kernels=cfg.model.kernels,
                                init_from=cfg.model.init_from if warm_start else None,
                                attention=cfg.model.attention, compile_layers=cfg.model.compile, unigram_counts=counts,
                                mlm_bias_init=bias_init)


def train(cfg: RunConfig, check_only: bool = False, recipe: Optional[dict] = None,
          check_world_size: Optional[int] = None, check_gpus: bool = False) -> int:
    """Run (or, with `check_only`, just validate) the training described by `cfg`; returns the exit code.
    `recipe` (`describe_recipe`: preset and overrides) is recorded in the checkpoints for the model card;
    `check_world_size` / `check_gpus`: validate for that many ranks / as on a GPU node (`--check` only)."""
    # a signal from here on is a flag (pipeline.train.preemption); the run directory's lock ends with the run
    with preemption_scope() as preemption, released_at_exit():
        return _train(cfg, check_only, preemption, recipe, check_world_size, check_gpus)


def _train(cfg: RunConfig, check_only: bool, preemption: PreemptionHandler, recipe: Optional[dict] = None,
           check_world_size: Optional[int] = None, check_gpus: bool = False) -> int:
    from pipeline.capabilities import use_private_extensions_dir
    from pipeline.distributed import discover

    # ---- 1. everything that can be checked before compute ------------------------------------
    use_private_extensions_dir()
    world = discover()
    world_size = check_world_size or world.world_size
    cfg.train.output_dir = cfg.train.output_dir or str(Path("runs") / cfg.name)
    ckpt_root = Path(cfg.train.output_dir) / CHECKPOINT_DIR
    resume_dir = find_resume_checkpoint(cfg.train.resume, ckpt_root)
    # A resumed run takes its weights from the checkpoint: model.init_from's weights are neither
    # checked nor read then (its config.json still gives the shape).
    plan = check_run(cfg, world_size, torch.cuda.is_available() or check_gpus, fresh_start=resume_dir is None)
    config_dict = cfg.to_dict()
    target = None
    if resume_dir is not None:
        from pipeline.data.shards import manifest_file_sha256

        data_hash, data_dir = plan.manifest_hash, cfg.data.shards_dir
        if plan.schedule is not None:  # the data of the checkpoint's own phase
            data_hash, data_dir = plan.schedule.data_identity(resume_dir, data_hash, data_dir)
        target = plan_resume(resume_dir, config_dict, data_hash, world_size, plan.zero_stage,
                             cfg.train.allow_config_change, manifest_file_sha256(data_dir) if data_dir else "")
        if cfg.train.resume not in ("auto", "never"):  # an explicit tag: this run's newer ones are set aside
            target.set_aside = newer_tags(ckpt_root, resume_dir)
    if not check_only:  # a file, read-only or full location: one line and exit 4 now, not at the first save
        check_output_dir(Path(cfg.train.output_dir), world.rank)
        hold_run_dir(cfg.train.output_dir, world.rank)  # one writer per run directory (exit 2 naming the holder)
        exit_record.begin(Path(cfg.train.output_dir), world.rank == 0, name=cfg.name,  # run_state.json (cpt-status)
                          total_steps=cfg.train.total_steps)
    # identical initial weights on every rank, for any world size
    run_cfg, run_plan = cfg, plan
    if plan.schedule is not None:  # the phase of the next step: its data, seed and batch (pipeline.train.phases)
        run_cfg, run_plan = plan.schedule.start_view(plan, target.meta.step if target is not None else 0)
    model = build_run_model(plan.schedule.run_config(plan.schedule.phases[0]) if plan.schedule else cfg, plan,
                            warm_start=target is None)
    if target is not None:
        check_resume_shapes(target, model)
    if check_only:
        start_from = f"warm start from {cfg.model.init_from}" if cfg.model.init_from else "fresh start"
        newer = f" (newer tags to set aside: {[p.name for p in target.set_aside]})" if target and target.set_aside else ""
        print(f"ok: {cfg.name}: {plan.batch}, ZeRO {plan.zero_stage}, "
              f"{'resume from ' + str(resume_dir) if resume_dir else start_from}{newer}")
        return 0
    with torch_process_state(cfg.train.deterministic, cfg.deepspeed.tf32):
        run = start(run_cfg, run_plan, model, target, config_dict, recipe)
        return run.loop(preemption)


@contextlib.contextmanager
def torch_process_state(deterministic: bool, tf32: bool = True) -> Iterator[None]:
    """Process-wide torch settings of one run, restored afterwards (so runs can follow each other in
    one process, as in tests): `train.deterministic` (torch's deterministic kernels), `deepspeed.tf32`
    (`pipeline.train.engine.set_tf32`), and
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
    tf32_before = set_tf32(tf32)
    try:
        yield
    finally:
        restore_tf32(tf32_before)
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = previous[2]
        torch.nn.functional.linear = linear


def start(cfg: RunConfig, plan: RunPlan, model: PretrainModel, target: Optional[ResumeTarget],
          config_dict: dict, recipe: Optional[dict] = None) -> "Run":
    """Phase 2: ranks, engine, resume, data and metrics — everything the loop needs."""
    import deepspeed

    from pipeline.distributed import init_distributed
    from pipeline.model.warm_start import describe_base

    info = init_distributed(timeout_s=cfg.train.dist_timeout_s)
    if not info.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dataset = open_data(cfg, plan, model)

    if cfg.model.layernorm == "apex":
        log.info("apex FusedLayerNorm replaced %d LayerNorms", use_apex_layernorm(model))
    flop_counter = FlopCounter(model)
    offload = optimizer_offloaded(plan.engine)
    optimizer = build_optimizer(model, cfg.optim, device.type, offload)
    ds_config = build_deepspeed_config(plan.engine, plan.batch, cfg.deepspeed.precision, cfg.optim.grad_clip,
                                       load_universal=bool(target and target.universal))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    state = TrainState()
    if target is not None:
        state = load_checkpoint(engine, target, info.is_main)
        model.load_extra_state_from_checkpoint(state.objective_state)
        log.info("resumed from %s at step %d (%d samples)", target.tag_dir, state.step, state.consumed_samples)

    if plan.schedule is not None:  # a checkpoint at a phase boundary: the next phase starts here
        plan.schedule.resume_into(state, model)
    batches = open_batches(cfg, plan, model, info.rank, state.consumed_samples - state.phase_start_samples, cuda,
                           dataset)
    meta = RunMeta(
        encoder_config=model.config.to_dict(), objectives=dict(cfg.objectives),
        objective_options=dict(cfg.objective_options), special_tokens=dict(dataset.special_tokens),
        tokenizer_dir=str(dataset.tokenizer_dir.resolve()), data_dir=str(dataset.directory.resolve()),
        manifest_hash=plan.manifest_hash, config_hash=config_hash(config_dict), config=config_dict,
        zero_stage=plan.zero_stage, world_size=info.world_size, corpus=corpus_summary(plan.manifest),
        base_model=describe_base(cfg.model.init_from) if cfg.model.init_from else {}, recipe=dict(recipe or {}))
    if info.is_main:
        log.info("%s: %s, ZeRO %d, %s, optimizer %s, %d parameters", cfg.name, plan.batch, plan.zero_stage,
                 cfg.deepspeed.precision, resolve_impl(cfg.optim, device.type, offload),
                 sum(p.numel() for p in model.parameters()))
    return Run(cfg, plan, info, device, model, engine, optimizer, batches, state, meta, flop_counter,
               MetricsWriter.for_run(cfg, info.is_main, state.step, recipe),  # train.trackers
               ThroughputMeter(info.world_size, device_peak_flops(cfg.deepspeed.precision)),
               NonFiniteGuard(cfg.train.max_nonfinite_steps, cfg.deepspeed.precision == "fp16",
                              cfg.train.max_loss_ratio, cfg.train.max_weight_norm_ratio))


def build_run(cfg: RunConfig, recipe: Optional[dict] = None) -> "Run":
    """A started run of `cfg` from a fresh start, without the loop: what `train` builds before its
    first step (stage-2 checks for this launch's world size, the model, ranks, engine, data, metrics
    writer), for callers that drive `Run.train_step` themselves (benchmarks). No run directory lock,
    no resume, no exit record. Call it inside `torch_process_state(cfg.train.deterministic,
    cfg.deepspeed.tf32)`, as `train` does, and end with `run.close()`:

        with torch_process_state(cfg.train.deterministic, cfg.deepspeed.tf32):
            run = build_run(cfg)
            try:
                for step in range(1, cfg.train.total_steps + 1):
                    result = run.train_step(step, record_metrics=False)
            finally:
                run.close()
    """
    from pipeline.capabilities import use_private_extensions_dir
    from pipeline.distributed import discover

    use_private_extensions_dir()
    plan = check_run(cfg, discover().world_size, torch.cuda.is_available(), fresh_start=True)
    run_cfg, run_plan = plan.schedule.start_view(plan, 0) if plan.schedule is not None else (cfg, plan)
    model = build_run_model(plan.schedule.run_config(plan.schedule.phases[0]) if plan.schedule else cfg, plan)
    return start(run_cfg, run_plan, model, None, cfg.to_dict(), recipe)


def open_data(cfg: RunConfig, plan: RunPlan, model: PretrainModel) -> Any:
    """The run's (or phase's) dataset, every rank checking the shards' bytes (of every source of a
    mixture); sets the model's health unigram references (plateau, entropy) from a bounded row sample."""
    from pipeline.data.mixture import open_run_data

    dataset = open_run_data(cfg.data, cfg.train.total_steps * plan.batch.global_batch_size)
    model.set_health_unigram(unigram_counts(dataset))
    return dataset


def open_batches(cfg: RunConfig, plan: RunPlan, model: PretrainModel, rank: int, consumed: int, cuda: bool,
                 dataset: Any = None) -> Any:
    """This rank's micro-batch stream (`PretrainBatches`) from `consumed` samples of the run's (phase's)
    data, corrupted with `cfg.train.seed`'s streams; the one place a run's reader is built."""
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import PretrainBatches

    dataset = dataset if dataset is not None else open_data(cfg, plan, model)
    collator = CorruptionCollator(model.views, dataset.special_tokens, dataset.vocab_size, cfg.train.seed,
                                  plans=model.host_plans(), **cfg.data.corruption)
    return PretrainBatches(dataset, collator, plan.batch, rank, cfg.train.seed, consumed_samples=consumed,
                           num_workers=cfg.data.num_workers, pin_memory=cuda)


@dataclass
class StepResult:
    """What one optimizer step gave (`Run.train_step`). Every field but `sums` is all-reduced, so the
    same on every rank."""

    step: int
    lr: float  # the learning rate the step's update used
    loss: float  # mean loss over the step's micro-batches and ranks (0.0 when no objective reports "loss")
    tokens: int  # non-pad tokens of the step, all ranks
    flops: float  # model FLOPs of the step, all ranks (`FlopCounter`)
    nonfinite: int  # micro-batch losses that were not finite, all ranks
    stop_requested: bool  # some rank's `stop_requested` (a preemption signal)
    bad: bool  # non-finite loss or a dropped update (`NonFiniteGuard.observe`)
    diverged: bool  # the loss exploded against its running mean (`NonFiniteGuard.loss_diverged`)
    logged: bool  # the objectives recorded their metrics-only values (`record_metrics`)
    accum: int  # micro-batches per rank of the step (`grad_accum` of its batch split)
    sums: dict[str, torch.Tensor] = field(repr=False)  # this rank's per-metric sums over its micro-batches


@dataclass
class Run:
    """A started run: what `loop` reads and updates."""

    cfg: RunConfig
    plan: RunPlan
    info: DistInfo
    device: torch.device
    model: PretrainModel
    engine: Any
    optimizer: torch.optim.Optimizer
    batches: Any  # pipeline.data.reader.PretrainBatches
    state: TrainState
    meta: RunMeta
    flop_counter: FlopCounter
    writer: MetricsWriter
    meter: ThroughputMeter
    guard: NonFiniteGuard
    finisher: CheckpointFinisher = field(default_factory=CheckpointFinisher)  # hashes saved tags off the step
    health: CollapseMonitor = field(default_factory=lambda: CollapseMonitor(log))

    def loop(self, preemption: PreemptionHandler) -> int:
        """Phase 3: steps until `train.total_steps`, a preemption, or the guard stops the run."""
        from tqdm.auto import tqdm

        cfg, state = self.cfg, self.state
        total = cfg.train.total_steps
        bar = tqdm(total=total, initial=state.step, disable=not (self.info.is_main and cfg.train.progress_bar),
                   desc=cfg.name, dynamic_ncols=True, mininterval=1.0)
        last_metrics: dict = {}
        outcome = "failed"  # what the trackers are told at close (trackers.OUTCOMES); set on a clean way out
        try:
            if state.step < total and self.preempted_during_startup(preemption):
                outcome = "stopped"
                return REQUEUE_EXIT_CODE
            if state.step >= total and self.info.is_main:  # (below total_steps was refused at resume)
                log.info("the run is already complete at step %d (train.total_steps=%d): nothing to train; to extend "
                         "it: cpt-train --resume %s train.total_steps=N (N > %d)", state.step, total, cfg.train.output_dir, state.step)
            while state.step < total:
                result = self.train_step(state.step + 1, stop_requested=preemption.requested)
                step, lr, preempted = result.step, result.lr, result.stop_requested
                cfg = self.cfg  # (a phase's view: its data and seed)
                bar.update(1)

                if result.logged or result.bad or result.diverged:
                    last_metrics = self.log_step(step, lr, result.sums, result.accum)
                    bar.set_postfix(loss=f"{last_metrics.get('loss', float('nan')):.4f}", lr=f"{lr:.2e}")
                diverged, step_loss = result.diverged, result.loss
                if diverged:  # its weights came from step - 1's update: that checkpoint is not good either
                    raise self.guard.loss_divergence_error(state, step, step_loss, self.last_good(step - 1))
                self.guard.check(state, step)
                if step % cfg.train.checkpoint_every == 0 or step == total or preempted:
                    nonfinite_weights, norm_sq = all_reduce_sum(weight_stats(self.model, self.device,
                                                                             self.info.is_main)).tolist()
                    self.guard.check_savable(state, step, step == total, nonfinite_weights)
                    if state.nonfinite_in_row and not preempted:  # these weights just gave a non-finite loss
                        log.warning("step %d: not saving a checkpoint inside a streak of %d non-finite step(s)",
                                    step, state.nonfinite_in_row)
                    else:
                        if not state.nonfinite_in_row:  # a preemption save inside a streak judges nothing
                            self.guard.check_weight_norm(state, step, norm_sq ** 0.5, lambda: self.last_good(step))
                        self.checkpoint(last_metrics, healthy=not state.nonfinite_in_row)
                    self.meter.reset()  # keep the save time out of the throughput numbers
                if preempted and step == total:
                    log.info("%s after the last step: the run is complete (final checkpoint written); exiting 0",
                             preemption.signal_name or "preemption signal on another rank")
                elif preempted:
                    self.settle_saves()
                    log.info("preempted (%s): checkpoint at step %d written; exiting with %d",
                             preemption.signal_name or "signal on another rank", step, REQUEUE_EXIT_CODE)
                    outcome = "stopped"
                    return REQUEUE_EXIT_CODE
            self.settle_saves()  # the last checkpoint is complete (hashes, `latest`) before the run ends
            outcome = "finished"
        finally:
            bar.close()
            self.writer.close(outcome)
            self.flop_counter.remove()
            if self.info.is_main and (problem := self.finisher.wait()):  # an error is on its way out: no collective
                log.error("the last checkpoint's completion failed too: %s", problem)
        return 0

    def train_step(self, step: int, stop_requested: bool = False, record_metrics: Optional[bool] = None) -> "StepResult":
        """THE optimizer step `step` (1-based) of this run, as the loop runs it and as benchmarks time it:

        1. the phase of `step` (`pipeline.train.phases`: its data, seed, batch split, live-model
           overrides) when it differs from the previous step's;
        2. the learning rate from the run's schedule (a phase's own LR segment where it has one);
        3. dropout reseeded from (seed, step, rank) (`pipeline.seeding`);
        4. `grad_accum` micro-batches of forward, backward and `engine.step()` (`forward_backward`);
        5. ONE all-reduce of [non-finite losses, loss sum, stop flag, tokens, FLOPs] over the ranks;
        6. the guard's counters (`NonFiniteGuard.observe`, `loss_diverged`) and the state's counters
           (step, consumed samples, tokens seen) and the throughput meter.

        `stop_requested`: this rank's preemption flag, or-ed over the ranks in step 5 (the result's
        `stop_requested`). `record_metrics`: whether the objectives compute their metrics-only values
        this step (None: on logged steps, every `train.log_every`-th and the last). Raises nothing of
        the guard's: the caller decides (`loop`: log, stop on divergence, `guard.check`)."""
        cfg, state = self.cfg, self.state
        if self.plan.schedule is not None:  # a new phase or batch split (pipeline.train.phases)
            before_step(self, step, open_batches)
            cfg = self.cfg
        total = cfg.train.total_steps
        accum = self.plan.batch.grad_accum
        seeding.reseed_dropout(cfg.train.seed, step, self.info.rank)
        lr = self.plan.schedule.lr_at(step, cfg.optim) if self.plan.schedule else lr_at(step, cfg.optim, total)
        set_lr(self.optimizer, lr)

        logged = step % cfg.train.log_every == 0 or step == total if record_metrics is None else record_metrics
        sums, nonfinite_local, tokens_local = self.forward_backward(
            StepProgress(step, total, accum * self.info.world_size, record_metrics=logged), accum)

        # One small all-reduce per step: guard flags, preemption, tokens and FLOPs of all ranks.
        host = torch.tensor([stop_requested, tokens_local, self.flop_counter.pop()], dtype=torch.float64)
        loss_local = sums["loss"].double().reshape(1) if "loss" in sums else torch.zeros(1, dtype=torch.float64)
        status = torch.cat([nonfinite_local.reshape(1), loss_local.to(self.device), host.to(self.device)])
        nonfinite, loss_sum, preempted, tokens, flops = all_reduce_sum(status).tolist()
        bad = self.guard.observe(state, step, nonfinite, self.engine.was_step_applied())
        step_loss = loss_sum / (accum * self.info.world_size)
        diverged = self.guard.loss_diverged(state, step_loss)  # every rank alike: all-reduced values
        state.step, state.consumed_samples = step, state.phase_start_samples + self.batches.consumed_samples
        state.tokens_seen += int(tokens)
        self.meter.add_step(self.plan.batch.global_batch_size, int(tokens), flops)
        return StepResult(step, lr, step_loss, int(tokens), flops, int(nonfinite), bool(preempted), bad, diverged,
                          logged, accum, sums)

    def close(self, outcome: str = "finished") -> None:
        """End a run built by `build_run` and driven without `loop`: the trackers closed (`outcome`:
        `pipeline.train.trackers.OUTCOMES`), the FLOP counter's hooks removed, the engine destroyed."""
        self.writer.close(outcome)
        self.flop_counter.remove()
        self.engine.destroy()

    def last_good(self, before_step: int) -> str:
        """Collective: once the last save is complete, the newest healthy checkpoint below
        `before_step` (for the divergence guard's message)."""
        self.settle_saves()
        tag = last_good_tag(Path(self.cfg.train.output_dir) / CHECKPOINT_DIR, before_step)
        return str(tag) if tag is not None else "none (this run saved no checkpoint before it)"

    def settle_saves(self) -> None:
        """Collective: the background completion of the last save has finished; if it failed, every
        rank raises `CheckpointWriteError` (exit 4, `latest` names the checkpoint before)."""
        settle_pending_save(self.finisher, Path(self.cfg.train.output_dir) / CHECKPOINT_DIR, self.info.is_main)

    def preempted_during_startup(self, preemption: PreemptionHandler) -> bool:
        """Did any rank get SIGTERM/SIGUSR1 before the first step (imports, checks, engine, resume)?
        One all-reduce, so every rank decides alike; nothing new was computed, `latest` stays valid."""
        flag = torch.tensor([float(preemption.requested)], dtype=torch.float64, device=self.device)
        if not all_reduce_sum(flag).item():
            return False
        log.info("preempted (%s) during start-up, before step %d: nothing new to save (the resume point stays "
                 "%s); exiting with %d", preemption.signal_name or "signal on another rank", self.state.step + 1,
                 f"step {self.state.step}" if self.state.step else "a fresh start", REQUEUE_EXIT_CODE)
        return True

    def forward_backward(self, progress: StepProgress, accum: int) -> tuple[dict, torch.Tensor, int]:
        """One optimizer step: `accum` micro-batches of forward, backward and `engine.step()` (DeepSpeed
        scales each loss by 1/accum, averages over ranks, and updates — or skips an update whose
        gradients are not finite — at the boundary). Returns (summed metrics, count of non-finite
        losses, non-pad tokens)."""
        sums: dict[str, torch.Tensor] = {}
        nonfinite = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        for micro in range(accum):
            if self.plan.schedule is not None:  # the split may have changed: mark the boundary (set_engine_batch)
                self.engine.set_gradient_accumulation_boundary(micro == accum - 1)
            batch = next(self.batches)
            # Host-side values first (no device sync): the token count and the sampling stream.
            tokens += int(batch["attention_mask"].sum())
            sampling_seed = seeding.sampling_seed(self.cfg.train.seed, int(batch["sample_index"][0]))
            batch = move_batch(batch, self.device)  # asynchronous from pinned memory; host keys stay
            loss, parts = self.engine(batch, progress, sampling_seed)
            nonfinite += (~torch.isfinite(loss.detach())).double()
            self.engine.backward(loss)
            self.engine.step()
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value.detach().float()
        return sums, nonfinite, tokens

    def log_step(self, step: int, lr: float, sums: dict[str, torch.Tensor], accum: int) -> dict[str, float]:
        """Mean metrics of the step over micro-batches and ranks, plus run counters; written and returned."""
        state = self.state
        metrics = mean_over_ranks(sums, accum * self.info.world_size, self.device)
        grad_norm = self.engine.get_global_grad_norm()
        metrics.update(
            lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            consumed_samples=state.consumed_samples, tokens_seen=state.tokens_seen,
            skipped_steps=state.skipped_steps, nonfinite_steps=state.nonfinite_steps,
            **self.meter.report(), **peak_memory_gb(), **self.batches.source_metrics(),
            **(self.plan.schedule.metrics(step, self.plan.batch) if self.plan.schedule else {}))
        metrics.update(self.health.observe(step, metrics, announce=self.info.is_main))
        if self.cfg.deepspeed.precision == "fp16":
            metrics["loss_scale"] = float(getattr(self.engine.optimizer, "loss_scale", float("nan")))
        self.writer.write(step, metrics)
        if self.info.is_main:
            # each learning signal against its chance level (pipeline.eval.signals): on the step line, or,
            # under a progress bar (no step lines), once at the end of the run
            signals = format_signals(learning_signals(metrics))
            if not self.cfg.train.progress_bar:
                log.info("step %d/%d loss %.4f lr %.3e %.0f tok/s%s", step, self.cfg.train.total_steps,
                         metrics.get("loss", float("nan")), lr, metrics["tokens_per_s"],
                         f" | signals {signals}" if signals else "")
            elif step == self.cfg.train.total_steps and signals:
                log.info("learning signals at step %d (this step only; noisy): %s", step, signals)
        return metrics

    def checkpoint(self, last_metrics: dict, healthy: bool = True) -> None:
        state, meta = self.state, self.meta
        state.objective_state = self.model.extra_state_for_checkpoint()
        meta.step, meta.consumed_samples, meta.tokens_seen = state.step, state.consumed_samples, state.tokens_seen
        meta.last_metrics = {k: v for k, v in last_metrics.items() if isinstance(v, (int, float))}
        save_checkpoint(self.engine, Path(self.cfg.train.output_dir) / CHECKPOINT_DIR, state, meta,
                        self.cfg.train.keep_last, self.info.is_main, self.finisher, healthy)


def mean_over_ranks(sums: dict[str, torch.Tensor], count: int, device: torch.device) -> dict[str, float]:
    """Mean of each metric over the step's micro-batches and ranks (one all-reduce)."""
    keys = sorted(sums)
    if not keys:
        return {}
    values = all_reduce_sum(torch.stack([sums[k].to(device) for k in keys]).double())
    return {k: v / count for k, v in zip(keys, values.tolist())}
