"""The criteria of issue 29's proof (item 3), judged on one run: its logged metrics and its held-out numbers.

A run passes when every criterion that applies to its objective is met:

1. **every contrastive term at most 0.85x its chance level at the end**: every term that declares a
   chance (`T` / `T_chance`, lower is better; `pipeline.monitor.signals`) and every term
   `REQUIRED_CHANCE_TERMS` names for the objective (a term logged without its chance level misses);
   "the end" is the mean over the last 20% of the logged steps (`TAIL_FRACTION`);
2. **still falling**: that mean strictly below the mean over the 20% of logged steps before it
   (`still_improving`; a term that has converged and gone flat misses: the issue asks for a signal
   that is still being learned at the end of the budget, not one that stalled). A term whose
   temperature follows a schedule is judged on its fixed-temperature twin (`TREND_TWINS`): CAPT's
   Eq. 6 raises tau from 0.05 back to 0.55 over the second half of the run, which raises
   `capt/loss` for unchanged representations, so its trend shows the schedule, not learning;
   `capt/floor_tau_loss` scores the same candidates at tau = 0.05 throughout;
3. COCO-LM: replaced-token detection **AUC >= 0.85** at the end (`RTD_AUC_MIN`; any `cocolm/...auc`
   term) and its **corrective LM below the unigram entropy**: the corrective LM's softmax
   cross-entropy at the masked positions (`cocolm/clm_softmax_ce`) against `health/unigram_entropy`,
   the cross-entropy of the unigram predictor at the same positions. The loss COCO-LM trains,
   `cocolm/clm_lm_loss` (the paper's copy mixture), is not read against that entropy: at a replaced
   position it adds -log(1 - p_copy), the copy head's cost (~1.4 nats while the copy head answers
   near the base rate), which the AUC already judges; the public code's corrective LM has no such
   term (its loss is the softmax cross-entropy weighted by sg(1 - p_copy)). The mixture's end value
   and the copy share stay in the criterion's detail;
4. **held-out token cosine < 0.9** (`COLLAPSE_COSINE`) at the final checkpoint;
5. **held-out masked accuracy above the unigram plateau** (by `PLATEAU_MARGIN`, as the training
   signal) for an objective that trains a token-prediction head: one that trains the shared MLM
   head (`mlm_head_training`; COCO-LM's corrective LM projects through it, and BERT-NCE and InfoWord
   are read through the exported head with log q added, as in the time-to-quality study). COCO-LM's
   main model never sees `[MASK]` (its corrective LM's masked positions hold the generator's samples),
   so its accuracy is read in that regime (`REPLACED_INPUT`): at the selected positions holding draws
   from the unigram distribution (`ttq_eval.heldout_metrics`'s `replaced_acc` against
   `replaced_unigram_acc`); the `[MASK]` accuracy stays in the criterion's detail.

InfoWord's DIM <= 0.85x ln(K) is criterion 1 for `infoword/dim_loss` (required).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from pipeline.monitor.health import COLLAPSE_COSINE
from pipeline.monitor.signals import (
    LOSS_RATIO,
    PLATEAU_MARGIN,
    TAIL_FRACTION,
    Signal,
    final_signals,
    mean_metrics,
    still_improving,
    tail_windows,
)

#: Contrastive terms each objective must log with a `_chance` level (the contract of `pipeline.monitor.signals`).
REQUIRED_CHANCE_TERMS: dict[str, tuple[str, ...]] = {
    "mlm-nce": ("mlm-nce/loss",),
    "taco": ("taco/loss",),
    "infoword": ("infoword/dim_loss", "infoword/nce_loss"),
    "capt": ("capt/loss",),
    "cocolm": ("cocolm/scl_loss",),
}
#: Terms whose "still falling" is judged on another logged term (module docstring, criterion 2).
TREND_TWINS: dict[str, str] = {"capt/loss": "capt/floor_tau_loss"}
#: COCO-LM's replaced-token detection must reach this AUC at the end.
RTD_AUC_MIN = 0.85
#: The corrective LM's token prediction (criterion 3), and the mixture loss and copy share in its detail.
CLM_SOFTMAX = "cocolm/clm_softmax_ce"
CLM_MIXTURE = "cocolm/clm_lm_loss"
CLM_COPY_SHARE = "cocolm/clm_copy_penalty"
#: Objectives whose token head is trained on replaced tokens and never on `[MASK]` (criterion 5).
REPLACED_INPUT = ("cocolm",)


def criterion(name: str, met: bool, value: Optional[float] = None, threshold: Optional[float] = None,
              detail: str = "") -> dict[str, Any]:
    return {"criterion": name, "met": bool(met), "value": value, "threshold": threshold, "detail": detail}


def contrastive_criteria(records: Sequence[Mapping[str, Any]], signals: Mapping[str, Signal],
                         required: Sequence[str]) -> list[dict]:
    """Criteria 1 and 2 for every declared-chance loss and every required term."""
    out = []
    terms = sorted({t for t, s in signals.items() if s.kind == "chance" and s.direction == "lower"} | set(required))
    for term in terms:
        s = signals.get(term)
        if s is None or s.kind != "chance":
            out.append(criterion(f"{term} <= {LOSS_RATIO}x chance at the end", False,
                                 detail="not logged with its chance level (`_chance`)"))
            continue
        out.append(criterion(f"{term} <= {LOSS_RATIO}x chance at the end", s.learned, s.ratio, LOSS_RATIO,
                             f"{s.value:.4f} vs chance {s.reference:.4f}"))
        twin = signals.get(TREND_TWINS.get(term, term))
        if twin is None:
            out.append(criterion(f"{term} still falling", False,
                                 detail=f"its fixed-temperature twin {TREND_TWINS[term]} is not logged"))
            continue
        out.append(criterion(f"{term} still falling", still_improving(records, twin), detail=(
            f"mean of the last {TAIL_FRACTION:.0%} of logged steps below the mean of the {TAIL_FRACTION:.0%} before"
            + (f", judged on {twin.term} (fixed temperature)" if twin.term != term else ""))))
    return out


def cocolm_criteria(records: Sequence[Mapping[str, Any]], signals: Mapping[str, Signal]) -> list[dict]:
    """Criterion 3: replaced-token detection AUC and the corrective LM's softmax against the unigram entropy."""
    aucs = [s for t, s in signals.items() if t.startswith("cocolm/") and t.endswith("auc")]
    out = []
    if not aucs:
        out.append(criterion(f"cocolm RTD AUC >= {RTD_AUC_MIN}", False, detail="no cocolm/*auc metric logged"))
    for s in aucs:
        out.append(criterion(f"{s.term} >= {RTD_AUC_MIN}", s.value >= RTD_AUC_MIN, s.value, RTD_AUC_MIN))
    clm = signals.get(CLM_SOFTMAX)
    if clm is None or clm.kind != "entropy":
        out.append(criterion(f"{CLM_SOFTMAX} below the unigram entropy", False,
                             detail="not logged (a run older than the metric?), or health/unigram_entropy missing"))
    else:
        end = mean_metrics(records[tail_windows(len(records))[1]])
        mixture = "; ".join(f"{key} {end[key]:.4f}" for key in (CLM_MIXTURE, CLM_COPY_SHARE) if key in end)
        out.append(criterion(f"{CLM_SOFTMAX} below the unigram entropy", clm.learned, clm.value, clm.reference,
                             f"the corrective LM's softmax; the trained mixture and its copy share: {mixture or 'not logged'}"))
    return out


def heldout_criteria(heldout: Optional[Mapping[str, Any]], token_head: bool, replaced_input: bool = False) -> list[dict]:
    """Criteria 4 and 5 on the final checkpoint's held-out numbers (`ttq_eval.heldout_metrics`);
    `replaced_input`: criterion 5 at the replaced positions instead of the `[MASK]`ed ones."""
    if heldout is None:
        return [criterion("held-out evaluation", False, detail="no held-out numbers (training failed?)")]
    cosine = heldout["token_cosine"]
    out = [criterion(f"held-out token cosine < {COLLAPSE_COSINE}", cosine < COLLAPSE_COSINE, cosine, COLLAPSE_COSINE)]
    if token_head and replaced_input:
        if "replaced_acc" not in heldout:
            return out + [criterion(f"held-out accuracy at replaced positions > plateau + {PLATEAU_MARGIN}", False,
                                    detail="no replaced_acc in the held-out numbers (evaluated by an older version)")]
        plateau = heldout["replaced_unigram_acc"]
        out.append(criterion(f"held-out accuracy at replaced positions > plateau + {PLATEAU_MARGIN}",
                             heldout["replaced_acc"] > plateau + PLATEAU_MARGIN, heldout["replaced_acc"],
                             plateau + PLATEAU_MARGIN, f"plateau {plateau:.4f}; at [MASK] {heldout['mlm_acc']:.4f} "
                             f"(plateau {heldout['unigram_acc']:.4f}), a token this model never saw in training"))
    elif token_head:
        plateau = heldout["unigram_acc"]
        out.append(criterion(f"held-out masked accuracy > plateau + {PLATEAU_MARGIN}",
                             heldout["mlm_acc"] > plateau + PLATEAU_MARGIN, heldout["mlm_acc"], plateau + PLATEAU_MARGIN,
                             f"plateau {plateau:.4f}"))
    return out


def judge_run(objective: str, records: Sequence[Mapping[str, Any]], heldout: Optional[Mapping[str, Any]],
              token_head: bool) -> dict[str, Any]:
    """Every criterion of the module docstring for one run of `objective` (the preset's name, e.g.
    "taco"): {"met": all met, "criteria": [...], "final_signals": [...]}."""
    signals = {s.term: s for s in final_signals(records)}
    criteria = contrastive_criteria(records, signals, REQUIRED_CHANCE_TERMS.get(objective, ()))
    if objective == "cocolm":
        criteria += cocolm_criteria(records, signals)
    criteria += heldout_criteria(heldout, token_head, objective in REPLACED_INPUT)
    if not records:
        criteria.append(criterion("logged steps", False, detail="no metrics logged"))
    return {"met": all(c["met"] for c in criteria), "criteria": criteria,
            "final_signals": [s.to_dict() for s in signals.values()]}
