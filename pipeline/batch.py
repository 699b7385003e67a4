"""The batch contract: what the collator (`pipeline.data.corruption`) puts in a batch and what the
objectives may read from it. One home for the view names, the keys each view adds, the label
ignore index and the special-token sets.

Every batch holds the `original` view's keys; objectives declare the further views they need
(`Objective.views`) and the collator builds exactly the union:

| view          | keys it adds                                   | built as                               |
| ------------- | ---------------------------------------------- | -------------------------------------- |
| `original`    | input_ids, attention_mask, special_mask, word_starts, sample_index, document_ids | the packed row |
| `masked`      | masked_ids, mlm_labels                         | BERT: 15% selected, 80/10/10           |
| `wwm_masked`  | masked_ids, mlm_labels                         | the same with whole-word selection     |
| `span_masked` | span_masked_ids, span_labels, span_index       | InfoWord n-gram spans                  |
| `crop`        | crop_ids, crop_attention_mask                  | COCO-LM contiguous crop                |
| `shuffled`    | shuffled_ids                                   | CAPT window shuffle                    |

Labels are the original token id at a selected position and `IGNORE_INDEX` elsewhere;
`span_index` numbers the spans of a row (-1 outside spans); `sample_index` is each row's global
stream position (the key of every random draw, `pipeline.seeding`); `document_ids` numbers the
documents of a packed row from 0 (FULL packing ends every document with a `[SEP]`, so a content
token's document is the number of `[SEP]`s before it) and is -1 at structure tokens.

Two special-token sets, each with one job:
  * `STRUCTURE_TOKENS` (pad, cls, sep) mark positions that are not content: they are never
    masked, shuffled, cropped into, used as contrastive anchors or as candidates;
  * `SPECIAL_TOKEN_NAMES` (all five, the manifest's, `pipeline.data.shards`) are never *drawn*: not as a random replacement token, not as a
    sampled negative. ([UNK] and a literal "[MASK]" string are content when they occur in text.)
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor

from pipeline.data.shards import SPECIAL_TOKEN_NAMES

IGNORE_INDEX = -100
STRUCTURE_TOKENS = ("pad", "cls", "sep")

VIEW_KEYS: dict[str, tuple[str, ...]] = {
    "original": ("input_ids", "attention_mask", "special_mask", "word_starts", "sample_index", "document_ids"),
    "masked": ("masked_ids", "mlm_labels"),
    "wwm_masked": ("masked_ids", "mlm_labels"),
    "span_masked": ("span_masked_ids", "span_labels", "span_index"),
    "crop": ("crop_ids", "crop_attention_mask"),
    "shuffled": ("shuffled_ids",),
}
VIEWS = tuple(VIEW_KEYS)

#: view -> (encoder input ids key, attention mask key)
VIEW_INPUTS: dict[str, tuple[str, str]] = {
    "original": ("input_ids", "attention_mask"),
    "masked": ("masked_ids", "attention_mask"),
    "wwm_masked": ("masked_ids", "attention_mask"),
    "span_masked": ("span_masked_ids", "attention_mask"),
    "crop": ("crop_ids", "crop_attention_mask"),
    "shuffled": ("shuffled_ids", "attention_mask"),
}
#: masked view -> its labels key
VIEW_LABELS: dict[str, str] = {"masked": "mlm_labels", "wwm_masked": "mlm_labels", "span_masked": "span_labels"}


def check_views(views: Iterable[str]) -> set[str]:
    """The set of views plus `original`; error on an unknown name or on two views that fill the same keys."""
    out = set(views) | {"original"}
    unknown = sorted(out - set(VIEWS))
    if unknown:
        raise ValueError(f"views: unknown {unknown}; known: {list(VIEWS)}")
    if {"masked", "wwm_masked"} <= out:
        raise ValueError("views: 'masked' and 'wwm_masked' both fill masked_ids/mlm_labels; choose one")
    return out


def choose_view(option: str, view: str, allowed: Iterable[str]) -> str:
    """`view` if it is one of `allowed`, else an error naming the option (`view must be one of ...`)."""
    allowed = tuple(allowed)
    if view not in allowed:
        raise ValueError(f"{option} must be one of {sorted(allowed)}, got {view!r}")
    return view


def masked_view_keys(view: str, allowed: Iterable[str] = tuple(VIEW_LABELS)) -> tuple[str, str]:
    """(input ids key, labels key) of the masked view `view`; an error naming the `view` option otherwise."""
    choose_view("view", view, allowed)
    return VIEW_INPUTS[view][0], VIEW_LABELS[view]


def special_ids(special_tokens: Mapping[str, int], names: Iterable[str] = SPECIAL_TOKEN_NAMES) -> list[int]:
    """Sorted distinct ids of the named special tokens (names a token set lacks are an error)."""
    names = tuple(names)
    missing = [n for n in names if n not in special_tokens]
    if missing:
        raise ValueError(f"special_tokens: missing {missing}")
    return sorted({int(special_tokens[n]) for n in names})


def content_tokens(batch: Mapping[str, Tensor]) -> Tensor:
    """[B, L] bool: real (non-pad) tokens that are not structure tokens — who takes part in contrasts."""
    return batch["attention_mask"].bool() & ~batch["special_mask"].bool()


def selected_positions(labels: Tensor) -> tuple[Tensor, Tensor]:
    """(targets [N], flat_positions [N]) of the selected positions (labels != IGNORE_INDEX),
    row-major into the flattened [B*L] batch."""
    flat = torch.nonzero(labels.reshape(-1) != IGNORE_INDEX).squeeze(1)
    return labels.reshape(-1)[flat], flat


def gather_selected(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of `hidden` [B, L, H] at the selected positions: (hidden [N, H], targets [N], flat [N])."""
    targets, flat = selected_positions(labels)
    return hidden.reshape(-1, hidden.shape[-1])[flat], targets, flat
