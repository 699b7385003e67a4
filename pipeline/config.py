"""Run configuration: nested dataclasses (one documented field each), YAML presets, dotted overrides.

One source of truth for a training run. A run is described by

    python -m pipeline.train --config PRESET_OR_YAML [section.key=value ...]

where PRESET is a file name in `pipeline/configs/` (without `.yaml`) and every override is a
dotted path into `RunConfig` whose value is parsed as YAML (`train.total_steps=1000`,
`optim.betas=[0.9,0.98]`, `objectives={mlm: 1.0}`). A preset may start with `inherit: OTHER`:
sections then merge field by field, while mapping-valued fields (`objectives`,
`objective_options`, `data.corruption`, `deepspeed.extra`) are replaced as a whole by a preset
that sets them (so an MLM baseline can drop the contrastive objective of the recipe it copies);
a dotted override sets one key inside them (`objective_options.taco.tau=0.1`).

Validation happens in two stages, both before any model is built:
  `load_config`  unknown keys (with a did-you-mean), value types, enums, ranges, objective names
                 and their options (checked against the objective's constructor);
  `check_run`    what needs the launch environment: batch arithmetic for this world size (one
                 home: `plan_batches`), the shard directory and manifest, the DeepSpeed engine
                 file, the ZeRO stage against the objectives, and the kernels / apex switches.

The DeepSpeed JSON is assembled in one place, `build_deepspeed_config`: engine settings from
`ds_configs/<name>.json` (ZeRO stage, buckets, offload; never LR or batch sizes) plus the batch
sizes, clipping and precision of the run config.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import hashlib
import inspect
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

PRESET_DIR = Path(__file__).resolve().parent / "configs"
ENGINE_DIR = Path(__file__).resolve().parent.parent / "ds_configs"
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "lamb")
OPTIMIZER_IMPLS = ("auto", "torch", "deepspeed", "apex")
LAYERNORM_IMPLS = ("torch", "apex")

#: DeepSpeed keys that belong to the run config, never to an engine file.
RUN_OWNED_ENGINE_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "bf16",
    "fp16",
)

#: fp16 dynamic loss scaling (DeepSpeed's defaults, spelled out); an engine file may override
#: any of these under `fp16_loss_scaling`.
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1}


class ConfigError(ValueError):
    """A configuration problem, reported before any compute; the message names the field or file."""


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    size: str = "tiny"
    """Size preset from `pipeline.model.SIZE_PRESETS`: tiny, taco-small, capt-small, base, large."""
    num_layers: Optional[int] = None
    """Override of the preset's layer count."""
    hidden_size: Optional[int] = None
    """Override of the preset's hidden size."""
    num_heads: Optional[int] = None
    """Override of the preset's attention-head count."""
    ffn_size: Optional[int] = None
    """Override of the preset's feed-forward inner size."""
    max_position: Optional[int] = None
    """Position-embedding table size; default: the shards' `seq_len`."""
    dropout: float = 0.1
    """Hidden dropout probability."""
    attention_dropout: float = 0.1
    """Attention-probability dropout."""
    kernels: str = "auto"
    """Loss ops: `torch` (reference), `triton` (fused kernels, error if unusable), `auto` (Triton on CUDA)."""
    layernorm: str = "torch"
    """LayerNorm implementation: `torch`, or `apex` (NVIDIA apex FusedLayerNorm; GPU, optional extra)."""


@dataclass
class DataConfig:
    shards_dir: str = ""
    """Directory written by `data_prep.build_shards` (holds `manifest.json`, shards, `tokenizer/`). Required."""
    seq_len: Optional[int] = None
    """Expected sequence length of the shards (the recipe's); checked against the manifest when set."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all ranks = micro_batch_size x grad_accum x world size."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    grad_accum: Optional[int] = None
    """Micro-batches per step on each rank; default: derived from the global batch and the world size."""
    num_workers: int = 0
    """Data-loader worker processes per rank (0: collate in the training process)."""
    corruption: dict = field(default_factory=dict)
    """Keyword options of `pipeline.corruption.CorruptionCollator` (mask probability, crop ratio, ...)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """`adamw` (decoupled weight decay) or `lamb` (GPU only: DeepSpeed or apex fused LAMB)."""
    impl: str = "auto"
    """`auto` (DeepSpeed FusedAdam on GPU, torch AdamW on CPU), `torch`, `deepspeed`, `apex`."""
    lr: float = 1e-4
    """Peak learning rate, reached at the end of warm-up."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm weights."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many steps."""
    min_lr_ratio: float = 0.0
    """Linear decay after warm-up ends at `lr * min_lr_ratio` on the last step."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""


@dataclass
class DeepSpeedConfig:
    config: str = "zero1"
    """Engine settings: a name in `ds_configs/` (zero1, zero2, zero3, zero3-offload) or a JSON path."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (fp16 uses DeepSpeed's dynamic loss scaling)."""
    extra: dict = field(default_factory=dict)
    """Engine keys deep-merged over the engine file (e.g. `{zero_optimization: {reduce_bucket_size: 5e7}}`)."""


@dataclass
class TrainConfig:
    total_steps: int = 20
    """Optimizer steps of the whole run (the LR schedule and CAPT's temperature depend on it)."""
    seed: int = 1234
    """Seed of initialisation, data order, masking, objective sampling and dropout."""
    output_dir: str = ""
    """Run directory (checkpoints/, metrics.jsonl, tb/); default: runs/<preset name>."""
    log_every: int = 10
    """Write metrics every this many steps (and on the last step)."""
    checkpoint_every: int = 1000
    """Save a checkpoint every this many steps (and on the last step, and on SIGTERM/SIGUSR1)."""
    keep_last: int = 3
    """Complete checkpoints kept in `<output_dir>/checkpoints/` (older ones are deleted)."""
    resume: str = "auto"
    """`auto` (from `<output_dir>/checkpoints/latest` if present), `never`, or a checkpoint tag directory."""
    allow_config_change: bool = False
    """Resume even if the checkpoint's config or data manifest differs (the differences are logged)."""
    max_nonfinite_steps: int = 10
    """Stop with an error after this many consecutive steps with a non-finite loss (each one is skipped)."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms` (e.g. scatter-add gradients in a fixed order): bitwise
    reproducible runs and resumes; costs little on CPU, can be slower on GPU."""
    progress_bar: bool = True
    """Rank-0 tqdm progress bar."""
    tensorboard: bool = True
    """Also write metrics to TensorBoard in `<output_dir>/tb/`."""


@dataclass
class RunConfig:
    name: str = "run"
    """Run name (the preset's name by default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    objectives: dict = field(default_factory=lambda: {"mlm": 1.0})
    """Objective name -> loss weight; the total loss is the weighted sum."""
    objective_options: dict = field(default_factory=dict)
    """Objective name -> keyword options of its constructor (see each objective's docstring)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


#: Fields that do not change what a step computes, so resuming with a different value is not a
#: "config change": run control and I/O, the micro-batch split (a new rank count changes it; the
#: global batch is what matters, and it is checked), the shard path (the manifest hash identifies
#: the data). `train.total_steps` is NOT here: it shapes the LR decay and CAPT's temperature, so
#: extending a run is a deliberate change that needs `train.allow_config_change=true`.
RESUME_IGNORED_FIELDS = (
    "name",
    "data.shards_dir",
    "data.micro_batch_size",
    "data.grad_accum",
    "data.num_workers",
    "train.output_dir",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_last",
    "train.resume",
    "train.allow_config_change",
    "train.max_nonfinite_steps",
    "train.deterministic",
    "train.progress_bar",
    "train.tensorboard",
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (for `--help-config`)."""
    source = inspect.getsource(cls)
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = following.value.value  # type: ignore[attr-defined]
    return docs


def describe_config() -> str:
    """Every field with its default and docstring, one line each (printed by `--help-config`)."""
    lines: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            value = getattr(defaults, f.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), f"{prefix}{f.name}.")
            else:
                lines.append(f"{prefix}{f.name} = {value!r}\n    {docs.get(f.name, '')}")

    walk(RunConfig, "")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Loading: presets, inheritance, overrides, typed construction
# --------------------------------------------------------------------------------------------
def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def resolve_preset(name_or_path: str) -> Path:
    """A preset name (`taco-small`) or a YAML path -> the file; clear error with suggestions."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"--config {name_or_path}: no such file")
        return path
    candidate = PRESET_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise ConfigError(f"--config {name_or_path}: unknown preset{_did_you_mean(name_or_path, available_presets())}; "
                          f"presets: {', '.join(available_presets())}")
    return candidate


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML ({err})") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def load_raw(name_or_path: str, _seen: tuple[str, ...] = ()) -> dict:
    """The preset as a plain dict with its `inherit:` chain resolved (child wins)."""
    path = resolve_preset(name_or_path)
    if str(path) in _seen:
        raise ConfigError(f"{path}: inheritance cycle {' -> '.join(_seen + (str(path),))}")
    raw = _read_yaml(path)
    parent = raw.pop("inherit", None)
    raw.setdefault("name", path.stem)
    if parent is None:
        return raw
    base = load_raw(str(parent), _seen + (str(path),))
    base.pop("name", None)
    return _merge(base, raw, RunConfig)


def _merge(base: dict, child: dict, cls: type) -> dict:
    """Merge `child` over `base`: dataclass sections field by field, everything else replaced."""
    out = copy.deepcopy(base)
    hints = typing.get_type_hints(cls)
    for key, value in child.items():
        sub = hints.get(key)
        if dataclasses.is_dataclass(sub) and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, sub)  # type: ignore[arg-type]
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(raw: dict, override: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to the raw config dict, in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.key=value")
    key, text = override.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}: cannot parse value {text!r} ({err})") from err
    parts = key.split(".")
    cls: Optional[type] = RunConfig
    node = raw
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if cls is not None:
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                raise ConfigError(f"override {key}: unknown key {where!r}{_did_you_mean(part, names)}")
            sub = typing.get_type_hints(cls)[part]
            cls = sub if dataclasses.is_dataclass(sub) else None  # inside a mapping field: free keys
        if i == len(parts) - 1:
            node[part] = value
        else:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {where} is {nxt!r}, not a mapping")
            node = nxt


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert one value against a field type (int, float, bool, str, Optional, tuple, dict)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
    elif tp is dict or origin is dict:
        if value is None:
            return {}
        if isinstance(value, dict):
            return copy.deepcopy(value)
    else:  # pragma: no cover - schema uses only the types above
        return value
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r} ({type(value).__name__})")


def from_dict(cls: type, raw: dict, where: str = "") -> Any:
    """Build dataclass `cls` from a raw dict: unknown keys (did-you-mean) and types checked."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise ConfigError(f"unknown config key {where}{key!r}{_did_you_mean(str(key), names)}; "
                              f"valid keys here: {', '.join(names)}")
    values = {}
    for name in names:
        if name not in raw:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = from_dict(tp, raw[name] or {}, f"{where}{name}.")  # type: ignore[arg-type]
        else:
            values[name] = _coerce(raw[name], tp, f"{where}{name}")
    return cls(**values)


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> RunConfig:
    """Preset/YAML + dotted overrides -> validated `RunConfig` (stage-1 checks; no filesystem)."""
    raw = load_raw(name_or_path)
    for override in overrides:
        apply_override(raw, override)
    cfg = from_dict(RunConfig, raw)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# Stage-1 validation (no filesystem, no world size)
# --------------------------------------------------------------------------------------------
def _choice(value: str, options: Sequence[str], where: str) -> None:
    if value not in options:
        raise ConfigError(f"{where}={value!r}: must be one of {list(options)}{_did_you_mean(value, options)}")


def _positive(value: float, where: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}={value}: must be {'>= 0' if allow_zero else '> 0'}")


def validate(cfg: RunConfig) -> None:
    """Checks that need nothing but the config itself."""
    from pipeline.kernels import KERNEL_MODES
    from pipeline.model import SIZE_PRESETS

    m = cfg.model
    if m.size not in SIZE_PRESETS:
        raise ConfigError(f"model.size={m.size!r}: unknown{_did_you_mean(m.size, list(SIZE_PRESETS))}; "
                          f"choose one of {sorted(SIZE_PRESETS)}")
    _choice(m.kernels, KERNEL_MODES, "model.kernels")
    _choice(m.layernorm, LAYERNORM_IMPLS, "model.layernorm")
    for name in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(m, name) < 1.0:
            raise ConfigError(f"model.{name}={getattr(m, name)}: must be in [0, 1)")
    validate_objectives(cfg.objectives, cfg.objective_options)

    d = cfg.data
    _positive(d.global_batch_size, "data.global_batch_size")
    _positive(d.micro_batch_size, "data.micro_batch_size")
    if d.grad_accum is not None:
        _positive(d.grad_accum, "data.grad_accum")
    _positive(d.num_workers, "data.num_workers", allow_zero=True)
    from pipeline.corruption import CorruptionCollator

    check_keywords(CorruptionCollator, d.corruption, "data.corruption", skip=4)  # views, specials, vocab, seed

    o = cfg.optim
    _choice(o.name, OPTIMIZERS, "optim.name")
    _choice(o.impl, OPTIMIZER_IMPLS, "optim.impl")
    _positive(o.lr, "optim.lr")
    _positive(o.eps, "optim.eps")
    _positive(o.weight_decay, "optim.weight_decay", allow_zero=True)
    _positive(o.warmup_steps, "optim.warmup_steps", allow_zero=True)
    _positive(o.grad_clip, "optim.grad_clip", allow_zero=True)
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)}: each must be in [0, 1)")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")

    _choice(cfg.deepspeed.precision, PRECISIONS, "deepspeed.precision")

    t = cfg.train
    for name in ("total_steps", "log_every", "checkpoint_every", "keep_last", "max_nonfinite_steps"):
        _positive(getattr(t, name), f"train.{name}")
    if o.warmup_steps >= t.total_steps and t.total_steps > 1:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be < train.total_steps={t.total_steps}")
    if not t.resume:
        raise ConfigError("train.resume: use 'auto', 'never' or a checkpoint directory")


def validate_objectives(objectives: dict, options: dict) -> None:
    """Registered names, numeric weights, and options that the objective's constructor accepts."""
    import pipeline.objectives  # noqa: F401  (registers every objective)
    from pipeline.objectives.base import OBJECTIVES

    if not objectives:
        raise ConfigError("objectives: at least one objective is required, e.g. objectives={mlm: 1.0}")
    for name, weight in objectives.items():
        if name not in OBJECTIVES:
            raise ConfigError(f"objectives.{name}: unknown objective{_did_you_mean(str(name), list(OBJECTIVES))}; "
                              f"registered: {sorted(OBJECTIVES)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise ConfigError(f"objectives.{name}={weight!r}: the weight must be a number >= 0")
    for name, opts in options.items():
        if name not in objectives:
            raise ConfigError(f"objective_options.{name}: {name!r} is not in objectives ({sorted(objectives)})"
                              f"{_did_you_mean(str(name), list(objectives))}")
        if not isinstance(opts, dict):
            raise ConfigError(f"objective_options.{name}: expected a mapping of keyword options, got {opts!r}")
        check_keywords(OBJECTIVES[name], opts, f"objective_options.{name}", skip=2)


def check_keywords(fn: Any, options: dict, where: str, skip: int = 0) -> None:
    """Error naming `where.key` for any option that `fn` (a class or function) does not accept."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(fn):
        params = params[1:]  # self
    params = params[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in options:
        if key not in names:
            raise ConfigError(f"{where}.{key}: unknown option{_did_you_mean(str(key), names)}; accepted: {names}")


# --------------------------------------------------------------------------------------------
# Stage-2 validation: world size, files, engine
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is split: global = micro x accum x world (the one home of this rule)."""

    micro_batch_size: int
    grad_accum: int
    world_size: int

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


def resolve_engine_file(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".json" or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"deepspeed.config={name_or_path}: no such file")
        return path
    candidate = ENGINE_DIR / f"{name_or_path}.json"
    if not candidate.is_file():
        names = sorted(p.stem for p in ENGINE_DIR.glob("*.json"))
        raise ConfigError(f"deepspeed.config={name_or_path!r}: no {candidate}{_did_you_mean(name_or_path, names)}; "
                          f"available: {names}")
    return candidate


def load_engine_settings(ds: DeepSpeedConfig) -> dict:
    """Engine file + `deepspeed.extra`, checked: valid JSON, no run-owned keys, ZeRO stage 0-3."""
    path = resolve_engine_file(ds.config)
    try:
        engine = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON ({err})") from err
    engine = _deep_merge(engine, ds.extra)
    owned = [k for k in RUN_OWNED_ENGINE_KEYS if k in engine]
    if owned:
        raise ConfigError(f"{path} (+ deepspeed.extra): {owned} belong to the run config (data.*, optim.*, "
                          "deepspeed.precision), not to engine settings; remove them")
    stage = engine.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage={stage!r}; DeepSpeed ZeRO stages are 0, 1, 2, 3")
    return engine


def zero_stage_of(engine: dict) -> int:
    return int(engine.get("zero_optimization", {}).get("stage", 0))


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class RunPlan:
    """Everything `check_run` derived: the batch split, the engine settings, the data identity."""

    batch: BatchPlan
    engine: dict
    zero_stage: int
    manifest: Any  # pipeline.shards.Manifest
    manifest_hash: str


def check_run(cfg: RunConfig, world_size: int, cuda_available: bool) -> RunPlan:
    """Stage-2 checks (before any model is built): batch arithmetic, shards, engine, switches."""
    from pipeline.shards import manifest_hash, read_manifest

    batch = plan_batches(cfg.data, world_size)
    if not cfg.data.shards_dir:
        raise ConfigError("data.shards_dir is required (a directory written by data_prep.build_shards); "
                          "pass data.shards_dir=PATH")
    shards = Path(cfg.data.shards_dir)
    if not shards.is_dir():
        raise ConfigError(f"data.shards_dir={shards}: no such directory")
    try:
        manifest = read_manifest(shards)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"data.shards_dir={shards}: {err}") from err
    missing = [s.name for s in manifest.shards if not (shards / s.name).is_file()]
    if missing:
        raise ConfigError(f"data.shards_dir={shards}: shards listed in manifest.json are missing: {missing[:5]}")
    if cfg.data.seq_len is not None and cfg.data.seq_len != manifest.seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} but the shards in {shards} have seq_len="
                          f"{manifest.seq_len}; rebuild the shards or set data.seq_len={manifest.seq_len}")
    if manifest.total_sequences < batch.global_batch_size:
        raise ConfigError(f"data.global_batch_size={batch.global_batch_size} exceeds the {manifest.total_sequences} "
                          f"sequences in {shards}")
    max_position = cfg.model.max_position or manifest.seq_len
    if max_position < manifest.seq_len:
        raise ConfigError(f"model.max_position={max_position} < shard seq_len={manifest.seq_len}")

    engine = load_engine_settings(cfg.deepspeed)
    stage = zero_stage_of(engine)
    check_objectives_under_stage(cfg.objectives, stage, cfg.deepspeed.config)
    if cfg.deepspeed.precision in ("bf16", "fp16") and not cuda_available:
        raise ConfigError(f"deepspeed.precision={cfg.deepspeed.precision} needs a GPU; use deepspeed.precision=fp32 "
                          "on CPU")
    offload = engine.get("zero_optimization", {})
    if not cuda_available and any(offload.get(k, {}).get("device", "none") != "none"
                                  for k in ("offload_optimizer", "offload_param")):
        raise ConfigError(f"deepspeed.config={cfg.deepspeed.config}: CPU offload needs a GPU run; use zero3 on CPU")
    check_switches(cfg, cuda_available)
    return RunPlan(batch, engine, stage, manifest, manifest_hash(shards))


def check_objectives_under_stage(objectives: dict, stage: int, engine_name: str) -> None:
    """An objective may declare `max_zero_stage` (class attribute) when it cannot run partitioned."""
    from pipeline.objectives.base import OBJECTIVES

    for name in objectives:
        limit = getattr(OBJECTIVES[name], "max_zero_stage", 3)
        if stage > limit:
            raise ConfigError(f"deepspeed.config={engine_name} uses ZeRO stage {stage}, but objective {name!r} "
                              f"supports stages up to {limit}; pick an engine file with stage <= {limit}")


def check_switches(cfg: RunConfig, cuda_available: bool) -> None:
    """Kernels, apex and LAMB switches: usable on this machine, or a clear error."""
    from pipeline.kernels import triton_usable
    from pipeline.optim import apex_available

    if cfg.model.kernels == "triton" and not triton_usable("cuda" if cuda_available else "cpu"):
        raise ConfigError("model.kernels=triton needs Triton on a CUDA device (or TRITON_INTERPRET=1 for CPU "
                          "testing); use model.kernels=auto")
    wants_apex = cfg.optim.impl == "apex" or cfg.model.layernorm == "apex"
    if wants_apex and not (cuda_available and apex_available()):
        raise ConfigError("optim.impl=apex / model.layernorm=apex need NVIDIA apex (built from "
                          "github.com/NVIDIA/apex, never the PyPI package 'apex') on a GPU machine")
    if cfg.optim.name == "lamb" and not cuda_available:
        raise ConfigError("optim.name=lamb needs a GPU (DeepSpeed FusedLamb or apex FusedLAMB); use optim.name=adamw")
    if cfg.optim.impl == "deepspeed" and not cuda_available:
        raise ConfigError("optim.impl=deepspeed (FusedAdam) needs a GPU; use optim.impl=auto or torch")


def build_deepspeed_config(cfg: RunConfig, plan: RunPlan, load_universal: bool = False) -> dict:
    """The final DeepSpeed JSON: engine settings + the run's batch sizes, clipping and precision."""
    out = copy.deepcopy(plan.engine)
    fp16_scaling = {**FP16_LOSS_SCALING, **out.pop("fp16_loss_scaling", {})}
    out.update(
        train_batch_size=plan.batch.global_batch_size,
        train_micro_batch_size_per_gpu=plan.batch.micro_batch_size,
        gradient_accumulation_steps=plan.batch.grad_accum,
        gradient_clipping=cfg.optim.grad_clip,
        zero_allow_untested_optimizer=True,  # torch AdamW on CPU / apex optimizers
        steps_per_print=2**31 - 1,  # our metrics writer logs; keep DeepSpeed quiet
    )
    out["bf16"] = {"enabled": cfg.deepspeed.precision == "bf16"}
    out["fp16"] = {"enabled": cfg.deepspeed.precision == "fp16", **(fp16_scaling if cfg.deepspeed.precision == "fp16"
                                                                    else {})}
    if load_universal:
        out.setdefault("checkpoint", {})["load_universal"] = True
    return out


# --------------------------------------------------------------------------------------------
# Identity of a config for resume checks
# --------------------------------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path in {"model", "data", "optim", "deepspeed", "train"}:
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def resume_relevant(config_dict: dict) -> dict[str, Any]:
    """Flat `section.field -> value` without `RESUME_IGNORED_FIELDS`."""
    return {k: v for k, v in _flatten(config_dict).items() if k not in RESUME_IGNORED_FIELDS}


def config_hash(config_dict: dict) -> str:
    """sha256 of the resume-relevant fields (stable JSON)."""
    blob = json.dumps(resume_relevant(config_dict), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def config_differences(old: dict, new: dict) -> list[str]:
    """Human-readable `field: old -> new` lines for resume-relevant fields that differ."""
    a, b = resume_relevant(old), resume_relevant(new)
    return [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
