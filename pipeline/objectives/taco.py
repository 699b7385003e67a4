"""`taco`: TACO's token-alignment contrastive loss (Fu et al. 2022, "Contextual Representation
Learning beyond Masked Language Modeling", Eq. 3 and 6-8).

Global bias of token j of sequence i: g_j^i = h_j^i - e_j^i (last hidden state minus the
embedding-layer output of the same input; the public code's `hidden_states[-1] - hidden_states[0]`).
For every participating token x (anchor):
  - one positive c sampled uniformly from the same context within the window W (|j_c - j| <= W//2,
    j_c != j), restricted to participating-eligible positions, hence clipped at the sequence ends;
  - K negatives sampled uniformly from the eligible tokens of *other* contexts in the micro-batch.

Context = document. The paper defines "tokens in the same context as positive pairs and tokens in
different contexts as negative pairs" (Sec. 1) and samples positives "from nearby tokens in the
same context (sequence)" and negatives "from other sequences in this batch" (Sec. 3.2): its
sequences are single contexts. A FULL-packed row joins several documents (`document_ids`), so:
  - the positive stays inside the anchor's document (never across the joining [SEP]);
  - negatives are tokens of *other documents* — of other rows and of the other documents of the
    anchor's own row (they are different contexts even though the encoder attended across them),
    uniform over all such tokens (`negative_unit="document"`, default). `negative_unit="row"`
    keeps the row as the unit (same-row documents are never negatives; positives still stay
    inside their document). With `--packing doc` (one document per row) the two are identical.
  A document cut at a row boundary counts as two documents (rows do not know their neighbours;
  rows of one micro-batch come from a random permutation, so two pieces of one document rarely
  meet in one micro-batch).

    L_TC = mean_x -log( e^{f(g_x, g_c)} / (e^{f(g_x, g_c)} + sum_k e^{f(g_x, g_k^-)}) ),
    f(a, b) = cos(a, b) / tau

At chance (every similarity equal) L_TC = ln(1 + K): logged as `loss_chance` on logged steps
(`pipeline.monitor.signals` calls the term learned at <= 0.85x it).

Defaults (paper Sec. 4.1, Table 5): W=5, K=50, tau=0.07; positives/negatives detached (public
reference code): the gradient flows through the anchors only. The paper's recipe is
`objectives: {mlm: 1, taco: 1}`; with the default `view="masked"` MLM and TACO share one pass.

*Choices* (configurable):
  - view: which input is encoded ("masked" default, "wwm_masked", "original");
  - anchors: which tokens are anchors: "all" (default: every non-special, non-pad token, masked
    ones included), "masked" (only MLM-selected positions), "unmasked" (only the others);
    positives and negatives are always drawn from all non-special, non-pad tokens;
  - negative_unit: "document" (default) or "row", see above;
  - anchors without an eligible neighbour of their document in the window (one-token documents)
    are skipped;
  - max_anchors: optional cap on anchors per micro-batch (uniform subsample of the anchors that
    have a positive; None = all).

Host/device split: `taco_candidates` (which anchors, the negative blocks: sizes that depend on the
data) runs in the collator (`TacoPlan`, `Objective.host_plan`); the step only draws with static
shapes (`draw_taco_indices`), so it never makes the host wait for the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

from pipeline.data.batch import IGNORE_INDEX, VIEW_INPUTS, choose_view, content_tokens
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register, scalar_metric
from pipeline.objectives.sampling import document_groups, sample_outside_blocks, sample_window_positives

TACO_VIEWS = ("masked", "wwm_masked", "original")
ANCHOR_SETS = ("all", "masked", "unmasked")
NEGATIVE_UNITS = ("document", "row")


#: The batch keys `TacoPlan` adds (flat positions are row-major into B*L; see `pipeline.data.batch`).
PLAN_KEYS = ("taco_anchors", "taco_anchor_units", "taco_unit_counts")


def taco_candidates(
    eligible: Tensor,
    anchors: Tensor,
    window: int,
    documents: Optional[Tensor] = None,
    negative_unit: str = "document",
) -> dict[str, Tensor]:
    """The data-dependent part of TACO's sampling, with no randomness: which anchors can have a
    positive, and the blocks negatives are drawn around. Built by the collator on the host
    (`TacoPlan`), so the step never asks the device for a size; on device tensors it is the
    fallback for hand-built batches (it then reads device data: `nonzero`, `unique_consecutive`).

    eligible [B, L] bool, anchors [B, L] bool, documents [B, L] (`document_ids`; None: one per row).
    Returns `PLAN_KEYS` plus `content_positions`:
      taco_anchors [N] flat positions of the anchors that have an eligible neighbour of their own
        document within the window (the others are skipped: a one-token document has no positive);
      taco_unit_counts [G] tokens per negative unit (document or row, numbered row-major over the
        units that hold an eligible token); taco_anchor_units [N] each anchor's unit;
      content_positions [M] flat positions of the eligible tokens (the candidate list, whose unit
        blocks are contiguous and ascending).
    """
    if negative_unit not in NEGATIVE_UNITS:
        raise ValueError(f"negative_unit must be one of {NEGATIVE_UNITS}, got {negative_unit!r}")
    half, length = window // 2, eligible.shape[1]
    rows, cols = torch.nonzero(anchors & eligible, as_tuple=True)
    same_doc = documents if documents is not None else torch.zeros_like(eligible, dtype=torch.long)
    usable = torch.zeros_like(rows, dtype=torch.bool)
    for offset in [*range(-half, 0), *range(1, half + 1)]:
        other = cols + offset
        inside = (other >= 0) & (other < length)
        clamped = other.clamp(0, length - 1)
        usable |= inside & eligible[rows, clamped] & (same_doc[rows, clamped] == same_doc[rows, cols])
    units = document_groups(eligible, documents if negative_unit == "document" else None).reshape(-1)
    pool = torch.nonzero(eligible.reshape(-1)).squeeze(1)
    num_units = int(units.max()) + 1 if units.numel() else 0
    counts = torch.zeros(max(num_units, 0), dtype=torch.long, device=eligible.device)
    counts.scatter_add_(0, units[pool], torch.ones_like(pool))
    flat = (rows * length + cols)[usable]
    return {"taco_anchors": flat, "taco_anchor_units": units[flat], "taco_unit_counts": counts,
            "content_positions": pool}


def anchor_mask(batch: Mapping[str, Tensor], anchor_set: str) -> tuple[Tensor, Tensor]:
    """(eligible, anchors) [B, L] bool of a batch for the `anchors` option (see the module docstring)."""
    eligible = content_tokens(batch)
    if anchor_set == "all":
        return eligible, eligible
    selected = batch["mlm_labels"] != IGNORE_INDEX
    return eligible, eligible & (selected if anchor_set == "masked" else ~selected)


@dataclass(frozen=True)
class TacoPlan:
    """The host half of TACO's sampling, run by the collator (worker processes) on each micro-batch:
    `taco_candidates` of the collated batch. Picklable (plain options), so DataLoader workers run it."""

    window: int
    anchors: str
    negative_unit: str

    def __call__(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        eligible, anchors = anchor_mask(batch, self.anchors)
        return taco_candidates(eligible, anchors, self.window, batch["document_ids"], self.negative_unit)


def draw_taco_indices(
    eligible: Tensor,
    candidates: Mapping[str, Tensor],
    window: int,
    num_negatives: int,
    generator: torch.Generator,
    max_anchors: Optional[int] = None,
    documents: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The random half of TACO's sampling, on the device with static shapes (no host read): the
    optional uniform subsample of `max_anchors` usable anchors, one positive per anchor inside its
    document's window, `num_negatives` uniform draws from the other units' tokens.

    eligible [B, L] bool; candidates: `taco_candidates`' keys. Returns flat indices into B*L:
    anchor_idx [N], positive_idx [N], negative_idx [N, K].
    """
    length = eligible.shape[1]
    flat, units = candidates["taco_anchors"], candidates["taco_anchor_units"]
    if max_anchors is not None and flat.numel() > max_anchors:
        keep = torch.randperm(flat.numel(), generator=generator, device=flat.device)[:max_anchors].sort().values
        flat, units = flat[keep], units[keep]
    if flat.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=eligible.device)
        return empty, empty, empty.reshape(0, num_negatives)
    rows, cols = flat // length, flat % length
    pos_cols, _ = sample_window_positives(eligible, rows, cols, window, generator, documents)
    pool = candidates["content_positions"]
    pick = sample_outside_blocks(candidates["taco_unit_counts"], units, pool.numel(), num_negatives, generator)
    return flat, rows * length + pos_cols, pool[pick]


def sample_taco_indices(
    eligible: Tensor,
    anchors: Tensor,
    window: int,
    num_negatives: int,
    generator: torch.Generator,
    max_anchors: Optional[int] = None,
    documents: Optional[Tensor] = None,
    negative_unit: str = "document",
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample TACO's anchors, positives and negatives (`taco_candidates` then `draw_taco_indices`).

    eligible [B, L] bool: tokens that may be positives/negatives; anchors [B, L] bool (subset of
    eligible); documents [B, L] int64 (`document_ids`; None = one document per row). Positives stay
    inside the anchor's document; negatives come from other documents (`negative_unit="document"`)
    or other rows ("row"). `max_anchors` subsamples among the anchors that have a positive. Returns
    flat indices into B*L: anchor_idx [N], positive_idx [N], negative_idx [N, K].
    """
    candidates = taco_candidates(eligible, anchors, window, documents, negative_unit)
    return draw_taco_indices(eligible, candidates, window, num_negatives, generator, max_anchors, documents)


@register
class TokenAlignmentContrastive(Objective):
    """TACO's TC loss (see the module docstring for formula, defaults and choices)."""

    name = "taco"
    views = ("masked",)

    def __init__(
        self,
        encoder_config: EncoderConfig,
        special_tokens: Mapping[str, int],
        view: str = "masked",
        window: int = 5,
        num_negatives: int = 50,
        tau: float = 0.07,
        anchors: str = "all",
        detach_candidates: bool = True,
        max_anchors: Optional[int] = None,
        negative_unit: str = "document",
    ) -> None:
        super().__init__()
        choose_view("view", view, TACO_VIEWS)
        if anchors not in ANCHOR_SETS:
            raise ValueError(f"anchors must be one of {ANCHOR_SETS}, got {anchors!r}")
        if anchors != "all" and view == "original":
            raise ValueError("anchors='masked'/'unmasked' needs a masked view, not 'original'")
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if negative_unit not in NEGATIVE_UNITS:
            raise ValueError(f"negative_unit must be one of {NEGATIVE_UNITS}, got {negative_unit!r}")
        if num_negatives < 1 or tau <= 0:
            raise ValueError(f"num_negatives >= 1 and tau > 0 required, got {num_negatives}, {tau}")
        self.views = (view,)
        self.ids_key = VIEW_INPUTS[view][0]
        self.window, self.num_negatives, self.tau = window, num_negatives, tau
        self.anchor_set, self.detach_candidates, self.max_anchors = anchors, detach_candidates, max_anchors
        self.negative_unit = negative_unit

    @property
    def host_plan(self) -> TacoPlan:
        """What the collator computes for this objective (`taco_candidates`), so the step does not."""
        return TacoPlan(self.window, self.anchor_set, self.negative_unit)

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        out = ctx.encode(self.ids_key)
        eligible, anchors = anchor_mask(ctx.batch, self.anchor_set)
        documents = ctx.batch["document_ids"]
        if all(k in ctx.batch for k in PLAN_KEYS) and "content_positions" in ctx.batch:
            candidates = {k: ctx.batch[k] for k in (*PLAN_KEYS, "content_positions")}
        else:  # a batch built without the collator's plan: the same indices, found on the device
            candidates = taco_candidates(eligible, anchors, self.window, documents, self.negative_unit)
        anchor_idx, positive_idx, negative_idx = draw_taco_indices(
            eligible, candidates, self.window, self.num_negatives, ctx.generator, self.max_anchors, documents,
        )
        # in fp32: h and e are of similar size, so a bf16 difference would keep ~2 significant digits
        g = (out.last_hidden.float() - out.embedding_output.float()).reshape(-1, out.last_hidden.shape[-1])
        loss = ctx.op("token_contrastive_loss")(
            g, anchor_idx, positive_idx, negative_idx, self.tau, self.detach_candidates
        )
        metrics = {"anchors": scalar_metric(anchor_idx.numel(), g.device)}
        if ctx.progress.record_metrics:  # every anchor scores its positive against K drawn negatives
            metrics["loss_chance"] = scalar_metric(math.log(1 + self.num_negatives), g.device)
        return loss, metrics
