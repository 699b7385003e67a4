"""`pipeline_meta.json`: what a checkpoint must say about the run so it can be resumed or converted.

Written by the training loop into every checkpoint tag directory (before the `latest` pointer
moves); read by resume checks, `pipeline.export.convert` and the model card. One home for its fields.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.io import write_atomic

META_FILE = "pipeline_meta.json"
META_VERSION = 1


@dataclass
class RunMeta:
    encoder_config: dict[str, Any]  # pipeline.model.encoder.EncoderConfig fields
    objectives: dict[str, float]  # name -> weight
    objective_options: dict[str, dict[str, Any]]
    special_tokens: dict[str, int]  # pad, cls, sep, mask, unk
    tokenizer_dir: str  # directory loadable with AutoTokenizer (copied beside the shards)
    data_dir: str
    manifest_hash: str
    config_hash: str
    config: dict[str, Any]  # the full resolved training config
    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    zero_stage: int = 0
    world_size: int = 1
    last_metrics: dict[str, float] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)  # held-out set: `pipeline.train.validation.validation_summary`
    base_model: dict[str, Any] = field(default_factory=dict)  # warm start: name, config_sha256, license
    corpus: dict[str, Any] = field(default_factory=dict)  # `corpus_summary` of the shards' manifest
    recipe: dict[str, Any] = field(default_factory=dict)  # preset and overrides (`describe_recipe`)
    mixture: dict[str, Any] = field(default_factory=dict)  # a mixture's read position (`MixtureDataset.record`)
    best: dict[str, Any] = field(default_factory=dict)  # train.keep_best as of this tag (`checkpoint.best_resume`)
    tokenizer_hash: str = ""  # the training shards' `tokenizer_hash` (`hash_directory` of `tokenizer_dir`)
    version: int = META_VERSION

    def write(self, directory: str | os.PathLike) -> Path:
        """Atomic write of `<directory>/pipeline_meta.json`."""
        path = Path(directory) / META_FILE
        write_atomic(path, json.dumps(asdict(self), indent=2, sort_keys=True))
        return path

    @classmethod
    def read(cls, directory: str | os.PathLike) -> "RunMeta":
        path = Path(directory) / META_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; {directory} is not a complete pipeline checkpoint")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}); the checkpoint is corrupt") from err
        if raw.get("version") != META_VERSION:
            raise ValueError(f"{path}: meta version {raw.get('version')} unsupported (expected {META_VERSION})")
        known = set(cls.__dataclass_fields__)
        missing = [k for k in ("encoder_config", "objectives", "special_tokens") if k not in raw]
        if missing:
            raise ValueError(f"{path}: missing fields {missing}")
        return cls(**{k: v for k, v in raw.items() if k in known})


def corpus_summary(manifest: Any) -> dict[str, Any]:
    """What a model card says about the data: source files by name (never a local path), their
    sha256 and documents, and the shards' sequence length and counts."""
    files = [{"name": Path(str(s.get("path", ""))).name, "sha256": s.get("sha256"), "documents": s.get("documents")}
             for s in manifest.sources]
    return {"files": files, "seq_len": manifest.seq_len, "sequences": manifest.total_sequences,
            "tokens": manifest.total_tokens, "packing": manifest.packing}
