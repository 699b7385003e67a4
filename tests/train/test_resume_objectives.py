"""Exact resume for every objective: single rank, CPU, fp32, dropout on.

The uninterrupted run saves a checkpoint at step 2 and runs to step 4; a second run resumes from
that checkpoint in a fresh directory. Every logged metric of steps 3-4 (losses, their parts, grad
norm, lr, counters) and the final weights must be bitwise identical — which needs the engine,
optimizer moments, data position, objective state (CAPT's queue) and every random stream
(masking, objective sampling, dropout) restored exactly.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.train.runs import metric_rows, module_state, run_inprocess, tag_dir

STEPS = ["train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=3"]


#: the scale options of the objectives (issue 14): every n-gram per sentence, NCE over every token,
#: SpanBERT span replacement (new corruption streams), CAPT's Eq. 4 sum with global in-batch negatives
SCALE_OPTIONS = {
    "tiny-infoword": ["objective_options.infoword.num_negatives=all", "objective_options.infoword.ngrams_per_sentence=all",
                      "data.corruption.span_mask_fraction=0.8", "data.corruption.span_random_fraction=0.1"],
    "tiny-capt": ["objective_options.capt.reduction=sum", "objective_options.capt.batch_negatives=global"],
}


@pytest.mark.parametrize("preset, options", [(p, []) for p in ("tiny-mlm", "tiny-taco", "tiny-capt", "tiny-cocolm",
                                                                    "tiny-electra", "tiny-infoword")]
                         + [(p, o) for p, o in SCALE_OPTIONS.items()])
def test_resume_is_bitwise_exact(preset, options, tiny_shards_dir, tmp_path):
    check_resume(preset, tiny_shards_dir, tmp_path, *options)


def test_resume_is_bitwise_exact_with_compiled_layers(tiny_shards_dir, tmp_path):
    """`model.compile=true` (dropout on, `train.deterministic=true`): the compiled layers are built
    at step 1 in one run and at step 3 in the other, and still draw the same dropout masks."""
    check_resume("tiny-mlm", tiny_shards_dir, tmp_path, "model.compile=true")


def check_resume(preset, tiny_shards_dir, tmp_path, *extra):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert run_inprocess(preset, tiny_shards_dir, full, *STEPS, *extra) == 0
    assert run_inprocess(preset, tiny_shards_dir, resumed, *STEPS, *extra, f"train.resume={tag_dir(full, 2)}") == 0

    expected, got = metric_rows(full), metric_rows(resumed)
    assert sorted(got) == [3, 4]  # a fresh directory: only the resumed steps are logged...
    for step in (3, 4):
        assert got[step] == expected[step], f"{preset}: step {step} differs after resume"
    assert expected[3]["loss"] != expected[4]["loss"]  # ...and the compared values really move
    if preset == "tiny-infoword" and extra:  # the options are in effect
        assert expected[3]["infoword/dim_pairs"] > expected[3]["infoword/dim_sentences"]
        assert expected[3]["infoword/negatives"] > 16  # more than the preset's per-position draws
    if preset == "tiny-capt" and extra:  # a sum over 2b terms: far above the per-term log(negatives + 1)
        assert expected[3]["capt/loss"] > 4 * math.log(expected[3]["capt/negatives"] + 1)

    final_full, final_resumed = module_state(tag_dir(full, 4)), module_state(tag_dir(resumed, 4))
    assert final_full.keys() == final_resumed.keys()
    for name, tensor in final_full.items():
        assert torch.equal(tensor, final_resumed[name]), f"{preset}: parameter {name} differs"
