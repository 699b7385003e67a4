"""Load a local tokenizer directory for shard building: special-token ids, vocabulary size, and
the serialized fast (Rust) tokenizer that `data_prep.encode.DocumentEncoder` encodes with.

Any directory `transformers.AutoTokenizer.from_pretrained(dir)` loads offline works (one made
by `data_prep.train_tokenizer`, or a downloaded BERT/RoBERTa one).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.shards import SPECIAL_TOKEN_NAMES
from pipeline.tokenizer_checks import TOKENIZER_FILES, tokenizer_files


@dataclass
class LoadedTokenizer:
    directory: Path
    special_tokens: dict[str, int]  # pad, cls, sep, mask, unk -> id
    vocab_size: int
    backend_json: str  # serialized `tokenizers.Tokenizer`, cheap to ship to worker processes


def load_tokenizer(directory: str | os.PathLike) -> LoadedTokenizer:
    """Read a tokenizer directory; a clear error if it does not load or lacks a special token."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"--tokenizer {path}: not a directory")
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        if not tokenizer_files(path):  # the cause, not what transformers then says ("install sentencepiece ...")
            raise ValueError(f"--tokenizer {path}: no tokenizer files in this directory (none of "
                             f"{', '.join(TOKENIZER_FILES)}); pass the directory data_prep.train_tokenizer wrote, "
                             "or a model directory with its tokenizer; nothing was written") from err
        reason = " ".join(str(err).split())  # one line: transformers' messages span several
        raise ValueError(f"--tokenizer {path}: cannot be loaded with AutoTokenizer ({reason})") from err
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"--tokenizer {path}: no fast (Rust) tokenizer available; save it with tokenizer.json")
    ids = {name: getattr(hf, f"{name}_token_id", None) for name in SPECIAL_TOKEN_NAMES}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"--tokenizer {path}: special tokens {missing} are not defined (need {list(SPECIAL_TOKEN_NAMES)})")
    return LoadedTokenizer(path, {k: int(v) for k, v in ids.items()}, len(hf), backend.to_str())
