"""Held-out documents: which documents of a corpus go to the validation shard set.

    python -m data_prep.build_shards --input corpus/ --tokenizer tok/ --out shards/ --holdout-fraction 0.05
    # -> shards/ (training) and shards/validation/ (held out), each a complete shard directory

The decision is per *document*, never per row, so no document has tokens in both sets (with
`--packing full` a training row joins several documents; each of them is on the training side):

    held out  <=>  xxh3_64(utf-8 text of the document) < fraction x 2^64

A function of the document's text alone: the same documents are held out whatever the input order,
the number of files, `--num-proc` or a resumed build, and identical documents (duplicates) always land
on the same side, so a duplicated document cannot leak into validation. Empty documents are skipped
by both builds alike. The training build and the validation build read the same inputs with opposite
sides of the rule (`DocumentSplit.side`), each with its own manifest, fingerprint and resume state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from data_prep.readers import InputError

SIDES = ("train", "validation")
#: The validation set's directory inside the training build's `--out` unless `--holdout-dir` names one.
DEFAULT_SUBDIR = "validation"


def holdout_hash(text: str) -> int:
    """The document's 64-bit xxh3 hash (surrogates kept, so any decoded text hashes)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class EmptySide(InputError):
    """Every non-empty document fell on the other side of the rule: `side` ("train" / "validation") has none."""

    def __init__(self, message: str, side: str) -> None:
        super().__init__(message)
        self.side = side


@dataclass(frozen=True)
class DocumentSplit:
    """One side of the held-out rule (module doc): `fraction` of the documents are held out."""

    fraction: float
    side: str

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"--holdout-fraction {self.fraction}: must be in (0, 1), e.g. 0.05")
        if self.side not in SIDES:
            raise ValueError(f"holdout side {self.side!r}: one of {SIDES}")

    def keeps(self, text: str) -> bool:
        """Does this side's build pack the (non-empty) document `text`?"""
        held = holdout_hash(text) < int(self.fraction * 2**64)
        return held if self.side == "validation" else not held

    def nothing_on_this_side(self, other_side: int, inputs: str) -> EmptySide:
        """The error of a build of this side that found no document: all `other_side` went to the other."""
        count = f"{other_side} non-empty document(s) of --input {inputs}"
        if self.side == "validation":
            return EmptySide(f"--holdout-fraction {self.fraction:g}: none of the {count} is held out (whole documents "
                             "are held out by the hash of their text, data_prep.holdout); give more documents or a "
                             "larger fraction", self.side)
        return EmptySide(f"--holdout-fraction {self.fraction:g}: all {count} are held out, none is left to train on "
                         "(whole documents, by the hash of their text, data_prep.holdout); give more documents or a "
                         "smaller fraction", self.side)

    def record(self) -> dict[str, Any]:
        """What the build's fingerprint and manifest record of the split."""
        return {"fraction": self.fraction, "side": self.side, "rule": "xxh3_64(text) < fraction * 2^64"}
