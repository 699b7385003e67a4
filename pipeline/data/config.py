"""`data.*`: where the shards are and how the global batch is split — owned and validated here.

`BatchPlan` / `plan_batches` is the one home of the batch arithmetic

    global_batch_size = micro_batch_size x grad_accum x world_size

used by the config checks, the reader (`pipeline.data.reader.PretrainBatches`) and the DeepSpeed
settings (`pipeline.train.engine`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.config.checks import ConfigError, check_keywords, check_known_keys, check_positive
from pipeline.data.shards import Manifest, check_layout, manifest_hash, read_manifest
from pipeline.data.sources import (DEFAULT_MIXTURE_BLOCK, MixturePlan, check_exhaustion, mixture_hash,
                                   mixture_mismatches, parse_sources, plan_mixture)


@dataclass
class DataConfig:
    shards_dir: str = ""
    """Directory written by `data_prep.build_shards` (holds `manifest.json`, shards, `tokenizer/`). Required
    unless `data.sources` names a mixture (never both)."""
    sources: list = field(default_factory=list)
    """A data mixture instead of `shards_dir`: a list of `{path, weight | tokens, name, on_exhausted}`, one
    shared tokenizer and seq_len; shares, interleave and exhaustion rules in `pipeline.data.sources`."""
    mixture_block: int = DEFAULT_MIXTURE_BLOCK
    """Positions per interleave block of `data.sources`: each block holds every source's exact quota
    (shares realised to 1/mixture_block), in an order drawn from (seed, block)."""
    seq_len: Optional[int] = None
    """Expected sequence length of the shards (the recipe's); checked against the manifest when set."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all ranks = micro_batch_size x grad_accum x world size."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    grad_accum: Optional[int] = None
    """Micro-batches per step on each rank; default: derived from the global batch and the world size."""
    num_workers: int = 2
    """Data-loader worker processes per rank that collate (mask, crop, ...) while the step runs; 0 collates in the
    training process between steps (the tiny CPU presets: their batches take microseconds)."""
    corruption: dict = field(default_factory=dict)
    """Keyword options of `pipeline.data.corruption.CorruptionCollator` (mask probability, crop ratio, ...)."""
    verify_shards: bool = True
    """Check every shard's bytes against the manifest's hash (xxh3-64; sha256 for format-1 manifests)
    on every rank when the shards are first opened, before the first step. `false` skips only that
    full read (sizes, footers, row counts and the manifest are always checked); for data checked
    separately with `python -m data_prep.verify`."""
    batch_warmup: dict = field(default_factory=dict)
    """Batch-size warm-up `{start_global_batch_size: S, tokens: N}`: the global batch grows from S to
    `global_batch_size` over the first N token positions (sequences x seq_len), in multiples of
    micro x world (gradient-accumulation steps ramp; `BatchRamp`); the samples and their order are
    the run's without it. Empty: off."""

    def check(self) -> None:
        """Stage-1 checks (the config alone)."""
        from pipeline.data.corruption import CorruptionCollator, check_options

        check_positive(self.global_batch_size, "data.global_batch_size")
        check_positive(self.micro_batch_size, "data.micro_batch_size")
        if self.grad_accum is not None:
            check_positive(self.grad_accum, "data.grad_accum")
        check_positive(self.num_workers, "data.num_workers", allow_zero=True)
        check_keywords(CorruptionCollator, self.corruption, "data.corruption", skip=4)  # views, specials, vocab, seed
        try:
            check_options(self.corruption)  # the values too (mask_rate in (0, 1], ...), before any compute
        except ValueError as err:
            raise ConfigError(str(err)) from err
        check_batch_warmup(self)
        if self.sources:
            if self.shards_dir:
                raise ConfigError(f"data.sources and data.shards_dir={self.shards_dir} are both set: they are mutually "
                                  "exclusive (one directory, or a mixture of several); drop one of them")
            parse_sources(self.sources, self.mixture_block)

    def check_shards(self, batch: "BatchPlan", total_steps: Optional[int] = None,
                     seed: int = 0, length_field: str = "train.total_steps", first_step: int = 0) -> tuple[Manifest, str]:
        """Stage-2 checks of the shard directory, or of every source of `data.sources` (then the first
        source's manifest, which they all agree with, and the mixture's hash): (manifest, data hash),
        or a `ConfigError`. `total_steps` and `seed` (the run's, or a phase's own steps and seed; then
        `length_field` names its length and `first_step` the steps before it) let a mixture check its
        token budgets and `on_exhausted: stop` sources."""
        if self.sources:
            manifests, plan = self.check_sources(batch, total_steps, seed, length_field, first_step)
            return manifests[0], mixture_hash([m.content_hash for m in manifests], plan)
        if not self.shards_dir:
            raise ConfigError("data.shards_dir is required (a directory written by data_prep.build_shards); "
                              "pass data.shards_dir=PATH, or data.sources for a mixture")
        manifest = check_shard_dir(self.shards_dir, "data.shards_dir", self.seq_len)
        if manifest.total_sequences < batch.global_batch_size:
            raise ConfigError(f"data.global_batch_size={batch.global_batch_size} exceeds the "
                              f"{manifest.total_sequences} sequences in {self.shards_dir}")
        return manifest, manifest_hash(self.shards_dir)

    def check_sources(self, batch: "BatchPlan", total_steps: Optional[int] = None, seed: int = 0,
                      length_field: str = "train.total_steps", first_step: int = 0) -> tuple[list[Manifest], MixturePlan]:
        """Every source checked as a `shards_dir` is, then against the first: one tokenizer (hash,
        vocabulary, special-token ids) and one seq_len; then the shares (`plan_mixture`) and the
        `on_exhausted: stop` sources against the run's length."""
        specs = parse_sources(self.sources, self.mixture_block)
        manifests = [check_shard_dir(spec.path, f"{spec.where}.path", self.seq_len) for spec in specs]
        problems = mixture_mismatches([(f"{spec.where}.path={spec.path}", spec.path, manifest)
                                       for spec, manifest in zip(specs, manifests)])
        if problems:
            raise ConfigError(problems[0])
        total = sum(m.total_sequences for m in manifests)
        if total < batch.global_batch_size:
            raise ConfigError(f"data.global_batch_size={batch.global_batch_size} exceeds the {total} sequences of "
                              "data.sources")
        run_samples = total_steps * batch.global_batch_size if total_steps else None
        plan = plan_mixture(specs, [m.total_sequences for m in manifests], [m.total_tokens for m in manifests],
                            self.mixture_block, run_samples)
        if run_samples:
            check_exhaustion(plan, seed, run_samples, batch.global_batch_size, int(total_steps), length_field, first_step)
        return manifests, plan


def check_shard_dir(directory: str, where: str, seq_len: Optional[int]) -> Manifest:
    """One shard directory for training (`where` names its field): complete, every listed shard present,
    the layout against the manifest (`check_layout`), the expected `seq_len`; its manifest, or a `ConfigError`."""
    shards = Path(directory)
    if not shards.is_dir():
        raise ConfigError(f"{where}={shards}: no such directory")
    try:
        manifest = read_manifest(shards)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{where}={shards}: {err}") from err
    missing = [s.name for s in manifest.shards if not (shards / s.name).is_file()]
    if missing:
        raise ConfigError(f"{where}={shards}: shards listed in manifest.json are missing: {missing[:5]}")
    problems = check_layout(shards, manifest)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ConfigError(f"{where}={shards}: {problems[0]}{more}; nothing was computed. Check the "
                          f"directory with `python -m data_prep.verify {shards}` and rebuild it")
    if seq_len is not None and seq_len != manifest.seq_len:
        raise ConfigError(f"data.seq_len={seq_len} but the shards in {shards} have seq_len="
                          f"{manifest.seq_len}; rebuild the shards or set data.seq_len={manifest.seq_len}")
    return manifest


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is split: global = micro x accum x world (the one home of this rule)."""

    micro_batch_size: int
    grad_accum: int
    world_size: int

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.grad_accum < 1 or self.world_size < 1:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}), grad_accum ({self.grad_accum}), "
                             f"world_size ({self.world_size}) must be >= 1")

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size


def plan_batches(data: DataConfig, world_size: int) -> BatchPlan:
    """Derive (or check) gradient accumulation so that micro x accum x world == global."""
    per_step = data.micro_batch_size * world_size
    if data.grad_accum is None:
        if data.global_batch_size % per_step:
            options = sorted({m for m in range(1, data.global_batch_size + 1)
                              if data.global_batch_size % (m * world_size) == 0})
            raise ConfigError(
                f"data.global_batch_size={data.global_batch_size} is not divisible by data.micro_batch_size="
                f"{data.micro_batch_size} x world size {world_size} = {per_step}; micro batch sizes that work "
                f"with {world_size} rank(s): {options[-6:] or 'none'}")
        return BatchPlan(data.micro_batch_size, data.global_batch_size // per_step, world_size)
    plan = BatchPlan(data.micro_batch_size, data.grad_accum, world_size)
    if plan.global_batch_size != data.global_batch_size:
        raise ConfigError(
            f"data.global_batch_size={data.global_batch_size} != data.micro_batch_size={data.micro_batch_size} x "
            f"data.grad_accum={data.grad_accum} x world size {world_size} = {plan.global_batch_size}; "
            "fix one of them or leave data.grad_accum unset to derive it")
    return plan


#: Keys of `data.batch_warmup`.
BATCH_WARMUP_KEYS = ("start_global_batch_size", "tokens")


def check_batch_warmup(data: DataConfig) -> None:
    """Stage-1 checks of `data.batch_warmup` (keys, positive integers, start below the target)."""
    warmup = data.batch_warmup
    if not warmup:
        return
    if not isinstance(warmup, dict):
        raise ConfigError(f"data.batch_warmup: expected a mapping {{start_global_batch_size: S, tokens: N}}, got {warmup!r}")
    check_known_keys(warmup, BATCH_WARMUP_KEYS, "data.batch_warmup")
    for key in BATCH_WARMUP_KEYS:
        value = warmup.get(key)
        if isinstance(value, float) and value.is_integer():
            value = warmup[key] = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"data.batch_warmup.{key}={value!r}: must be a positive integer (write 1000000000, "
                              "not 1e9)")
    if warmup["start_global_batch_size"] >= data.global_batch_size:
        raise ConfigError(f"data.batch_warmup.start_global_batch_size={warmup['start_global_batch_size']} must be "
                          f"below data.global_batch_size={data.global_batch_size} (it grows to it)")


@dataclass(frozen=True)
class BatchRamp:
    """The batch-size warm-up's split of each step (`data.batch_warmup`): a pure function of the
    samples consumed before the step, c (t = c x seq_len token positions):

        accum(t) = clamp(floor((S x N + (G - S) x t) / (N x q)), S / q, G / q),   q = micro x world

    (integer arithmetic: every rank and every resume computes the same split). The micro-batch is
    fixed, so the reader's sample stream is the run's without warm-up, cut into smaller steps."""

    start: int  # S: the first step's global batch
    tokens: int  # N: token positions over which the batch grows
    seq_len: int
    final: BatchPlan  # G = final.global_batch_size

    def plan_at(self, consumed: int) -> BatchPlan:
        final = self.final
        t = consumed * self.seq_len
        if t >= self.tokens:
            return final
        q = final.micro_batch_size * final.world_size
        size = self.start * self.tokens + (final.global_batch_size - self.start) * t
        accum = min(final.grad_accum, max(self.start // q, size // (self.tokens * q)))
        return BatchPlan(final.micro_batch_size, accum, final.world_size)


def plan_ramp(data: DataConfig, final: BatchPlan, seq_len: int, where: str = "data.batch_warmup") -> Optional[BatchRamp]:
    """Stage 2 of `data.batch_warmup` (the world size known): the start in micro x world multiples."""
    if not data.batch_warmup:
        return None
    start, quantum = int(data.batch_warmup["start_global_batch_size"]), final.micro_batch_size * final.world_size
    if start % quantum:
        options = [k * quantum for k in range(1, final.grad_accum)][:6]
        raise ConfigError(f"{where}.start_global_batch_size={start} is not a multiple of data.micro_batch_size="
                          f"{final.micro_batch_size} x world size {final.world_size} = {quantum} (the warm-up ramps "
                          f"gradient-accumulation steps); starts that work: {options or 'none'}")
    return BatchRamp(start, int(data.batch_warmup["tokens"]), seq_len, final)
