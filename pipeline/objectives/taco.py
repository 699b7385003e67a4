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
  - max_anchors: optional cap on anchors per micro-batch (uniform subsample; None = all).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from pipeline.batch import IGNORE_INDEX, VIEW_INPUTS, choose_view, content_tokens
from pipeline.model.encoder import EncoderConfig
from pipeline.objectives.base import Objective, StepContext, register, scalar_metric
from pipeline.objectives.sampling import document_groups, sample_from_other_groups, sample_window_positives

TACO_VIEWS = ("masked", "wwm_masked", "original")
ANCHOR_SETS = ("all", "masked", "unmasked")
NEGATIVE_UNITS = ("document", "row")


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
    """Sample TACO's anchors, positives and negatives.

    eligible [B, L] bool: tokens that may be positives/negatives; anchors [B, L] bool (subset of
    eligible); documents [B, L] int64 (`document_ids`; None = one document per row). Positives stay
    inside the anchor's document; negatives come from other documents (`negative_unit="document"`)
    or other rows ("row"). Returns flat indices into B*L: anchor_idx [N], positive_idx [N],
    negative_idx [N, K].
    """
    if negative_unit not in NEGATIVE_UNITS:
        raise ValueError(f"negative_unit must be one of {NEGATIVE_UNITS}, got {negative_unit!r}")
    length = eligible.shape[1]
    doc_groups = document_groups(eligible, documents)
    rows, cols = torch.nonzero(anchors & eligible, as_tuple=True)
    if max_anchors is not None and rows.numel() > max_anchors:
        keep = torch.randperm(rows.numel(), generator=generator, device=rows.device)[:max_anchors].sort().values
        rows, cols = rows[keep], cols[keep]
    pos_cols, has_pos = sample_window_positives(eligible, rows, cols, window, generator, doc_groups)
    rows, cols, pos_cols = rows[has_pos], cols[has_pos], pos_cols[has_pos]
    pool = torch.nonzero(eligible.reshape(-1)).squeeze(1)
    if rows.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=eligible.device)
        return empty, empty, empty.reshape(0, num_negatives)
    units = doc_groups if negative_unit == "document" else document_groups(eligible, None)
    flat_units = units.reshape(-1)
    num_units = int(flat_units.max()) + 1
    pick = sample_from_other_groups(flat_units[pool], units[rows, cols], num_units, num_negatives, generator)
    return rows * length + cols, rows * length + pos_cols, pool[pick]


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

    def forward(self, ctx: StepContext) -> tuple[Tensor, dict[str, Tensor]]:
        out = ctx.encode(self.ids_key)
        eligible = content_tokens(ctx.batch)
        anchors = eligible
        if self.anchor_set != "all":
            selected = ctx.batch["mlm_labels"] != IGNORE_INDEX
            anchors = eligible & (selected if self.anchor_set == "masked" else ~selected)
        anchor_idx, positive_idx, negative_idx = sample_taco_indices(
            eligible, anchors, self.window, self.num_negatives, ctx.generator, self.max_anchors,
            ctx.batch["document_ids"], self.negative_unit,
        )
        # in fp32: h and e are of similar size, so a bf16 difference would keep ~2 significant digits
        g = (out.last_hidden.float() - out.embedding_output.float()).reshape(-1, out.last_hidden.shape[-1])
        loss = ctx.op("token_contrastive_loss")(
            g, anchor_idx, positive_idx, negative_idx, self.tau, self.detach_candidates
        )
        return loss, {"anchors": scalar_metric(anchor_idx.numel(), g.device)}
