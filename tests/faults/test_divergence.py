"""Class 1, a good checkpoint can be lost: a resumed run whose learning rate blows the weights up
without any NaN/Inf. The loss guard (`train.max_loss_ratio`) or, with it off, the weight-norm guard
(`train.max_weight_norm_ratio`) stops the run (exit 3) before anything exploded is saved, naming the
step and the last good checkpoint; pruning never deletes the newest confirmed-healthy tag."""
from __future__ import annotations

import pytest

from pipeline.train.checkpoint.tags import list_tags
from pipeline.train.cli import EXIT_NONFINITE
from tests.faults.faults import error_line, resumes_to_the_end
from tests.train.runs import latest, losses, run_inprocess, tag_dir

FIRST = ["train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=1"]
#: The resumed run's learning rate: Adam moves every weight by ~10 per step (the loss jumps from 6.6
#: to ~1900 at step 6, measured, while staying finite).
BLOW_UP = ["train.total_steps=12", "train.checkpoint_every=2", "train.keep_last=1", "optim.lr=10",
           "train.allow_config_change=true"]


@pytest.mark.parametrize("guard, expected", [
    ([], "step 6: loss "),
    (["train.max_loss_ratio=0"], "step 6: the weights' L2 norm "),
])
def test_a_finite_blow_up_stops_the_run_and_keeps_the_last_good_checkpoint(guard, expected, tiny_shards_dir, tmp_path,
                                                                            capsys):
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *FIRST) == 0
    capsys.readouterr()
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *BLOW_UP, *guard) == EXIT_NONFINITE
    message = error_line(capsys.readouterr().err)
    assert message.startswith(expected) and "the run diverged and was stopped" in message
    assert f"Last good checkpoint: {tag_dir(out, 4)}." in message
    assert all(s <= 4 for s, _ in list_tags(out / "checkpoints")), "an exploded checkpoint was written"
    assert latest(out) == tag_dir(out, 4) and max(losses(out)) <= 6
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, "train.total_steps=8", "train.allow_config_change=true")
    assert max(losses(out)) == 8 and all(v < 10 for v in losses(out).values())


def test_keep_last_1_also_keeps_the_newest_confirmed_checkpoint(tiny_shards_dir, tmp_path):
    """The newest tag's weights have produced no loss yet (its last update may be the blow-up), so
    pruning keeps the tag before it too: with the guards off, the exploded run still leaves a tag
    from before its first exploded step."""
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *FIRST) == 0
    assert [s for s, _ in list_tags(out / "checkpoints")] == [2, 4]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=5", "train.checkpoint_every=1",
                         "train.keep_last=1", "train.max_loss_ratio=0", "train.max_weight_norm_ratio=0", "optim.lr=10",
                         "train.allow_config_change=true") == 0
    assert [s for s, _ in list_tags(out / "checkpoints")] == [4, 5]  # step 5's update blew up: step 4 is kept


def test_the_guard_ratios_are_checked_and_do_not_stop_a_healthy_run(tiny_shards_dir, tmp_path, capsys):
    from pipeline.train.cli import main

    assert main(["--config", "tiny-mlm", f"data.shards_dir={tiny_shards_dir}", "train.max_loss_ratio=0.5",
                 "--check"]) == 2
    assert "train.max_loss_ratio=0.5: must be > 1" in capsys.readouterr().err
    out = tmp_path / "run"  # the tiny preset's own 20 steps with the defaults: no false alarm
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.checkpoint_every=5") == 0
    assert max(losses(out)) == 20
