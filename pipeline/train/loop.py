"""The pretraining run: built (`start`, or `build_run` for callers without the loop), stepped
(`Run.train_step`, THE step), looped (`Run.loop`). The entry point (arguments, process set-up, exit
codes) is `pipeline.train.cli`; checkpoint decisions are `pipeline.train.checkpoint.checkpointer.Checkpointer`'s.

A step = `grad_accum` micro-batches, each `engine(batch) -> engine.backward -> engine.step`
(DeepSpeed averages the gradients over micro-batches and ranks and updates at the boundary). The
learning rate is set from the step number before every step, by the run's schedule
(`pipeline.train.phases.schedule.Schedule.lr_at`: the run's one schedule over `train.total_steps`, or a
phase's own segment), and every random number comes from a stream of `pipeline.seeding`, so a
resumed run repeats the uninterrupted one bit for bit.

Every run walks its phases (`pipeline.train.phases.schedule`; one implicit phase without `phases`): before a
step, `Schedule.at` says what changes (a new phase, a new batch split) and `Run.apply_phase`
applies it, so the loop itself has no phase branches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from pipeline import seeding
from pipeline.data.batch import move_batch
from pipeline.train.run_config import RunConfig, RunPlan, check_run, config_hash
from pipeline.distributed import DistInfo, all_reduce_sum
from pipeline.monitor.health import CollapseMonitor, unigram_counts
from pipeline.monitor.signals import format_signals, learning_signals
from pipeline.train.validation import open_validator, validate
from pipeline.pretrain.build import build_pretrain_model
from pipeline.pretrain.pretrainer import PretrainModel
from pipeline.objectives.base import SAMPLED_SOFTMAX, StepProgress
from pipeline.objectives.registry import mlm_head_training
from pipeline.train.checkpoint.checkpointer import Checkpointer, ResumeTarget, TrainState
from pipeline.train.engine import build_deepspeed_config, optimizer_offloaded, restore_tf32, set_tf32
from pipeline.train.guard import NonFiniteGuard
from pipeline.train.metrics import FlopCounter, MetricsWriter, ThroughputMeter, device_peak_flops, peak_memory_gb
from pipeline.train.optim import build_optimizer, resolve_impl, set_lr, use_apex_layernorm
from pipeline.train.phases.switch import apply_model_overrides, set_engine_batch
from pipeline.train.phases.schedule import PhaseView
from pipeline.train.preemption import REQUEUE_EXIT_CODE, PreemptionHandler
from pipeline.train.profiler import StepProfiler
from pipeline.train.run_meta import RunMeta, corpus_summary

log = logging.getLogger("pipeline.train")


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

        counts = unigram_counts(open_run_data(cfg.data, data_samples(cfg, plan), check=False))
    return build_pretrain_model(encoder_config, cfg.objectives, manifest.special_tokens, cfg.objective_options,
                                seed=cfg.train.seed, kernels=cfg.model.kernels,
                                init_from=cfg.model.init_from if warm_start else None,
                                attention=cfg.model.attention, compile_layers=cfg.model.compile, unigram_counts=counts,
                                mlm_bias_init=bias_init, activation_checkpointing=cfg.model.activation_checkpointing)


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
          config_dict: dict, recipe: Optional[dict] = None, checkpointer: Optional[Checkpointer] = None) -> "Run":
    """Ranks, engine, resume (`target`, loaded by `checkpointer`; a fresh one for the run's output
    directory when None), data and metrics — everything the loop needs. `cfg` and `plan`: those of
    the phase of the next step (`Schedule.start_view`)."""
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

    checkpointer = checkpointer or Checkpointer(cfg.train, info.is_main)
    validator = open_validator(cfg, plan, model, info.rank, info.world_size, device)
    state = checkpointer.load(engine, target, model, validator.identity if validator else "", cfg.eval.shards_dir)
    # The phase of the next step: entered here when it starts with it (a checkpoint at a phase
    # boundary, or step 1), and its live-model overrides set (also mid-phase: a fresh model has none).
    view = plan.schedule.at(state.step + 1, state, plan.batch)
    if view is not None and view.entered:
        state.phase, state.phase_start_samples = view.phase.name, view.start_samples
        if plan.schedule.phased and info.is_main:
            log_phase_start(state.step + 1, view.phase)
    apply_model_overrides(model, plan.schedule.phase_at(state.step + 1).model)
    if target is not None and hasattr(dataset, "continue_stream"):  # a mixture goes on where each source stood
        note = dataset.continue_stream(target.meta.mixture, state.phase, state.consumed_samples - state.phase_start_samples,
                                       cfg.train.seed, data_samples(cfg, plan))
        if note and info.is_main:
            log.info("%s", note)
    batches = open_batches(cfg, plan, model, info.rank, state.consumed_samples - state.phase_start_samples, cuda,
                           dataset)
    meta = RunMeta(
        encoder_config=model.config.to_dict(), objectives=dict(cfg.objectives),
        objective_options=dict(cfg.objective_options), special_tokens=dict(dataset.special_tokens),
        tokenizer_dir=str(dataset.tokenizer_dir.resolve()), data_dir=str(dataset.directory.resolve()),
        manifest_hash=plan.manifest_hash, tokenizer_hash=plan.manifest.tokenizer_hash,
        config_hash=config_hash(config_dict), config=config_dict,
        zero_stage=plan.zero_stage, world_size=info.world_size,
        corpus=plan.schedule.corpus(corpus_summary(plan.manifest)),
        base_model=describe_base(cfg.model.init_from) if cfg.model.init_from else {}, recipe=dict(recipe or {}))
    if info.is_main:
        log.info("%s: %s, ZeRO %d, %s, optimizer %s, %d parameters", cfg.name, plan.batch, plan.zero_stage,
                 cfg.deepspeed.precision, resolve_impl(cfg.optim, device.type, offload),
                 sum(p.numel() for p in model.parameters()))
        from pipeline.model.checkpointing import describe

        if checkpointed := describe(model):  # memory for compute: say so where the run says what it is
            log.info("%s", checkpointed)
    return Run(cfg, plan, info, device, model, engine, optimizer, batches, state, meta, flop_counter,
               MetricsWriter.for_run(cfg, info.is_main, state.step, recipe,  # train.trackers; a rewind: new runs
                                     rewound=bool(target and target.set_aside)),
               ThroughputMeter(info.world_size, device_peak_flops(cfg.deepspeed.precision)),
               NonFiniteGuard(cfg.train.max_nonfinite_steps, cfg.deepspeed.precision == "fp16",
                              cfg.train.max_loss_ratio, cfg.train.max_weight_norm_ratio), checkpointer,
               validator=validator)


def build_run(cfg: RunConfig, recipe: Optional[dict] = None) -> "Run":
    """A started run of `cfg` from a fresh start, without the loop: what `train` builds before its
    first step (stage-2 checks for this launch's world size, the model, ranks, engine, data, metrics
    writer), for callers that drive `Run.train_step` themselves (benchmarks). No run directory lock,
    no resume, no exit record; nothing is saved unless the caller asks `run.checkpointer`. Call it
    inside `torch_process_state(cfg.train.deterministic, cfg.deepspeed.tf32)`, as `train` does, and
    end with `run.close()`:

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
    model = build_run_model(plan.schedule.run_config(plan.schedule.phases[0]), plan)
    return start(*plan.schedule.start_view(plan, 0), model, None, cfg.to_dict(), recipe)


def open_data(cfg: RunConfig, plan: RunPlan, model: PretrainModel) -> Any:
    """The run's (or phase's) dataset, every rank checking the shards' bytes (of every source of a
    mixture); sets the model's health unigram references (plateau, entropy) from a bounded row sample."""
    from pipeline.data.mixture import open_run_data

    dataset = open_run_data(cfg.data, data_samples(cfg, plan))
    model.set_health_unigram(unigram_counts(dataset))
    return dataset


def data_samples(cfg: RunConfig, plan: RunPlan) -> int:
    """The samples the data is planned over (a mixture's token budgets): a phase's steps x its batch,
    or the run's `train.total_steps` x global batch."""
    return plan.data_samples or cfg.train.total_steps * plan.batch.global_batch_size


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
    """A started run: what `loop` and `train_step` read and update."""

    cfg: RunConfig  # the config of the current phase (its data and seed; `Schedule.run_config`)
    plan: RunPlan  # ... and its plan (batch split, data identity); `plan.schedule`: the run's phases
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
    checkpointer: Checkpointer
    health: CollapseMonitor = field(default_factory=lambda: CollapseMonitor(log))
    validator: Any = None  # pipeline.train.validation.Validator when eval.shards_dir is set

    def loop(self, preemption: PreemptionHandler) -> int:
        """Steps until `train.total_steps`, a preemption, or the guard stops the run; returns the exit
        code (0, or `REQUEUE_EXIT_CODE` after a preemption). Each step: `train_step`, its metrics
        on logged steps, the guard's verdicts, then the checkpointer's (`Checkpointer.step_end`)."""
        from tqdm.auto import tqdm

        cfg, state = self.cfg, self.state
        total = cfg.train.total_steps
        bar = tqdm(total=total, initial=state.step, disable=not (self.info.is_main and cfg.train.progress_bar),
                   desc=cfg.name, dynamic_ncols=True, mininterval=1.0)
        last_metrics: dict = {}
        outcome = "failed"  # what the trackers are told at close (trackers.OUTCOMES); set on a clean way out
        profiler = StepProfiler.for_run(cfg, self.info.rank, state.step)  # train.profile; a no-op when off
        try:
            if state.step < total and self.preempted_during_startup(preemption):
                outcome = "stopped"
                return REQUEUE_EXIT_CODE
            if state.step >= total and self.info.is_main:  # (below total_steps was refused at resume)
                log.info("the run is already complete at step %d (train.total_steps=%d): nothing to train; to extend "
                         "it: cpt-train --resume %s train.total_steps=N (N > %d)", state.step, total, cfg.train.output_dir, state.step)
            while state.step < total:
                profiler.step_begin(state.step + 1)  # train.profile: a no-op outside its window
                result = self.train_step(state.step + 1, stop_requested=preemption.requested)
                profiler.step_end(result.step)
                step, lr = result.step, result.lr
                bar.update(1)
                if result.logged or result.bad or result.diverged:
                    last_metrics = self.log_step(step, lr, result.sums, result.accum)
                    bar.set_postfix(loss=f"{last_metrics.get('loss', float('nan')):.4f}", lr=f"{lr:.2e}")
                if result.diverged:  # its weights came from step - 1's update: that checkpoint is not good either
                    raise self.guard.loss_divergence_error(state, step, result.loss,
                                                           self.checkpointer.last_good(step - 1))
                self.guard.check(state, step)
                if self.validator is not None and self.validator.due(step, total):  # eval.every (pipeline.train.validation)
                    validate(self, step)  # before the save: train.keep_best judges this step's values
                if self.checkpointer.step_end(self, step, result.stop_requested, last_metrics):
                    self.meter.reset()  # keep the save time out of the throughput numbers
                if result.stop_requested and step == total:
                    log.info("%s after the last step: the run is complete (final checkpoint written); exiting 0",
                             preemption.signal_name or "preemption signal on another rank")
                elif result.stop_requested:
                    log.info("preempted (%s): checkpoint at step %d written; exiting with %d",
                             preemption.signal_name or "signal on another rank", step, REQUEUE_EXIT_CODE)
                    outcome = "stopped"
                    return REQUEUE_EXIT_CODE
            outcome = "finished"  # (the last step's save was settled by `step_end`)
        finally:
            profiler.close()
            bar.close()
            self.writer.close(outcome)
            self.flop_counter.remove()
            self.checkpointer.close()  # an error may be on its way out: no collective
        return 0

    def train_step(self, step: int, stop_requested: bool = False, record_metrics: Optional[bool] = None) -> "StepResult":
        """THE optimizer step `step` (1-based) of this run, as the loop runs it and as benchmarks time it:

        1. the phase of `step` (`Schedule.at` -> `apply_phase`: a new phase's data, seed and live-model
           overrides, a new batch split), when it differs from the previous step's;
        2. the learning rate from the run's schedule (a phase's own LR segment where it has one);
        3. dropout reseeded from (seed, step, rank) (`pipeline.seeding`);
        4. `grad_accum` micro-batches of forward, backward and `engine.step()` (`forward_backward`);
        5. ONE all-reduce of [non-finite losses, loss sum, stop flag, tokens, FLOPs] over the ranks;
        6. the guard's counters (`NonFiniteGuard.observe`, `loss_diverged`), the state's counters
           (step, consumed samples, tokens seen) and the throughput meter.

        `stop_requested`: this rank's preemption flag, or-ed over the ranks in step 5 (the result's
        `stop_requested`). `record_metrics`: whether the objectives compute their metrics-only values
        this step (None: on logged steps, every `train.log_every`-th and the last). Raises nothing of
        the guard's: the caller decides (`loop`: log, stop on divergence, `guard.check`, save)."""
        state = self.state
        self.apply_phase(self.plan.schedule.at(step, state, self.plan.batch))
        cfg = self.cfg
        total = cfg.train.total_steps
        accum = self.plan.batch.grad_accum
        seeding.reseed_dropout(cfg.train.seed, step, self.info.rank)
        lr = self.plan.schedule.lr_at(step, cfg.optim)
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

    def apply_phase(self, view: Optional[PhaseView]) -> None:
        """Make the run what `view` (`Schedule.at`) says before its step; None: nothing changes. A new
        phase: its config view (data, seed), data identity and live-model overrides, the state's phase
        and its first sample, the meta's encoder and data; then (a new phase or split) the reader
        reopened at the phase's current sample with the step's batch split, and the engine's split."""
        if view is None:
            return
        state, phase = self.state, view.phase
        dataset = self.batches.dataset
        if view.entered:
            state.phase, state.phase_start_samples = phase.name, view.start_samples
            log_phase_start(state.step + 1, phase)
            self.cfg = self.plan.schedule.run_config(phase)
            self.plan = dataclasses.replace(self.plan, manifest=phase.manifest, manifest_hash=phase.manifest_hash,
                                            data_samples=phase.samples)
            apply_model_overrides(self.model, phase.model)
            dataset = None  # the phase's own data, opened (and checked) by open_batches
            self.meta.encoder_config = self.model.config.to_dict()
            self.meta.manifest_hash = phase.manifest_hash
        self.plan = dataclasses.replace(self.plan, batch=view.batch)
        self.batches = open_batches(self.cfg, self.plan, self.model, self.info.rank,
                                    state.consumed_samples - state.phase_start_samples, self.device.type == "cuda",
                                    dataset)
        self.meta.data_dir = str(self.batches.dataset.directory.resolve())
        set_engine_batch(self.engine, view.batch)

    def close(self, outcome: str = "finished") -> None:
        """End a run built by `build_run` and driven without `loop`: the trackers closed (`outcome`:
        `pipeline.train.trackers.OUTCOMES`), the FLOP counter's hooks removed, a pending checkpoint
        completion waited for, the engine destroyed."""
        self.writer.close(outcome)
        self.flop_counter.remove()
        self.checkpointer.close()
        self.engine.destroy()

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
            # marked here, not counted by DeepSpeed: the split may change (warm-up, phases; `set_engine_batch`)
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
        """Mean metrics of the step over micro-batches and ranks, plus run counters; written, offered to
        the checkpointer (`train.keep_best`) and returned."""
        state = self.state
        metrics = mean_over_ranks(sums, accum * self.info.world_size, self.device)
        grad_norm = self.engine.get_global_grad_norm()
        metrics.update(
            lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            consumed_samples=state.consumed_samples, tokens_seen=state.tokens_seen,
            skipped_steps=state.skipped_steps, nonfinite_steps=state.nonfinite_steps,
            **self.meter.report(), **peak_memory_gb(), **self.batches.source_metrics(),
            **self.plan.schedule.metrics(step, self.plan.batch))
        metrics.update(self.health.observe(step, metrics, announce=self.info.is_main))
        if self.cfg.deepspeed.precision == "fp16":
            metrics["loss_scale"] = float(getattr(self.engine.optimizer, "loss_scale", float("nan")))
        self.writer.write(step, metrics)
        self.checkpointer.observe_metric(step, metrics)  # train.keep_best (validation offers its own values too)
        if self.info.is_main:
            # each learning signal against its chance level (pipeline.monitor.signals): on the step line, or,
            # under a progress bar (no step lines), once at the end of the run
            signals = format_signals(learning_signals(metrics))
            if not self.cfg.train.progress_bar:
                log.info("step %d/%d loss %.4f lr %.3e %.0f tok/s%s", step, self.cfg.train.total_steps,
                         metrics.get("loss", float("nan")), lr, metrics["tokens_per_s"],
                         f" | signals {signals}" if signals else "")
            elif step == self.cfg.train.total_steps and signals:
                log.info("learning signals at step %d (this step only; noisy): %s", step, signals)
        return metrics


def log_phase_start(step: int, phase: Any) -> None:
    """The line that marks a phase's first step (phase 0's at set-up, a later one's when it starts)."""
    log.info("step %d: phase %r starts (%s, seq_len %d, %d steps, global batch %d)", step, phase.name,
             phase.data.shards_dir or "data.sources", phase.manifest.seq_len, phase.steps, phase.batch.global_batch_size)


def mean_over_ranks(sums: dict[str, torch.Tensor], count: int, device: torch.device) -> dict[str, float]:
    """Mean of each metric over the step's micro-batches and ranks (one all-reduce)."""
    keys = sorted(sums)
    if not keys:
        return {}
    values = all_reduce_sum(torch.stack([sums[k].to(device) for k in keys]).double())
    return {k: v / count for k, v in zip(keys, values.tolist())}
