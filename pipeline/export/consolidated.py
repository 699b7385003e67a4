"""Weights already consolidated by DeepSpeed's `zero_to_fp32.py`, and the README beside checkpoints.

DeepSpeed copies `zero_to_fp32.py` into every checkpoints directory; a user who runs it gets the
training model's own state dict (fused `attention.self.qkv`, objective heads), which no Hugging
Face class loads, and its `--safe_serialization` stops on the tied word-embedding / decoder weight.
`cpt-convert TAG OUT --weights ZERO_TO_FP32_OUTPUT` takes what it wrote instead of consolidating
the ZeRO partitions itself, in every form it writes:

    OUTPUT/pytorch_model.bin                                   (default)
    OUTPUT/pytorch_model-0000i-of-0000n.bin + pytorch_model.bin.index.json   (--max_shard_size)
    OUTPUT/model.safetensors [+ shards + model.safetensors.index.json]       (--safe_serialization,
                                                                  or safetensors' save_model)

or one of those files directly. The tag still gives the run's description (`pipeline_meta.json`:
shape, objectives, tokenizer), which the weights alone do not carry. Names a writer dropped because
they share storage (tied weights, safetensors' `save_model`) are filled from their tie partner.

The README beside the checkpoints (`checkpoints/README.md`), which says how to convert them, is
`pipeline.train.checkpoint.readme`'s (written by the checkpoint writer, which must not import export).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pipeline.safe_load import UnsafeCheckpointError, load_pt


#: The files `zero_to_fp32.py` (and `transformers`' save_pretrained) name their weights with.
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")


def consolidated_files(path: Path) -> list[Path]:
    """The weight files of a `zero_to_fp32.py` output (a directory or one file); [] if it is none."""
    if path.is_file():
        return [path] if path.suffix in (".bin", ".safetensors", ".pt") else []
    if not path.is_dir():
        return []
    for index in INDEX_FILES:
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path / index}: not a weight index (no weight_map: {err})") from err
            return [path / name for name in sorted(set(weight_map.values()))]
    return [path / name for name in WEIGHT_FILES if (path / name).is_file()]


def load_consolidated(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(fp32 state dict, description) of a `zero_to_fp32.py` output; a `ValueError` naming the file
    when it is none or unreadable."""
    files = consolidated_files(path)
    if not files:
        raise ValueError(f"--weights {path}: no {' / '.join(WEIGHT_FILES)} (or their sharded index) there; "
                         "pass the output directory of zero_to_fp32.py")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file}: listed in the weight index but missing")
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                part = load_file(str(file))
            else:
                part = load_pt(file)  # restricted unpickler: a planted pickle is one line naming its global
        except UnsafeCheckpointError as err:
            raise ValueError(str(err)) from None
        except Exception as err:  # safetensors raises many types for a broken file
            raise ValueError(f"{file}: unreadable ({type(err).__name__}: {err})") from err
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ValueError(f"{file}: not a state dict of tensors")
        state.update(part)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    return state, f"fp32 weights consolidated by DeepSpeed's zero_to_fp32.py ({', '.join(f.name for f in files)})"


def fill_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the names of tied parameters that `state` holds under one partner name only."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out = dict(state)
    for names in groups.values():
        present = [n for n in names if n in out]
        for name in names:
            if name not in out and present:
                out[name] = out[present[0]]
    return out


def weights_difference(reference: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    """'' when `state` (fp32 weights from `--weights`) is the checkpoint's own, else what differs.

    `reference` is what the tag itself holds: DeepSpeed's module state (ZeRO 0-2: the full module in
    the training precision, a copy of the fp32 master weights rounded to it) or the fp32 weights
    consolidated from its partitions. Each `state` tensor is cast to the reference's dtype and must
    then be equal bit for bit: round-to-nearest is how the training precision copy was made, so the
    weights of this tag always pass, and another step's (one optimizer update apart changes nearly
    every element by more than a rounding step) do not. A 16-bit copy of the tag's weights
    (`zero_to_torch.py --dtype bfloat16 / float16`) passes too: it equals the reference rounded to
    that precision."""
    common = sorted(k for k in reference if k in state)
    if not common:
        return f"no tensor name in common with the checkpoint (it has e.g. {sorted(reference)[:3]})"
    differing = []
    for key in common:
        ref, value = reference[key].detach(), state[key].detach()
        if tuple(ref.shape) != tuple(value.shape):
            return f"{key} has shape {tuple(value.shape)}, the checkpoint's {tuple(ref.shape)}"
        if not _same_weights(value, ref):
            differing.append((key, float((value.float() - ref.float()).abs().max())))
    if not differing:
        return ""
    key, largest = max(differing, key=lambda item: item[1])
    return (f"{len(differing)} of {len(common)} tensors differ from the checkpoint's own "
            f"(largest: {key}, max |difference| {largest:.3g})")


def _same_weights(value: torch.Tensor, ref: torch.Tensor) -> bool:
    """`value` is `ref`, in `ref`'s precision, or `ref` rounded to 16 bits (bfloat16 or float16)."""
    if torch.equal(value.to(ref.dtype), ref):
        return True
    if not (value.is_floating_point() and ref.is_floating_point()):
        return False
    return any(torch.equal(ref.to(half).to(value.dtype), value) for half in (torch.bfloat16, torch.float16))
