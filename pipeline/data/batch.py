"""The batch contract: what the collator (`pipeline.data.corruption`) puts in a batch and what the
objectives may read from it. One home for the view names, the keys each view adds, the label
ignore index and the special-token sets.

Every batch holds the `original` view's keys; objectives declare the further views they need
(`Objective.views`) and the collator builds exactly the union:

| view          | keys it adds                                   | built as                               |
| ------------- | ---------------------------------------------- | -------------------------------------- |
| `original`    | input_ids, attention_mask, special_mask, word_starts, sample_index, document_ids, content_positions, seqlens | the packed row |
| `masked`      | masked_ids, mlm_labels, mlm_positions          | BERT: 15% selected, 80/10/10           |
| `wwm_masked`  | masked_ids, mlm_labels, mlm_positions          | the same with whole-word selection     |
| `span_masked` | span_masked_ids, span_labels, span_index, span_positions, span_widths | InfoWord n-gram spans |
| `crop`        | crop_ids, crop_attention_mask, crop_seqlens    | COCO-LM contiguous crop, [B, W]: W = longest crop + 2 |
| `shuffled`    | shuffled_ids                                   | CAPT window shuffle                    |

Labels are the original token id at a selected position and `IGNORE_INDEX` elsewhere;
`*_positions` [N] int64 are the flat (row-major into B*L) indices of those positions, computed by
the collator on the host, so no objective needs a `nonzero` (a device sync) to find them;
`content_positions` [M] int64 the flat positions of the content tokens (`content_tokens`: the
candidates of TACO's and BERT-NCE's negatives); `span_index` numbers the spans of a row (-1 outside
spans); `sample_index` is each row's global
stream position (the key of every random draw, `pipeline.seeding`); `document_ids` numbers the
documents of a packed row from 0 (FULL packing ends every document with a `[SEP]`, so a content
token's document is the number of `[SEP]`s before it) and is -1 at structure tokens.

Host keys (`HOST_KEYS`) stay on the CPU when the batch moves to the device (`move_batch`):
`seqlens` / `crop_seqlens` [B] int64 count the real tokens of each row of a right-padded view
(`seqlens_key(mask_key)` names them). The encoder reads them to choose its attention path
without a device sync (`pipeline.model.attention`); a view without them (a batch built by hand,
InfoWord's n-gram view) takes the masked reference path. `span_widths` [B, S] int64 counts the
tokens of span s of row b (0: the row has fewer spans): InfoWord sizes its n-gram pass from it.

Objective plan keys: an objective whose sampling depends on sizes only the data knows offers a
`host_plan` (`Objective.host_plan`), run by the collator on every batch; its keys are prefixed by
the objective (TACO: `taco_anchors`, `taco_anchor_units`, `taco_unit_counts`,
`pipeline.objectives.taco.taco_candidates`). A batch without them (built by hand) still works: the
objective then finds the same indices on the device, at the cost of host reads of device data.

Two special-token sets, each with one job:
  * `STRUCTURE_TOKENS` (pad, cls, sep) mark positions that are not content: they are never
    masked, shuffled, cropped into, used as contrastive anchors or as candidates;
  * `SPECIAL_TOKEN_NAMES` (all five, the manifest's, `pipeline.data.shards`) are never *drawn*: not as a random replacement token, not as a
    sampled negative. ([UNK] and a literal "[MASK]" string are content when they occur in text.)
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch
from torch import Tensor

from pipeline.data.shards import SPECIAL_TOKEN_NAMES

IGNORE_INDEX = -100
STRUCTURE_TOKENS = ("pad", "cls", "sep")

VIEW_KEYS: dict[str, tuple[str, ...]] = {
    "original": ("input_ids", "attention_mask", "special_mask", "word_starts", "sample_index", "document_ids",
                 "content_positions", "seqlens"),
    "masked": ("masked_ids", "mlm_labels", "mlm_positions"),
    "wwm_masked": ("masked_ids", "mlm_labels", "mlm_positions"),
    "span_masked": ("span_masked_ids", "span_labels", "span_index", "span_positions", "span_widths"),
    "crop": ("crop_ids", "crop_attention_mask", "crop_seqlens"),
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
#: attention-mask key -> host key of its rows' real-token counts
SEQLENS_KEYS: dict[str, str] = {"attention_mask": "seqlens", "crop_attention_mask": "crop_seqlens"}
#: labels key -> key of the flat positions it selects
POSITIONS_KEYS: dict[str, str] = {"mlm_labels": "mlm_positions", "span_labels": "span_positions"}
#: keys that stay on the host when a batch moves to the device
HOST_KEYS = frozenset((*SEQLENS_KEYS.values(), "span_widths"))


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


def seqlens_key(mask_key: str) -> str:
    """Name of the host key holding the real-token count per row of the view masked by `mask_key`."""
    return SEQLENS_KEYS.get(mask_key, f"{mask_key}:seqlens")


def positions_key(labels_key: str) -> str:
    """Name of the key holding the flat positions that `labels_key` selects."""
    return POSITIONS_KEYS.get(labels_key, f"{labels_key}:positions")


def move_batch(batch: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """The batch on `device` (non-blocking copies; pinned sources make them asynchronous), except
    `HOST_KEYS`, which stay where the host can read them without a device sync."""
    return {k: v if k in HOST_KEYS else v.to(device, non_blocking=True) for k, v in batch.items()}


def right_padded_lengths(mask) -> Optional[Tensor]:
    """[B] int64 real-token counts of a [B, L] 1/0 mask (numpy or torch, on the host) whose rows are
    a run of ones followed by zeros; None when some row is not (its layout is then not vouched for)."""
    keep = torch.as_tensor(mask).to("cpu", torch.bool)
    lengths = keep.sum(1)
    if not torch.equal(keep, torch.arange(keep.shape[1])[None, :] < lengths[:, None]):
        return None
    return lengths.to(torch.int64)


def selected_positions(labels: Tensor, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(targets [N], flat_positions [N]) of the selected positions (labels != IGNORE_INDEX),
    row-major into the flattened [B*L] batch. `positions` (the collator's `*_positions` key) avoids
    the `nonzero`, which would make the host wait for the device."""
    flat = positions if positions is not None else torch.nonzero(labels.reshape(-1) != IGNORE_INDEX).squeeze(1)
    return labels.reshape(-1)[flat], flat


def batch_selected(batch: Mapping[str, Tensor], labels_key: str) -> tuple[Tensor, Tensor]:
    """`selected_positions` of `batch[labels_key]`, with the collator's positions when the batch has them."""
    return selected_positions(batch[labels_key], batch.get(positions_key(labels_key)))


def gather_selected(hidden: Tensor, labels: Tensor, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of `hidden` [B, L, H] at the selected positions: (hidden [N, H], targets [N], flat [N])."""
    targets, flat = selected_positions(labels, positions)
    return hidden.reshape(-1, hidden.shape[-1])[flat], targets, flat
