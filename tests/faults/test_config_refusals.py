"""Class 3, configs that train nothing or contradict the checkpoint: refused with one line and exit 2
before any compute, the checkpoint untouched (it still resumes)."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.train.checkpoint.tags import list_tags
from pipeline.train.cli import EXIT_CONFIG_ERROR
from tests.faults.faults import error_line, resumes_to_the_end
from tests.train.runs import losses, run_inprocess, tag_dir

STEPS = ["train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=5"]


def test_all_objective_weights_zero(tiny_shards_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_inprocess("tiny-taco", tiny_shards_dir, out, "objectives.mlm=0", "objectives.taco=0.0") == EXIT_CONFIG_ERROR
    assert error_line(capsys.readouterr().err).startswith("objectives: every weight is 0 ({'mlm': 0, 'taco': 0.0}): "
                                                          "the run would train nothing")
    assert not out.exists()


def test_total_steps_below_the_resumed_step(tiny_shards_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == 0
    capsys.readouterr()
    for extra in ([], ["train.allow_config_change=true"]):  # refused either way, with the way to extend
        assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=3", *extra) == EXIT_CONFIG_ERROR
        assert error_line(capsys.readouterr().err) == (
            f"train.total_steps=3 is below step 4 of the checkpoint it resumes ({tag_dir(out, 4)}): nothing would be "
            f"trained. To extend the run: cpt-train --resume {out} train.total_steps=N with N above 4; to train fewer "
            "steps, start a new train.output_dir")
    assert [s for s, _ in list_tags(out / "checkpoints")] == [2, 4]
    resumes_to_the_end("tiny-mlm", tiny_shards_dir, out, "train.total_steps=6", "train.allow_config_change=true")
    assert max(losses(out)) == 6


def test_micro_batch_change_on_resume(tiny_shards_dir, tmp_path, capsys):
    """A new micro-batch size changes what a step computes (per-micro-batch sampling streams, in-batch
    negatives, the per-micro-batch loss mean), so it is a config change: refused unless allowed."""
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == 0
    capsys.readouterr()
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=4", "train.checkpoint_every=2",
                         "data.micro_batch_size=2") == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert "was written with a different config or data: data.micro_batch_size: 4 -> 2" in message
    assert "train.allow_config_change=true" in message


def test_a_batch_warmup_longer_than_the_run_is_refused(tiny_shards_dir, tmp_path, capsys):
    """Without phases as with them: a warm-up that would not reach `data.global_batch_size` before the
    run ends is refused naming the field (it used to train every step at a smaller batch than the
    start-up line printed). Micro 2, target 8, from 2 over 24 samples' tokens: the warm-up takes 8 steps."""
    out = tmp_path / "run"
    warmup = ["data.micro_batch_size=2", "data.global_batch_size=8",
              'data.batch_warmup={"start_global_batch_size": 2, "tokens": 1536}']
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=7", *warmup) == EXIT_CONFIG_ERROR
    assert error_line(capsys.readouterr().err) == (
        "data.batch_warmup.tokens=1536: the warm-up does not end inside the run (8 steps > train.total_steps=7); "
        "shorten it or lengthen the run")
    assert not (out / "checkpoints").exists()
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "train.total_steps=8", "train.checkpoint_every=8",
                         *warmup) == 0  # one that ends on the last step runs


def test_a_wsd_decay_longer_than_the_run_names_the_field():
    """It used to say the decay "would start at step -21, inside the warm-up"."""
    from pipeline.config.checks import ConfigError
    from pipeline.train.run_config import load_config

    try:
        load_config("tiny-mlm", ["optim.schedule=wsd", "optim.decay_steps=42", "train.total_steps=20"])
    except ConfigError as err:
        assert str(err) == ("optim.decay_steps=42 exceeds the run (train.total_steps=20): the WSD decay is the run's "
                            "last decay_steps steps; set it to at most 20")
    else:
        raise AssertionError("accepted")


def test_switching_the_optimizer_on_resume_is_refused(small_run, tmp_path, capsys):
    """AdamW keeps its moments bias-uncorrected, StableAdamW debiased: a switch on resume would
    reinterpret them, so it is refused (no conversion), by `--resume` overrides and by hand alike."""
    import shutil

    from pipeline.train.cli import main

    run = Path(shutil.copytree(small_run, tmp_path / "run"))
    expected = ("optim.name=stable_adamw: the checkpoint was trained with optim.name=adamw, whose optimizer state "
                "(moments) stable_adamw would misread; a resume keeps the optimizer. Resume with optim.name=adamw, "
                "or start a new train.output_dir warm-started from the converted weights (model.init_from)")
    assert main(["--resume", str(run), "train.total_steps=6", "optim.name=stable_adamw"]) == EXIT_CONFIG_ERROR
    assert error_line(capsys.readouterr().err) == expected
    shards = json.loads((run / "checkpoints" / "step_00000004" / "pipeline_meta.json").read_text())["config"]["data"]
    assert run_inprocess("tiny-mlm", Path(shards["shards_dir"]), run, "train.total_steps=6", "optim.name=stable_adamw",
                         "train.allow_config_change=true", "train.checkpoint_every=2", "train.keep_last=5") \
        == EXIT_CONFIG_ERROR
    assert error_line(capsys.readouterr().err) == expected
    assert [s for s, _ in list_tags(run / "checkpoints")] == [2, 4]


def test_an_electra_option_of_the_wrong_type_or_not_finite_is_one_line_before_compute(tiny_shards_dir, tmp_path, capsys):
    """An option from the command line is YAML: `generator_width=1/4` is a string and `.nan` a float nan. Both
    used to pass to the objective (the string as a TypeError traceback, exit 1; nan trained steps of nan loss
    until the non-finite guard stopped the run): now exit 2 with one line naming the option, no step taken.
    An objective weight of nan is refused at the config stage, before the run directory is created."""
    for override, line in (
            ("objective_options.electra.generator_width=1/4",
             "objective_options.electra.generator_width must be a finite number > 0 and <= 1 (a fraction of the "
             "hidden size), got '1/4'"),
            ("objective_options.electra.lambda_disc=.nan",
             "objective_options.electra.lambda_disc must be a finite number >= 0, got nan"),
            ("objectives.electra=.nan", "objectives.electra=nan: the weight must be a finite number >= 0")):
        out = tmp_path / override.replace("=", "_")
        assert run_inprocess("tiny-electra", tiny_shards_dir, out, *STEPS, override) == EXIT_CONFIG_ERROR
        assert error_line(capsys.readouterr().err) == line
        assert not (out / "metrics.jsonl").exists() and not list_tags(out / "checkpoints")
