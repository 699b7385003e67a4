"""`objective_heads.safetensors`: the objectives' own parameters, and how to rebuild their modules.

Parameters that belong to no `BertForMaskedLM` tensor — CAPT's aggregation MLP, COCO-LM's copy
and SCL heads — are written under their training names (`objectives.<objective>.<module>.*`).
The file's metadata (`pipeline` key, JSON) records everything needed to rebuild them:

    {"version": 1, "objectives": {...}, "objective_options": {...},
     "encoder_config": {...}, "special_tokens": {...},
     "heads": {"capt.aggregation": {"objective": "capt", "module": "aggregation",
                                    "class": "pipeline.objectives.capt.AggregationMLP",
                                    "description": "<first line of the class docstring>",
                                    "structure": "<repr of the module>",
                                    "parameters": {"dense.weight": [F, H], ...}}, ...}}

`load_objective_heads(DIR)` rebuilds each head by constructing its objective exactly as training
did (`pipeline.objectives.registry.build_objective` with the recorded encoder config, special
tokens and options), taking the named submodule, checking its class, and loading the tensors
strictly; it returns `{"capt.aggregation": module, ...}` in eval mode. Without this package, the
class, shapes and structure in the metadata are enough to rebuild a head by hand.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor, nn

OBJECTIVE_HEADS_FILE = "objective_heads.safetensors"
FORMAT_VERSION = 1


class ObjectiveHeadsError(ValueError):
    """An objective-heads file that cannot be rebuilt (names the file and the head)."""


def _class_path(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def describe_heads(model: nn.Module, head_state: Mapping[str, Tensor]) -> dict[str, dict[str, Any]]:
    """`heads` metadata for the tensors of `head_state` (names `objectives.<objective>.<module>.*`)."""
    heads: dict[str, dict[str, Any]] = {}
    for key, value in sorted(head_state.items()):
        _, objective, module, *rest = key.split(".")
        name = f"{objective}.{module}"
        if name not in heads:
            sub = model.get_submodule(f"objectives.{objective}").get_submodule(module) if rest else None
            if sub is None:  # a parameter held directly by the objective
                heads[name] = {"objective": objective, "module": module, "class": "torch.nn.Parameter",
                               "description": "a parameter of the objective", "structure": "", "parameters": {}}
            else:
                doc = (type(sub).__doc__ or "").strip().splitlines()
                heads[name] = {"objective": objective, "module": module, "class": _class_path(sub),
                               "description": doc[0] if doc else "", "structure": repr(sub), "parameters": {}}
        heads[name]["parameters"][".".join(rest)] = list(value.shape)
    return heads


def write_objective_heads(path: str | os.PathLike, model: nn.Module, head_state: Mapping[str, Tensor],
                          meta: Any) -> None:
    """Write the head tensors of `head_state` and their rebuild recipe to `path` (`meta`: the `RunMeta`)."""
    from safetensors.torch import save_file

    from pipeline.export.hf_adapter import contiguous_copies

    info = {
        "version": FORMAT_VERSION,
        "objectives": meta.objectives,
        "objective_options": meta.objective_options,
        "encoder_config": meta.encoder_config,
        "special_tokens": meta.special_tokens,
        "heads": describe_heads(model, head_state),
    }
    save_file(contiguous_copies(dict(head_state)), str(path),
              metadata={"format": "pt", "pipeline": json.dumps(info, sort_keys=True)})


def read_objective_heads(model_dir: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, the `pipeline` metadata) of `model_dir/objective_heads.safetensors`."""
    from safetensors import safe_open

    path = Path(model_dir) / OBJECTIVE_HEADS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (the run's objectives have no parameters outside BERT)")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    try:
        info = json.loads(metadata["pipeline"])
    except (KeyError, json.JSONDecodeError) as err:
        raise ObjectiveHeadsError(f"{path}: no 'pipeline' metadata to rebuild the heads from ({err})") from err
    if info.get("version") != FORMAT_VERSION or "heads" not in info:
        raise ObjectiveHeadsError(f"{path}: written by another version (metadata version {info.get('version')}, "
                                  f"expected {FORMAT_VERSION} with a 'heads' table)")
    return tensors, info


def load_objective_heads(model_dir: str | os.PathLike) -> dict[str, nn.Module]:
    """Every objective head of a converted directory, rebuilt and loaded: `{"capt.aggregation": module}`.

    A parameter held directly by an objective (no objective has one today) comes back as a module
    whose attribute `value` is that parameter."""
    from pipeline.model.arch import encoder_config_from_dict
    from pipeline.objectives.registry import build_objective

    path = Path(model_dir) / OBJECTIVE_HEADS_FILE
    tensors, info = read_objective_heads(model_dir)
    encoder = encoder_config_from_dict(info["encoder_config"])
    options = info.get("objective_options", {})
    built: dict[str, nn.Module] = {}
    heads: dict[str, nn.Module] = {}
    for name, head in sorted(info["heads"].items()):
        objective_name = head["objective"]
        if objective_name not in built:
            built[objective_name] = build_objective(objective_name, encoder, info["special_tokens"],
                                                    options.get(objective_name, {}))
        objective = built[objective_name]
        prefix = f"objectives.{objective_name}.{head['module']}"
        if head["class"] == "torch.nn.Parameter":
            holder = nn.Module()
            holder.value = nn.Parameter(tensors[prefix].clone())
            heads[name] = holder
            continue
        module = objective.get_submodule(head["module"])
        if _class_path(module) != head["class"]:
            raise ObjectiveHeadsError(f"{path}: head {name} was a {head['class']}, this version builds a "
                                      f"{_class_path(module)}")
        state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ObjectiveHeadsError(f"{path}: head {name} does not load into {head['class']}: {err}") from err
        heads[name] = module.eval()
    return heads
