"""Regression guard (issue 29, item 4): every objective that is known to learn keeps learning.

Each row of `GUARDS` trains its tiny preset on the tiny test shards on CPU with the real entry
point (`pipeline.train`, in-process) for `GUARD_STEPS` steps of a common recipe, then judges its
learning signals (`pipeline.monitor.signals`) over the last 20% of the logged steps: every term the
row names must be learned (a contrastive loss at <= 0.85x its chance level, a masked accuracy above
the unigram plateau, an LM loss below the unigram entropy), every term with a declared chance too,
and the token states must not have collapsed. A change that leaves an objective at chance (a
detached gradient, a wrong sign, a broken sampler) fails here in about a minute, long before a
GPU run would show it (measured: with BERT-NCE's encoder states detached from its loss, so only
the output embeddings learn, `mlm-nce/loss` ends at 0.93x chance and the row fails).
`test_the_guard_fails_a_run_that_does_not_learn` checks that the judge does say "at chance" for a
run that cannot learn.

The training signals of a masked LM cannot tell learning from context from copying: BERT's masking
leaves 10% of the selected tokens unchanged, and a model that copies those leaves chance and the
plateau over all selected positions while learning nothing at `[MASK]` (issue 29: BERT-NCE with its
head's bias started at log p scored 0.97x chance and 0.139 accuracy over all selected positions at the
study's size, and 1.03x / the plateau at `[MASK]`). A row with `context=True` therefore also converts
the final checkpoint and scores it at `[MASK]` positions only, through the exported head as a user
loads it (`pipeline.study.evaluate.heldout_metrics`, the held-out evaluation of the study and of
the retired issue 29 harness; for BERT-NCE the conversion adds log q to the bias): its
accuracy there must clear the unigram plateau by `PLATEAU_MARGIN`. The tiny shards have no held-out
half, so it scores rows the run trained on, with masks of its own seed; reading a memorised
sentence's `[MASK]` still needs the context. `test_the_mask_guard_fails_a_run_that_only_copies`
checks that it fails a run that learned only by copying while its training signals all say learned.

COCO-LM, InfoWord, CAPT and ELECTRA are guarded in files of their own (`test_cocolm_learns.py`,
`test_infoword_learns.py`, `test_capt_learns.py`, `test_electra_learns.py`): each also reproduces the failure
its small-scale fix addressed and needs a recipe or a judgement this common one does not give (CAPT's token states are
judged over the second half only, COCO-LM's copy head by its AUC). Adding an objective: add one
`Guard` row to `GUARDS` with its tiny preset and the terms that must be learned (the names it logs),
plus `overrides` only when the objective needs something the common recipe does not give it (say
why in `reason`).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeline.monitor.signals import PLATEAU_MARGIN, final_signals, format_signals
from pipeline.train.metrics import read_jsonl
from tests.train.runs import run_inprocess

GUARD_STEPS = 300
#: Rows of the tiny shards scored at [MASK] (`mask_problems`): all of them (1,282, ~9,200 [MASK]ed positions,
#: a few seconds). The first 192 alone are the docstrings of a few modules and too few: BERT-NCE read 0.047
#: there against the plateau 0.042, and 0.068 against 0.043 over every row.
MASK_EVAL_SEQUENCES = 100_000
#: The common recipe: the study's shape of batch (32 sequences, no dropout) and a learning rate at which
#: the tiny model (2 x 64, 800-entry vocabulary) leaves chance within `GUARD_STEPS` steps (measured:
#: BERT-NCE 0.82x ln 17 at 300 steps, TACO 0.02x ln 9; MLM 0.051 above the plateau).
RECIPE = ("model.dropout=0.0", "model.attention_dropout=0.0", "optim.lr=3e-3", "optim.warmup_steps=20",
          "data.micro_batch_size=32", "data.global_batch_size=32", f"train.total_steps={GUARD_STEPS}",
          f"train.checkpoint_every={GUARD_STEPS}", "train.keep_last=1")


@dataclass(frozen=True)
class Guard:
    preset: str
    must_learn: tuple[str, ...]  # metric names whose final learning signal must be "learned"
    overrides: tuple[str, ...] = ()  # beyond RECIPE, only when the objective needs it
    reason: str = ""  # why the overrides
    context: bool = False  # also: [MASK]-only accuracy of the converted model above the plateau (`mask_problems`)


GUARDS = {
    # MLM's [MASK] accuracy here, 0.057 against the plateau 0.043 (zero output biases: RECIPE), clears the
    # margin by too little to guard on; BERT-NCE and TACO read 0.068 (the study's size: all three learn there)
    "mlm": Guard("tiny-mlm", ("mlm/accuracy", "mlm/loss")),
    "mlm-nce": Guard("tiny-mlm-nce", ("mlm-nce/loss", "mlm-nce/accuracy"), context=True),
    "taco": Guard("tiny-taco", ("taco/loss", "mlm/accuracy", "mlm/loss"), context=True),
    # COCO-LM, InfoWord, CAPT and ELECTRA: their own guard files (module docstring)
}


def judge(out, must_learn) -> list[str]:
    """What is not learned at the end of the run in `out` (empty: every signal learned)."""
    records = read_jsonl(out / "metrics.jsonl")
    signals = {s.term: s for s in final_signals(records)}
    problems = [f"{term}: not logged" for term in must_learn if term not in signals]
    problems += [f"{s.term}: {format_signals([s])}" for s in signals.values()
                 if not s.learned and (s.term in must_learn or s.kind in ("chance", "collapse"))]
    return problems


def mask_problems(out, shards) -> list[str]:
    """What says the run in `out` did not learn from context: its final checkpoint, converted, scored at the
    `[MASK]`ed positions of `shards` (up to `MASK_EVAL_SEQUENCES` rows) below the unigram plateau + margin."""
    from pipeline.study.evaluate import heldout_metrics, top_token_of
    from pipeline.export.convert import convert

    hf = convert(out / "checkpoints", out / "hf")
    scores = heldout_metrics(hf, shards, top_token_of(shards), MASK_EVAL_SEQUENCES)
    if scores["mlm_acc"] >= scores["unigram_acc"] + PLATEAU_MARGIN:
        return []
    return [f"accuracy at [MASK] {scores['mlm_acc']:.3f} vs plateau {scores['unigram_acc']:.3f} "
            f"({scores['masked_tokens']} positions; all selected {scores['selected_acc']:.3f}, kept {scores['kept_acc']:.3f})"]


@pytest.mark.parametrize("name", sorted(GUARDS))
def test_objective_leaves_chance_on_cpu_in_a_few_hundred_steps(name, tiny_shards_dir, tmp_path):
    guard = GUARDS[name]
    assert run_inprocess(guard.preset, tiny_shards_dir, tmp_path, *RECIPE, *guard.overrides) == 0
    problems = judge(tmp_path, guard.must_learn)
    if guard.context:
        problems += mask_problems(tmp_path, tiny_shards_dir)
    assert not problems, f"{name} ({guard.preset}) stays at chance after {GUARD_STEPS} steps: " + "; ".join(problems)


def test_the_guard_fails_a_run_that_does_not_learn(tiny_shards_dir, tmp_path):
    """With a learning rate too small to move the weights, the judge reports the NCE term at chance
    (the guard is not satisfied by a run that merely ran)."""
    steps = ("train.total_steps=40", "train.checkpoint_every=40", "optim.lr=1e-9")
    assert run_inprocess("tiny-mlm-nce", tiny_shards_dir, tmp_path, *RECIPE, *steps) == 0
    problems = judge(tmp_path, GUARDS["mlm-nce"].must_learn)
    assert any(p.startswith("mlm-nce/loss:") and "AT CHANCE" in p for p in problems), problems


def test_the_mask_guard_fails_a_run_that_only_copies(tiny_shards_dir, tmp_path):
    """Every selected token left unchanged (no [MASK], no random token): BERT-NCE learns to copy, and its
    training signals all say "learned" (the loss far below chance, the accuracy over the selected
    positions far above the plateau), yet at [MASK] it knows nothing. Only the [MASK]-only check sees it."""
    copy_only = ("data.corruption={mask_fraction: 0.0, random_fraction: 0.0}",)
    assert run_inprocess("tiny-mlm-nce", tiny_shards_dir, tmp_path, *RECIPE, *copy_only) == 0
    assert judge(tmp_path, GUARDS["mlm-nce"].must_learn) == []
    problems = mask_problems(tmp_path, tiny_shards_dir)
    assert len(problems) == 1 and problems[0].startswith("accuracy at [MASK]"), problems
