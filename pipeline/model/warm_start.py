"""`model.init_from=DIR`: start pretraining from a local Hugging Face BERT directory (warm start).

With `model.arch=modernbert` DIR is a Hugging Face ModernBERT directory instead (`ModernBertForMaskedLM`
or `ModernBertModel` weights, `model_type: modernbert`); its names and config.json fields are mapped by
`pipeline.model.hf_names`, everything else below applies unchanged.

Continued, domain-adaptive pretraining starts from an existing BERT. `DIR` is any local Hugging
Face BERT directory: `config.json`, the weights of a `BertForMaskedLM`, `BertForPreTraining` or
`BertModel` (`model.safetensors`, `pytorch_model.bin`, or their sharded `*.index.json` forms) and
its tokenizer. Nothing is downloaded.

* shape: the encoder's shape comes from `DIR/config.json` (`ModelConfig.encoder_config` reads it
  with `base_encoder_fields`); `model.size` is then ignored and a shape override must agree;
* data: the shards must be built with DIR's tokenizer (`python -m data_prep.build_shards
  --tokenizer DIR`); the shards' `tokenizer/` is compared with DIR's (vocabulary, special-token
  ids, normaliser, pre-tokeniser, post-processor), so a tokenizer-only copy of DIR works too;
* weights: `bert.*` (embeddings and layers) and, when the checkpoint has it, the MLM head
  `cls.predictions.*` are loaded through `pipeline.model.hf_names.from_hf` (the one home of the
  name mapping). The objectives' own heads (and the MLM head of a `BertModel` checkpoint) keep
  the initialisation a run without `init_from` gives them from the run seed; the pooler and the
  next-sentence head have no counterpart here and are not read.

`check_base_model` runs in `check_run`, before any compute, and every mismatch is a `ConfigError`
naming the file and field. `load_base_weights` runs inside the one constructor
(`pipeline.pretrain.build.build_pretrain_model`), before DeepSpeed wraps the model, identically on
every rank. A run that resumes from a checkpoint never reads the weights: the checkpoint wins.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from pipeline.safe_load import UnsafeCheckpointError, load_pt
from pipeline.config.checks import ConfigError
from pipeline.data.shards import SPECIAL_TOKEN_NAMES, TOKENIZER_SUBDIR, Manifest
from pipeline.io import sha256_file
from pipeline.model.arch import AnyEncoderConfig, build_encoder_and_head
from pipeline.model.encoder import EncoderConfig
from pipeline.model.hf_names import (
    HF_CONFIG_FIELDS,
    encoder_fields_from_hf,
    from_hf,
    from_modernbert_hf,
    modernbert_fields_from_hf,
)
from pipeline.model.modernbert import ModernBertConfig, is_modernbert
from pipeline.tokenizer_checks import no_tokenizer_message

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
#: Looked for in this order; an `.index.json` names the shard files of a sharded checkpoint.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: `EncoderConfig` fields a config.json must set (the rest have BERT's defaults).
REQUIRED_SHAPE = ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position")


def read_base_config(directory: str | os.PathLike, arch: str = "bert") -> dict[str, Any]:
    """`DIR/config.json`, checked to describe a BERT (`arch=modernbert`: a ModernBERT) this encoder implements exactly."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"model.init_from={directory}: not a directory (expected a local Hugging Face BERT "
                          "directory with config.json, weights and tokenizer)")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(f"{file}: missing; model.init_from must be a Hugging Face model directory")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type != arch:
        hint = f"; set model.arch={model_type}" if model_type in ("bert", "modernbert") else ""
        name = "ModernBERT" if arch == "modernbert" else "BERT"
        raise ConfigError(f"{file}: model_type={model_type!r}; model.init_from takes {name} checkpoints "
                          f"(model_type {arch!r}) only with model.arch={arch}{hint}")
    if arch == "modernbert":
        return _read_modernbert_config(raw, file)
    checks = (("hidden_act", "gelu", "the encoder implements exact (erf) GELU, Hugging Face's 'gelu'"),
              ("position_embedding_type", "absolute", "only absolute position embeddings are implemented"),
              ("tie_word_embeddings", True, "the MLM head's output projection is tied to the word embeddings"))
    for key, wanted, why in checks:
        if raw.get(key, wanted) != wanted:
            raise ConfigError(f"{file}: {key}={raw[key]!r} is not supported ({why})")
    fields = encoder_fields_from_hf(raw)
    missing = [HF_CONFIG_FIELDS[k] for k in REQUIRED_SHAPE if k not in fields]
    if missing:
        raise ConfigError(f"{file}: missing {missing}")
    try:
        EncoderConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{file}: {err}") from err
    return raw


def _read_modernbert_config(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    try:
        fields = modernbert_fields_from_hf(raw, str(file))
        missing = [k for k in REQUIRED_SHAPE if k not in fields]
        if missing:
            raise ValueError(f"{file}: missing the fields of {missing}")
        ModernBertConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err) if str(file) in str(err) else f"{file}: {err}") from err
    return raw


def base_encoder_fields(directory: str | os.PathLike, arch: str = "bert") -> dict[str, Any]:
    """The encoder config fields of the BERT (or ModernBERT) in `directory` (from its config.json)."""
    raw = read_base_config(directory, arch)
    if arch == "modernbert":
        return modernbert_fields_from_hf(raw, str(Path(directory) / CONFIG_FILE))
    return encoder_fields_from_hf(raw)


def _from_hf(encoder: AnyEncoderConfig, hf_state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Hugging Face names -> ours for the encoder's family (`model.arch`)."""
    if not is_modernbert(encoder):
        return from_hf(hf_state)
    try:
        return from_modernbert_hf(hf_state)
    except ValueError as err:
        raise ConfigError(f"model.init_from: {err}") from err


def describe_base(directory: str | os.PathLike) -> dict[str, Any]:
    """What the run records about its base model (`RunMeta.base_model`): the directory's name, the
    sha256 of its config.json and the license its model card declares. No local path."""
    path = Path(directory).resolve()
    return {"name": path.name, "config_sha256": sha256_file(path / CONFIG_FILE), "license": card_license(path)}


def card_license(directory: Path) -> str | None:
    """The `license:` of the YAML front matter of `directory/README.md`, if any."""
    import yaml

    readme = directory / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    try:
        front = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return None
    value = front.get("license") if isinstance(front, dict) else None
    return str(value) if value else None


# ---- the tokenizer ---------------------------------------------------------------------------


def _load_tokenizer(directory: Path, where: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types for an unusable directory
        raise ConfigError(f"{where}: no tokenizer loadable with AutoTokenizer ({type(err).__name__}: {err})") from err


def tokenizer_difference(a, b) -> str:
    """'' when two tokenizers split and number text identically, else what differs."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differing = len(set(va.items()) ^ set(vb.items())) // 2 or abs(len(va) - len(vb))
        return f"vocabularies differ: {len(va)} vs {len(vb)} entries, about {differing} token ids differ"
    for name in SPECIAL_TOKEN_NAMES:
        ia, ib = getattr(a, f"{name}_token_id", None), getattr(b, f"{name}_token_id", None)
        if ia != ib:
            return f"{name} token id {ia} vs {ib}"
    ja, jb = (json.loads(t.backend_tokenizer.to_str()) if getattr(t, "backend_tokenizer", None) else {} for t in (a, b))
    for part in ("normalizer", "pre_tokenizer", "post_processor", "model"):
        if ja.get(part) != jb.get(part):
            return f"same vocabulary, different {part} settings"
    return ""


def check_tokenizer(directory: str | os.PathLike, shards_dir: str | os.PathLike) -> None:
    """The shards were tokenized with DIR's tokenizer (their `tokenizer/` copy equals it)."""
    data_tok = Path(shards_dir) / TOKENIZER_SUBDIR
    rebuild = f"rebuild them with `python -m data_prep.build_shards --tokenizer {directory} ...`"
    if not data_tok.is_dir():
        raise ConfigError(f"data.shards_dir={shards_dir}: no {TOKENIZER_SUBDIR}/ to compare with model.init_from's "
                          f"tokenizer; {rebuild}")
    missing = no_tokenizer_message(directory)
    if missing:  # AutoTokenizer would build a 5-token placeholder, blamed on the shards as "vocabularies differ"
        raise ConfigError(f"model.init_from={missing}; copy the base model's tokenizer files into it (shards built "
                          "with the placeholder would be all [UNK])")
    base = _load_tokenizer(Path(directory), f"model.init_from={directory}")
    data = _load_tokenizer(data_tok, f"data.shards_dir={shards_dir}")
    difference = tokenizer_difference(base, data)
    if difference:
        raise ConfigError(f"data.shards_dir={shards_dir} was built with another tokenizer than model.init_from="
                          f"{directory} ({difference}); {rebuild}")


# ---- the weights -----------------------------------------------------------------------------


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The weight file(s) of DIR: the first of `WEIGHT_FILES` present (an index: its shards)."""
    path = Path(directory)
    for name in WEIGHT_FILES:
        file = path / name
        if not file.is_file():
            continue
        if not name.endswith(".index.json"):
            return [file]
        try:
            weight_map = json.loads(file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{file}: not a weight index (no weight_map: {err})") from err
        shards = [path / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in shards if not p.is_file()]
        if absent:
            raise ConfigError(f"{file}: names shard files that are missing: {absent[:5]}")
        return shards
    raise ConfigError(f"model.init_from={directory}: no PyTorch weights (looked for {', '.join(WEIGHT_FILES)}); "
                      "save the model with save_pretrained")


def read_weight_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor of DIR's weights: a `ConfigError` naming a missing, truncated or
    otherwise unreadable weight file before anything loads it (`model.init_from`, fine-tuning)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(directory):
        shapes.update(_read(file, shapes_only=True))
    return shapes


def _read(file: Path, shapes_only: bool) -> dict[str, Any]:
    """{name: tensor} (or {name: shape}) of one weight file; a ConfigError naming it if unreadable."""
    try:
        if file.name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) if shapes_only else f.get_tensor(k) for k in f.keys()}
        try:  # memory-mapped: reading the names and shapes does not read the tensors
            state = load_pt(file, mmap=True)
        except UnsafeCheckpointError as err:  # files of torch's legacy (pre-zip) format cannot be mapped
            if "mmap" not in str(err):
                raise
            state = load_pt(file)
    except UnsafeCheckpointError as err:  # the restricted unpickler's one line names the file and the global
        raise ConfigError(str(err)) from None
    except Exception as err:  # safetensors raises many types for a broken file
        raise ConfigError(f"{file}: unreadable weights ({type(err).__name__}: {err})") from err
    if not isinstance(state, Mapping):
        raise ConfigError(f"{file}: not a state dict")
    return {k: tuple(v.shape) if shapes_only else v for k, v in state.items() if isinstance(v, Tensor)}


def expected_shapes(encoder: AnyEncoderConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(our `bert.*` / `cls.*` state-dict names -> shapes, the names of distinct tensors) for `encoder`;
    the second leaves out aliases of tied weights. Built on the meta device: no memory, no init cost."""
    with torch.device("meta"):
        parts = nn.Module()
        parts.bert, parts.cls = build_encoder_and_head(encoder)
    shapes = {k: tuple(v.shape) for k, v in parts.state_dict().items()}
    return shapes, {k for k, _ in parts.named_parameters()} | {k for k, _ in parts.named_buffers()}


_CLASSES = {False: "BertModel / BertForMaskedLM", True: "ModernBertModel / ModernBertForMaskedLM"}


def check_weights(directory: str | os.PathLike, encoder: AnyEncoderConfig) -> None:
    """Every encoder tensor is in DIR's weights with the shape config.json implies (MLM head: all or none)."""
    files = weight_files(directory)
    shapes = read_weight_shapes(directory)
    ours, _ = _from_hf(encoder, {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    expected, distinct = expected_shapes(encoder)
    where = ", ".join(str(f) for f in files)
    head = [k for k in sorted(distinct) if k.startswith("cls.")]  # (the tied projection is the embeddings)
    missing = [k for k in expected if k.startswith("bert.") and k not in ours]
    if any(k in ours for k in head):
        missing += [k for k in head if k not in ours]
    if missing:
        raise ConfigError(f"{where}: missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                          f"model.init_from needs a complete {_CLASSES[is_modernbert(encoder)]} checkpoint")
    unexpected = sorted(k for k in ours if k not in expected)
    if unexpected:
        raise ConfigError(f"{where}: tensors {unexpected[:8]} have no place in a "
                          f"{'ModernBERT' if is_modernbert(encoder) else 'BERT'} encoder")
    for key, value in sorted(ours.items()):
        if tuple(value.shape) != expected[key]:
            raise ConfigError(f"{where}: {key} has shape {tuple(value.shape)} but {Path(directory) / CONFIG_FILE} "
                              f"implies {expected[key]}")


def check_base_model(directory: str | os.PathLike, manifest: Manifest, shards_dir: str | os.PathLike,
                     encoder: AnyEncoderConfig, fresh_start: bool) -> None:
    """Stage-2 checks of `model.init_from` (config.json was checked by `ModelConfig.encoder_config`):
    the shards' tokenizer, and — for a fresh start, the only time they are read — the weights."""
    check_tokenizer(directory, shards_dir)
    if fresh_start:
        check_weights(directory, encoder)


def load_base_weights(model: nn.Module, directory: str | os.PathLike) -> dict[str, Any]:
    """Copy DIR's BERT weights into `model` (a `PretrainModel`): `bert.*`, and `cls.*` when present.

    Returns what was done: files, how many tensors, whether the MLM head was loaded, HF tensors
    not used (pooler, next-sentence head, position-id buffer)."""
    files = weight_files(directory)
    hf_state: dict[str, Tensor] = {}
    for file in files:
        hf_state.update(_read(file, shapes_only=False))
    state, unused = _from_hf(model.config, hf_state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    not_loaded = [k for k in missing if k.startswith("bert.")]
    if unexpected or not_loaded:  # check_weights ran before; this is a directory changed since
        raise ConfigError(f"model.init_from={directory}: weights do not fit the model "
                          f"(unexpected {unexpected[:8]}, missing {not_loaded[:8]})")
    head = "loaded" if any(k.startswith("cls.") for k in state) else "fresh (the checkpoint has no MLM head)"
    log.info("warm start from %s: %d tensors from %s; MLM head %s; objective heads fresh; not used: %s",
             directory, len(state), ", ".join(f.name for f in files), head, unused or "nothing")
    return {"files": [f.name for f in files], "tensors": len(state), "mlm_head": head, "unused": unused}
