"""Checkpoint layout, keep-last-N, and what happens with partial, corrupt or mismatched checkpoints:
a clear error before any step, and no good checkpoint is ever overwritten or deleted."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.train.checkpoint.tags import COMPLETE_FILE, LATEST_FILE, TRAIN_STATE_FILE, list_tags
from pipeline.train.run_meta import RunMeta
from pipeline.data.shards import Manifest
from pipeline.io import sha256_file
from tests.train.runs import latest, losses, metric_rows, run_inprocess, tag_dir

STEPS = ["train.total_steps=8", "train.checkpoint_every=2", "train.keep_last=2"]


@pytest.fixture(scope="module")
def finished_run(tiny_shards_dir, tmp_path_factory):
    """tiny-mlm, 8 steps, a checkpoint every 2 steps, the last 2 kept."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS) == 0
    return out


def copy_run(src, dst):
    return shutil.copytree(src, dst)


def digests(directory):
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}


def test_layout_and_keep_last(finished_run):
    assert [s for s, _ in list_tags(finished_run / "checkpoints")] == [6, 8]
    assert latest(finished_run) == tag_dir(finished_run, 8)
    tag = tag_dir(finished_run, 8)
    record = json.loads((tag / COMPLETE_FILE).read_text())
    assert {TRAIN_STATE_FILE, "pipeline_meta.json", "mp_rank_00_model_states.pt"} <= set(record["files"])
    meta = RunMeta.read(tag)
    assert (meta.step, meta.consumed_samples, meta.world_size, meta.zero_stage) == (8, 64, 1, 1)
    assert meta.objectives == {"mlm": 1.0} and meta.encoder_config["num_layers"] == 2
    assert meta.last_metrics["loss"] == losses(finished_run)[8]
    assert sorted(losses(finished_run)) == list(range(1, 9))


def test_partial_checkpoint_is_ignored_and_replaced(finished_run, tiny_shards_dir, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    # A crash while saving step 8: its files exist but the marker does not, `latest` still says 6.
    (tag_dir(run, 8) / COMPLETE_FILE).unlink()
    (run / "checkpoints" / LATEST_FILE).write_text(tag_dir(run, 6).name)
    good = digests(tag_dir(run, 6))
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS) == 0
    assert metric_rows(run) == metric_rows(finished_run)  # steps 7-8 redone bit for bit, old lines dropped
    assert latest(run) == tag_dir(run, 8) and (tag_dir(run, 8) / COMPLETE_FILE).is_file()
    assert digests(tag_dir(run, 6)) == good


def test_latest_pointing_to_a_partial_checkpoint(finished_run, tiny_shards_dir, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run")
    (tag_dir(run, 8) / COMPLETE_FILE).unlink()
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS) == 2
    assert "step_00000008: partial checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage", "truncate", "delete"])
def test_corrupt_checkpoint_is_refused_and_left_alone(finished_run, tiny_shards_dir, tmp_path, capsys, damage):
    run = copy_run(finished_run, tmp_path / "run")
    victim = tag_dir(run, 8) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    if damage == "garbage":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
    else:
        victim.unlink()
    before = {s: digests(p) for s, p in list_tags(run / "checkpoints")}
    metrics_before = (run / "metrics.jsonl").read_text()
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, "train.total_steps=10",
                         "train.allow_config_change=true") == 2
    err = capsys.readouterr().err
    expected = {"garbage": "does not match the sha256", "truncate": "truncated or corrupt", "delete": "is missing"}
    assert "step_00000008" in err and expected[damage] in err
    assert {s: digests(p) for s, p in list_tags(run / "checkpoints")} == before  # nothing rewritten or pruned
    assert (run / "metrics.jsonl").read_text() == metrics_before and latest(run) == tag_dir(run, 8)


def test_resume_refuses_a_different_config_or_data(finished_run, tiny_shards_dir, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, "optim.lr=0.002") == 2
    err = capsys.readouterr().err
    assert "optim.lr: 0.001 -> 0.002" in err and "train.allow_config_change=true" in err

    other_data = shutil.copytree(tiny_shards_dir, tmp_path / "shards")
    manifest = json.loads((other_data / "manifest.json").read_text())
    manifest["build_args"]["note"] = "how the build ran"  # not what it produced: the same data
    (other_data / "manifest.json").write_text(json.dumps(manifest))
    assert run_inprocess("tiny-mlm", other_data, run, *STEPS, "train.total_steps=7") == 2
    assert "train.total_steps=7 is below step 8" in capsys.readouterr().err  # past the data check
    manifest["packing"] = "doc"  # a build that produced other data (content_hash written anew)
    (other_data / "manifest.json").write_text(Manifest.from_dict(manifest).to_json())
    assert run_inprocess("tiny-mlm", other_data, run, *STEPS) == 2
    assert "data manifest" in capsys.readouterr().err

    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, "train.resume=never") == 2
    assert "train.resume=never but" in capsys.readouterr().err

    # Deliberate change: extend the run by 2 steps.
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, "train.total_steps=10",
                         "train.allow_config_change=true") == 0
    assert sorted(losses(run)) == list(range(1, 11)) and latest(run) == tag_dir(run, 10)
    assert [s for s, _ in list_tags(run / "checkpoints")] == [8, 10]


def test_resuming_an_older_tag_in_the_same_run_dir_as_the_error_advises(finished_run, tiny_shards_dir, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run")
    victim = tag_dir(run, 8) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    garbled = digests(tag_dir(run, 8))
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS) == 2
    assert "resume from an older tag with train.resume=<tag dir>" in capsys.readouterr().err

    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, f"train.resume={tag_dir(run, 6)}") == 0
    assert metric_rows(run) == metric_rows(finished_run)  # steps 7-8 redone, bit for bit
    assert latest(run) == tag_dir(run, 8) and digests(tag_dir(run, 8)) != garbled
    assert digests(run / "checkpoints" / "superseded" / "step_00000008") == garbled  # set aside, not deleted
    assert [s for s, _ in list_tags(run / "checkpoints")] == [6, 8]


def test_allow_config_change_with_other_shapes_names_the_tensors(finished_run, tiny_shards_dir, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *STEPS, "model.ffn_size=96",
                         "train.allow_config_change=true") == 2
    err = capsys.readouterr().err
    assert "this run's model has other tensors than the checkpoint (6: " in err
    assert "bert.encoder.layer.0.intermediate.dense.weight [128, 64] -> [96, 64]" in err
    assert "not a changed model shape" in err and "corrupt" not in err
