"""Load a local tokenizer directory for shard building: special-token ids, vocabulary size, and
the fast (Rust) tokenizer that does the actual encoding.

Any directory `transformers.AutoTokenizer.from_pretrained(dir)` loads offline works (one made
by `data_prep.train_tokenizer`, or a downloaded BERT/RoBERTa one). Encoding goes through the
`tokenizers` object directly, without special tokens (the packer adds `[CLS]`/`[SEP]` itself),
and with `encode_special_tokens` on so a literal "[SEP]" in the text is tokenized as text,
never turned into a real separator.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pipeline.shards import SPECIAL_TOKEN_NAMES


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
        raise ValueError(f"--tokenizer {path}: cannot be loaded with AutoTokenizer ({err})") from err
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"--tokenizer {path}: no fast (Rust) tokenizer available; save it with tokenizer.json")
    ids = {name: getattr(hf, f"{name}_token_id", None) for name in SPECIAL_TOKEN_NAMES}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"--tokenizer {path}: special tokens {missing} are not defined (need {list(SPECIAL_TOKEN_NAMES)})")
    return LoadedTokenizer(path, {k: int(v) for k, v in ids.items()}, len(hf), backend.to_str())


def encoder_from_json(backend_json: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` configured for packing: no truncation, padding or special tokens."""
    tokenizer = Tokenizer.from_str(backend_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = True
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize documents; returns (flat ids int64, flat word-start flags uint8, per-document lengths).

    A token starts a word when its pre-tokenizer word index differs from the previous token's;
    the first token of every document starts a word.
    """
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=total)
    words = np.fromiter((-1 if w is None else w for e in encodings for w in e.word_ids), dtype=np.int64, count=total)
    starts = np.ones(total, dtype=np.uint8)
    if total > 1:
        starts[1:] = words[1:] != words[:-1]
    doc_first = np.cumsum(lengths) - lengths
    starts[doc_first[lengths > 0]] = 1
    return ids, starts, lengths
