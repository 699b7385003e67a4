"""Pack tokenized documents into fixed-length `[CLS] ... [SEP]` sequences.

Two modes:
  full  RoBERTa FULL-SENTENCES: documents are joined into one stream with a `[SEP]` after each,
        and the stream is cut every `seq_len - 2` tokens; only the very last sequence is padded.
        A sequence never starts with the joining `[SEP]` (it already starts with `[CLS]`).
  doc   every document starts a new sequence; a document's last piece is padded.

The packer's whole state is its token buffer (`state()` / `from_state()`), so a build can stop
after any shard and resume exactly. The first content token of every sequence is marked as a word
start, so whole-word masking never sees a word fragment without a start.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

PACKING_MODES = ("full", "doc")


class Packer:
    def __init__(self, seq_len: int, cls_id: int, sep_id: int, pad_id: int, mode: str = "full") -> None:
        if mode not in PACKING_MODES:
            raise ValueError(f"--packing {mode!r}: expected one of {PACKING_MODES}")
        if seq_len < 3:
            raise ValueError(f"--seq-len {seq_len}: must be at least 3 ([CLS], one token, [SEP])")
        self.seq_len, self.mode = seq_len, mode
        self.cls_id, self.sep_id, self.pad_id = cls_id, sep_id, pad_id
        self.content = seq_len - 2
        self._ids = np.zeros(0, dtype=np.int64)
        self._starts = np.zeros(0, dtype=np.uint8)
        self._is_joiner = np.zeros(0, dtype=bool)  # True at the [SEP]s this packer inserted between documents
        self._pos = 0

    def add_document(self, ids: np.ndarray, word_starts: np.ndarray) -> None:
        """Append one tokenized document (non-empty) to the buffer."""
        pieces_ids = [self._ids[self._pos :], ids]
        pieces_starts = [self._starts[self._pos :], word_starts]
        pieces_joiner = [self._is_joiner[self._pos :], np.zeros(len(ids), dtype=bool)]
        if self.mode == "full":
            pieces_ids.append(np.array([self.sep_id]))
            pieces_starts.append(np.zeros(1, dtype=np.uint8))
            pieces_joiner.append(np.ones(1, dtype=bool))
        self._ids = np.concatenate(pieces_ids)
        self._starts = np.concatenate(pieces_starts).astype(np.uint8, copy=False)
        self._is_joiner = np.concatenate(pieces_joiner)
        self._pos = 0

    def _skip_leading_joiner(self) -> None:
        if self._pos < len(self._ids) and self._is_joiner[self._pos]:
            self._pos += 1

    def ready(self) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """Yield every sequence that is complete now: (ids [seq_len], word_starts [seq_len], length)."""
        while True:
            self._skip_leading_joiner()
            available = len(self._ids) - self._pos
            if available == 0 or (self.mode == "full" and available < self.content):
                return
            yield self._cut(min(available, self.content))

    def finish(self) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """Yield what is left (the last, padded sequence) once no documents follow."""
        yield from self.ready()
        self._skip_leading_joiner()
        if len(self._ids) - self._pos > 0:
            yield self._cut(len(self._ids) - self._pos)

    def _cut(self, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        starts = np.zeros(self.seq_len, dtype=np.uint8)
        ids[0], ids[n + 1] = self.cls_id, self.sep_id
        ids[1 : n + 1] = self._ids[self._pos : self._pos + n]
        starts[1 : n + 1] = self._starts[self._pos : self._pos + n]
        starts[1] = 1  # a word cut at the previous sequence boundary starts again here
        self._pos += n
        return ids, starts, n + 2

    def state(self) -> dict[str, Any]:
        """JSON-able buffer contents (tokens not yet emitted)."""
        return {
            "ids": self._ids[self._pos :].tolist(),
            "word_starts": self._starts[self._pos :].tolist(),
            "joiner": np.flatnonzero(self._is_joiner[self._pos :]).tolist(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self._ids = np.asarray(state["ids"], dtype=np.int64)
        self._starts = np.asarray(state["word_starts"], dtype=np.uint8)
        self._is_joiner = np.zeros(len(self._ids), dtype=bool)
        self._is_joiner[np.asarray(state["joiner"], dtype=np.int64)] = True
        self._pos = 0
