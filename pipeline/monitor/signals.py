"""Is it learning? Every learning signal of a run against the level it has at chance.

A loss that falls says little on its own: an InfoNCE term can fall from a bad start to chance and
sit there, and a masked LM can fall to the unigram plateau and sit there (issue 29 measured both).
What says "this objective learns what it exists to teach" is the distance from the answer that
ignores the input. The objectives and `pipeline.monitor.health` log each reference beside its term
(the contract), and `learning_signals(metrics)` pairs them:

* **objective-declared chance** `T` / `T_chance` (same name plus `_chance`; e.g. `mlm-nce/loss`,
  `taco/loss`, `infoword/dim_loss`):
    - a loss (name ends in `loss`): an InfoNCE / NT-Xent / NCE term at chance is
      ln(candidates per anchor) (Oord et al. 2018, Sec. 2.3: the InfoNCE optimum is bounded by
      ln N, and equal scores give exactly -ln(1/N)); lower is better, **learned when
      T <= 0.85 x T_chance** (`LOSS_RATIO`);
    - an accuracy or AUC (`accuracy`, `auc`): T_chance is the score of the trivial answer (replaced
      token detection: the share of original tokens; AUC: 0.5); higher is better, learned when the
      skill (T - T_chance) / (1 - T_chance) >= `MIN_SKILL` = 0.15, the mirror of the loss rule
      (close 15% of the way from the trivial answer to a perfect one, as 0.85x closes 15% of the
      way from chance to a zero loss);
* **the unigram references** of `pipeline.monitor.health`, for terms that declare no chance of their
  own:
    - token-prediction accuracies at masked positions (`*/accuracy`: `mlm/accuracy`,
      `mlm-nce/accuracy`, `infoword/accuracy`; `cocolm/gen_accuracy`) against
      `health/unigram_accuracy`, the plateau of always answering the most frequent token: learned
      when T >= plateau + `PLATEAU_MARGIN` (0.01: about two standard errors of the paired
      difference on the time-to-quality study's ~2,300 held-out masked tokens);
    - full-vocabulary LM cross-entropies at masked positions (`mlm/loss`, `cocolm/clm_softmax_ce`,
      `cocolm/gen_loss`) against `health/unigram_entropy` H, the unigram predictor's cross-entropy
      at the same positions: learned when T <= `ENTROPY_RATIO` x H (0.98: 2% below, ~0.13 nats at
      the study's H ~ 6.3). "Below H" alone called a model that had learned only the unigram
      distribution learned: such a model sits at ~1.00x, and can even beat the add-one smoothed
      estimate by a little (issue 49: 6.479 vs 6.497, 0.997x). The margin, like `PLATEAU_MARGIN` for
      the accuracy, asks for context beyond the plateau; every learned LM loss of the committed
      learning-signals results stays learned (the closest: COCO-LM's generator with copy weight
      0.5 at the 1x budget, 0.971x). COCO-LM's mixture loss `clm_lm_loss`
      is not one: at a replaced position it also pays the copy head's -log(1 - p_copy), so the
      entropy is not its chance level; its softmax alone (`clm_softmax_ce`) is judged here and its
      copy head by replaced-token detection (`rtd_auc`);
* **collapse**: `health/token_cosine` against `COLLAPSE_COSINE` (0.9); "learned" there means not
  collapsed.

One logged step is one micro-batch sample of each term: `final_signals(records)` judges the mean
over the last `TAIL_FRACTION` of a run's logged steps, and `trend` / `still_improving` compare that
window with the one before it, counting a move only beyond noise (`TREND_Z` standard errors of the
difference and `TREND_MIN_RELATIVE` of the value). The training loop logs `format_signals` (one line) on its logged steps;
the model card, the demo health report and the time-to-quality runs table carry the same pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from pipeline.monitor.health import COLLAPSE_COSINE

#: Suffix of a term's chance-level metric (`<term>_chance`).
CHANCE_SUFFIX = "_chance"
#: A loss is learned at <= this fraction of its chance level.
LOSS_RATIO = 0.85
#: A higher-is-better term with a declared chance is learned when it closes this share of the gap to 1.
MIN_SKILL = 0.15
#: A token-prediction accuracy is learned at >= the unigram plateau + this (accuracy points).
PLATEAU_MARGIN = 0.01
#: A full-vocabulary LM loss is learned at <= this fraction of the unigram entropy (see the module docstring).
ENTROPY_RATIO = 0.98
#: Share of a run's logged steps whose mean is "the end" (and the window before it: "before the end").
TAIL_FRACTION = 0.2
#: A window-over-window move is a trend only beyond this many standard errors of the difference of the two
#: window means (~95% two-sided under a normal approximation) ...
TREND_Z = 2.0
#: ... and only when it is at least this share of the earlier mean: a signal at chance moving 0.0002 (0.01%)
#: is not "improving", however smooth its logged values.
TREND_MIN_RELATIVE = 1e-3

PLATEAU_KEY = "health/unigram_accuracy"
ENTROPY_KEY = "health/unigram_entropy"
COSINE_KEY = "health/token_cosine"
#: Last name segments of the token-prediction accuracies judged against the unigram plateau.
PLATEAU_TERMS = ("accuracy", "gen_accuracy")
#: Full-vocabulary masked-LM losses judged against the unigram entropy.
ENTROPY_TERMS = ("mlm/loss", "cocolm/clm_softmax_ce", "cocolm/gen_loss", "electra/gen_loss", "mlm_head/loss")
#: How the name of a term with a declared chance says its direction: last segment suffix -> lower is better.
LOWER_SUFFIXES = ("loss", "entropy")
HIGHER_SUFFIXES = ("accuracy", "auc")


@dataclass(frozen=True)
class Signal:
    """One learning signal: `term`'s value against its `reference` (`reference_key`'s value).

    `kind`: "chance" (the objective's own `_chance`), "plateau", "entropy" or "collapse";
    `direction`: "lower" or "higher" is better; `threshold`: the value the term must reach
    (<= for lower, >= for higher) to count as learned."""

    term: str
    value: float
    reference: float
    reference_key: str
    kind: str
    direction: str
    threshold: float

    @property
    def learned(self) -> bool:
        if not (math.isfinite(self.value) and math.isfinite(self.threshold)):
            return False
        return self.value <= self.threshold if self.direction == "lower" else self.value >= self.threshold

    @property
    def ratio(self) -> float:
        """value / reference (nan for a zero reference)."""
        return self.value / self.reference if self.reference else float("nan")

    @property
    def margin(self) -> float:
        """value - reference."""
        return self.value - self.reference

    def to_dict(self) -> dict[str, Any]:
        return {"term": self.term, "value": self.value, "reference": self.reference,
                "reference_key": self.reference_key, "kind": self.kind, "direction": self.direction,
                "threshold": self.threshold, "ratio": self.ratio, "margin": self.margin, "learned": self.learned}


def direction_of(term: str) -> Optional[str]:
    """"lower" / "higher" from the name of a term that declares its chance (None: not a known kind)."""
    last = term.rsplit("/", 1)[-1]
    if last.endswith(LOWER_SUFFIXES):
        return "lower"
    if last.endswith(HIGHER_SUFFIXES):
        return "higher"
    return None


def chance_threshold(chance: float, direction: str) -> float:
    """The value a term with declared chance `chance` must reach to count as learned."""
    if direction == "lower":
        return LOSS_RATIO * chance
    return chance + MIN_SKILL * (1.0 - chance)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def learning_signals(metrics: Mapping[str, Any]) -> list[Signal]:
    """Every learning signal found in one set of metrics (a logged step, or a mean over steps), sorted
    by term; terms whose reference is absent (e.g. the plateau on a run without masked labels) and
    `_chance` metrics whose term has no known direction are left out."""
    values = {k: v for k, raw in metrics.items() if (v := _number(raw)) is not None}
    out: list[Signal] = []
    declared = set()
    for key, chance in values.items():
        if not key.endswith(CHANCE_SUFFIX):
            continue
        term = key[: -len(CHANCE_SUFFIX)]
        direction = direction_of(term)
        if term not in values or direction is None:
            continue
        declared.add(term)
        out.append(Signal(term, values[term], chance, key, "chance", direction, chance_threshold(chance, direction)))
    plateau, entropy = values.get(PLATEAU_KEY), values.get(ENTROPY_KEY)
    for term, value in values.items():
        if term in declared or term.startswith("health/") or term.endswith(CHANCE_SUFFIX):
            continue
        if plateau is not None and "/" in term and term.rsplit("/", 1)[-1] in PLATEAU_TERMS:
            out.append(Signal(term, value, plateau, PLATEAU_KEY, "plateau", "higher", plateau + PLATEAU_MARGIN))
        elif entropy is not None and term in ENTROPY_TERMS:
            out.append(Signal(term, value, entropy, ENTROPY_KEY, "entropy", "lower", ENTROPY_RATIO * entropy))
    if COSINE_KEY in values:
        out.append(Signal(COSINE_KEY, values[COSINE_KEY], COLLAPSE_COSINE, "COLLAPSE_COSINE", "collapse", "lower",
                          COLLAPSE_COSINE))
    return sorted(out, key=lambda s: s.term)


_REFERENCE_NAMES = {"chance": "chance", "plateau": "plateau", "entropy": "unigram H", "collapse": "collapse"}


def format_signal(signal: Signal) -> str:
    """`mlm-nce/loss 2.31/2.83 chance (0.82x) learned`, `mlm/accuracy 0.116 vs plateau 0.057 (+0.059) learned`."""
    name = _REFERENCE_NAMES[signal.kind]
    if signal.kind == "collapse":
        verdict = "ok" if signal.learned else "COLLAPSED"
        return f"{signal.term} {signal.value:.3f} ({name} > {signal.reference:g}) {verdict}"
    verdict = "learned" if signal.learned else "AT CHANCE"
    if signal.direction == "lower":
        return f"{signal.term} {signal.value:.3f}/{signal.reference:.3f} {name} ({signal.ratio:.2f}x) {verdict}"
    return f"{signal.term} {signal.value:.3f} vs {name} {signal.reference:.3f} ({signal.margin:+.3f}) {verdict}"


def format_signals(signals: Sequence[Signal]) -> str:
    """One line: `k/n learned: <signal>; <signal>; ...` (empty when there is none)."""
    if not signals:
        return ""
    learned = sum(s.learned for s in signals)
    return f"{learned}/{len(signals)} learned: " + "; ".join(format_signal(s) for s in signals)


# ---- over a run's logged steps ---------------------------------------------------------------------

def tail_windows(n: int, fraction: float = TAIL_FRACTION) -> tuple[slice, slice]:
    """(the window before the end, the end) over `n` logged steps: the last k = max(1, round(fraction n))
    steps and the k before them (shorter, possibly empty, when there are fewer than 2k)."""
    k = max(1, round(fraction * n))
    return slice(max(0, n - 2 * k), max(0, n - k)), slice(max(0, n - k), n)


def mean_metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of every numeric metric over `records` (each over the records that have it; no `step`)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for record in records:
        for key, raw in record.items():
            value = _number(raw)
            if key == "step" or value is None or not math.isfinite(value):
                continue
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}


def final_signals(records: Sequence[Mapping[str, Any]], fraction: float = TAIL_FRACTION) -> list[Signal]:
    """`learning_signals` of the mean metrics over the last `fraction` of the logged steps."""
    return learning_signals(mean_metrics(records[tail_windows(len(records), fraction)[1]]))


def _values(records: Sequence[Mapping[str, Any]], term: str) -> list[float]:
    return [v for r in records if (v := _number(r.get(term))) is not None and math.isfinite(v)]


def trend(records: Sequence[Mapping[str, Any]], signal: Signal, fraction: float = TAIL_FRACTION,
          min_z: float = TREND_Z) -> str:
    """How `signal.term` moves at the end: "improving" (its good way), "worsening", or "" (no window before the
    end, or a move within noise). The move is the mean over the last `fraction` of the logged steps minus the
    mean over the `fraction` before; it counts when it is at least `TREND_MIN_RELATIVE` of the earlier mean and,
    with `min_z` > 0, at least `min_z` standard errors of that difference (Welch: sqrt(s1^2/n1 + s2^2/n2) over
    the two windows' logged values; fewer than 2 values in a window: no claim)."""
    before, end = tail_windows(len(records), fraction)
    a, b = _values(records[before], signal.term), _values(records[end], signal.term)
    if not a or not b:
        return ""
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    move = mean_b - mean_a
    if abs(move) < TREND_MIN_RELATIVE * abs(mean_a) or move == 0:
        return ""
    if min_z > 0:
        if len(a) < 2 or len(b) < 2:
            return ""
        var_a = sum((v - mean_a) ** 2 for v in a) / (len(a) - 1)
        var_b = sum((v - mean_b) ** 2 for v in b) / (len(b) - 1)
        if abs(move) < min_z * math.sqrt(var_a / len(a) + var_b / len(b)):
            return ""
    good = move < 0 if signal.direction == "lower" else move > 0
    return "improving" if good else "worsening"


def still_improving(records: Sequence[Mapping[str, Any]], signal: Signal, fraction: float = TAIL_FRACTION,
                    min_z: float = TREND_Z) -> bool:
    """Is `signal.term` still moving its good way at the end, beyond noise (`trend`)? A collapse measure
    (`health/token_cosine`, lower is better) rising towards collapse is "worsening", never improving."""
    return trend(records, signal, fraction, min_z) == "improving"
