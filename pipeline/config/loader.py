"""Loading a config: presets, `inherit:` chains, dotted overrides, typed construction, `--help-config`.

Generic over the root dataclass (`pipeline.train.run_config.RunConfig`); it knows nothing of the
sections. A preset is a YAML file in `presets/` (or any YAML path). A preset may start with
`inherit: OTHER`: dataclass sections then merge field by field, while mapping-valued fields
(`objectives`, `objective_options`, `data.corruption`, `deepspeed.extra`) are replaced as a whole
by a preset that sets them (so an MLM baseline can drop the contrastive objective of the recipe it
copies); a dotted override sets one key inside them (`objective_options.taco.tau=0.1`). Every
override value is parsed as YAML (`train.total_steps=1000`, `optim.betas=[0.9,0.98]`).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import os
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline.config.checks import ConfigError, did_you_mean

PRESET_DIR = Path(__file__).resolve().parent / "presets"


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


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One settable field: its dotted name, default, docstring and the dataclass that declares it."""

    name: str
    default: Any
    doc: str
    owner: type


def config_fields(root: type) -> list[ConfigField]:
    """Every leaf field of the dataclass `root`, nested sections walked in declaration order (the one
    source of `--help-config` and of the generated reference, `pipeline.config.reference`)."""
    fields: list[ConfigField] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            value = getattr(defaults, f.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), f"{prefix}{f.name}.")
            else:
                fields.append(ConfigField(f"{prefix}{f.name}", value, docs.get(f.name, ""), cls))

    walk(root, "")
    return fields


def describe_config(root: type) -> str:
    """Every field of `root` with its default and docstring, one line each (`--help-config`)."""
    return "\n".join(f"{f.name} = {f.default!r}\n    {f.doc}" for f in config_fields(root))


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
        raise ConfigError(f"--config {name_or_path}: unknown preset{did_you_mean(name_or_path, available_presets())}; "
                          f"presets: {', '.join(available_presets())}")
    return candidate


def yaml_error_line(err: yaml.YAMLError) -> str:
    """A YAML parse error in one line: `line L, column C: problem (context)` (PyYAML's own text spans
    several lines, with a copy of the offending line and a caret)."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"{where}{problem}{f' ({context})' if context else ''}"


def _read_yaml(path: Path) -> dict:
    """The top-level mapping of a config file. An empty file, or one holding only `null`, `0` or a
    list, is an error naming the file: read as `{}` it would train silently on built-in defaults."""
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML at {yaml_error_line(err)}") from err
    if raw is None:
        raise ConfigError(f"{path}: empty config (no settings); a config file is a mapping of sections, e.g. "
                          "`inherit: tiny-mlm` or `train: {total_steps: 100}`")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__} "
                          f"{raw!r:.40}")
    return raw


def load_raw(name_or_path: str, root: type, _seen: tuple[str, ...] = ()) -> dict:
    """The preset as a plain dict with its `inherit:` chain resolved (child wins)."""
    path = resolve_preset(name_or_path)
    if str(path) in _seen:
        raise ConfigError(f"{path}: inheritance cycle {' -> '.join(_seen + (str(path),))}")
    raw = _read_yaml(path)
    parent = raw.pop("inherit", None)
    raw.setdefault("name", path.stem)
    if parent is None:
        return raw
    base = load_raw(str(parent), root, _seen + (str(path),))
    base.pop("name", None)
    return _merge(base, raw, root)


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


def apply_override(raw: dict, override: str, root: type) -> None:
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
    cls: Optional[type] = root
    node = raw
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if cls is not None:
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                raise ConfigError(f"override {key}: unknown key {where!r}{did_you_mean(part, names)}")
            sub = typing.get_type_hints(cls)[part]
            cls = sub if dataclasses.is_dataclass(sub) else None  # inside a mapping field: free keys
        if isinstance(node, list):  # an item of a list field by its index (`phases.1.shards_dir=DIR`)
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key}: {where}: the list has items 0..{len(node) - 1}; {part!r} is none")
            part = int(part)  # type: ignore[assignment]
        if i == len(parts) - 1:
            node[part] = value
        else:
            nxt = node[part] if isinstance(node, list) else node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, (dict, list)):
                raise ConfigError(f"override {key}: {where} is {nxt!r}, not a mapping")
            node = nxt


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert one value against a field type (int, float, bool, str, Optional, tuple, list, dict)."""
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
    elif origin is list:  # any length; a bare string is a one-item list (`train.trackers=wandb`)
        (item,) = typing.get_args(tp)
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(f"{where}: expected a list, got {value!r}")
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
            raise ConfigError(f"unknown config key {where}{key!r}{did_you_mean(str(key), names)}; "
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
