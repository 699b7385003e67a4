"""Training phases (`phases:`, `pipeline.train.phases.schedule`): a two-phase run (L=64 -> L=128 on the tiny
shards) walks both phases in one run, names its phase in every checkpoint, resumes bitwise from a
checkpoint at the phase boundary and from one inside phase 2, comes back from a requeue (SIGUSR1,
exit 75) into the right phase, and bad phases are refused before compute, naming the field."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import check_run, load_config
from pipeline.train.checkpoint.tags import TRAIN_STATE_FILE
from pipeline.train.phases.schedule import phase_seed
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from tests.fixtures_data import TINY_SHARD_MB
from tests.gloo_ranks import free_port
from tests.train.runs import (
    REPO,
    _env,
    latest,
    metric_rows,
    module_state,
    output_of,
    overrides,
    run_inprocess,
    run_torchrun,
    send_signal,
    start_subprocess,
    tag_dir,
    wait_all,
    wait_for_handler,
    wait_for_step,
)

STEPS = ["train.total_steps=8", "train.checkpoint_every=2", "train.keep_last=10"]


@pytest.fixture(scope="module")
def long_shards_dir(tiny_corpus_file, tiny_tokenizer_dir, tmp_path_factory):
    """The tiny corpus at seq_len 128 with the tiny tokenizer (phase 2's data)."""
    from data_prep.build_shards import build_shards

    out = tmp_path_factory.mktemp("shards128") / "tiny128"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, out, seq_len=128, shard_size_mb=TINY_SHARD_MB, num_proc=1,
                 progress=False)
    return out


def two_phases(long_dir, short_steps: int = 4, long_steps: int = 4, **long_extra) -> str:
    """`phases=[...]` override: 'short' on the run's data.* (L=64, global 8), then 'long' at L=128, global 4."""
    phases = [{"name": "short", "steps": short_steps},
              {"name": "long", "steps": long_steps, "shards_dir": str(long_dir), "seq_len": 128,
               "micro_batch_size": 2, "global_batch_size": 4, **long_extra}]
    return "phases=" + json.dumps(phases)


def train_state(tag) -> dict:
    return torch.load(tag / TRAIN_STATE_FILE, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def reference(tiny_shards_dir, long_shards_dir, tmp_path_factory):
    """The uninterrupted two-phase run: 4 steps at L=64 then 4 at L=128, a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("phases") / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *STEPS, two_phases(long_shards_dir)) == 0
    return out


def test_one_run_walks_both_phases(reference):
    rows = metric_rows(reference)
    assert sorted(rows) == list(range(1, 9))
    assert [rows[s]["phase"] for s in range(1, 9)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [rows[s]["global_batch_size"] for s in range(1, 9)] == [8] * 4 + [4] * 4
    assert [rows[s]["consumed_samples"] for s in range(1, 9)] == [8, 16, 24, 32, 36, 40, 44, 48]
    # phase 2 reads the 128-token shards: a step of 4 sequences holds more than 4 x 64 tokens
    assert rows[5]["tokens_seen"] - rows[4]["tokens_seen"] > 4 * 64
    assert rows[4]["tokens_seen"] - rows[3]["tokens_seen"] <= 8 * 64
    from pipeline.train.run_meta import RunMeta

    corpus = RunMeta.read(tag_dir(reference, 8)).corpus  # the model card's: both phases' data
    assert [(p["name"], p["steps"], p["seq_len"]) for p in corpus["phases"]] == [("short", 4, 64), ("long", 4, 128)]
    assert corpus["seq_len"] == 128 and corpus["sequences"] == sum(p["sequences"] for p in corpus["phases"])
    states = torch.load(tag_dir(reference, 8) / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["global_steps"] == 8 and states["global_samples"] == 48  # DeepSpeed: one update per step
    for step, phase, start in ((2, "short", 0), (4, "short", 0), (6, "long", 32), (8, "long", 32)):
        state = train_state(tag_dir(reference, step))
        assert (state["phase"], state["phase_start_samples"]) == (phase, start), step


@pytest.mark.parametrize("resume_step", [4, 6], ids=["at-the-phase-boundary", "inside-phase-2"])
def test_resume_is_bitwise(reference, tiny_shards_dir, long_shards_dir, tmp_path, resume_step):
    run = shutil.copytree(reference, tmp_path / "run")
    args = (*STEPS, two_phases(long_shards_dir), f"train.resume={tag_dir(run, resume_step)}")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *args) == 0
    assert metric_rows(run) == metric_rows(reference)  # steps after the resume redone, bit for bit
    final, expected = module_state(tag_dir(run, 8)), module_state(tag_dir(reference, 8))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_requeue_resumes_into_the_right_phase(tiny_shards_dir, long_shards_dir, tmp_path):
    """SIGUSR1 inside phase 2 (exit 75, checkpoint), the same command again (as a requeued SLURM job or
    `pipeline.launch_requeue` does): the run continues in phase 2 and ends as the uninterrupted one."""
    length = ["train.total_steps=60", "train.checkpoint_every=1000", "train.log_every=1"]
    phases = two_phases(long_shards_dir, short_steps=2, long_steps=58)
    reference = tmp_path / "reference"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, reference, *length, phases) == 0

    out = tmp_path / "run"
    proc = start_subprocess("tiny-mlm", tiny_shards_dir, out, *length, phases)
    try:
        wait_for_handler(proc)
        wait_for_step(out, 3, proc)
        send_signal(proc, signal.SIGUSR1)
        assert wait_all([proc]) == [REQUEUE_EXIT_CODE], output_of(proc)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = latest(out)
    state = train_state(stopped)
    assert 3 <= state["step"] < 60 and state["phase"] == "long" and state["phase_start_samples"] == 16
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *length, phases) == 0
    assert metric_rows(out) == metric_rows(reference)
    final, expected = module_state(tag_dir(out, 60)), module_state(tag_dir(reference, 60))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_phase_seeds_and_tokens_to_steps(tiny_shards_dir, long_shards_dir):
    assert phase_seed(1234, 0) == 1234 and phase_seed(1234, 1) != phase_seed(1234, 2) != 1234
    # 4 steps x 4 sequences x 128 positions = 2048 tokens; 2049 needs a fifth step
    for tokens, steps in ((2048, 4), (2049, 5)):
        phases = [{"name": "short", "steps": 9 - steps}, {"name": "long", "tokens": tokens,
                  "shards_dir": str(long_shards_dir), "micro_batch_size": 2, "global_batch_size": 4}]
        cfg = load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", "train.total_steps=9",
                                       "phases=" + json.dumps(phases)])
        plan = check_run(cfg, 1, False)
        assert [p.steps for p in plan.schedule.phases] == [9 - steps, steps]
        assert cfg.model.max_position == 128  # one position table for the longest phase


def refusal(tiny_shards_dir, *overrides: str, stage: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", *overrides])
        assert stage == 2, "stage-1 refusal expected"
        check_run(cfg, 1, False)
    return str(err.value)


def test_refusals_name_the_field(tiny_shards_dir, long_shards_dir, other_tokenizer_shards):
    steps8 = "train.total_steps=8"
    assert "train.total_steps=8" in refusal(tiny_shards_dir, steps8, two_phases(long_shards_dir, 4, 5))
    text = refusal(tiny_shards_dir, steps8, two_phases(other_tokenizer_shards, seq_len=64), stage=2)
    assert f"phases[1] (long).shards_dir={other_tokenizer_shards}: built with another tokenizer" in text
    text = refusal(tiny_shards_dir, steps8, "model.max_position=64", two_phases(long_shards_dir), stage=2)
    assert "phases[1] (long).seq_len=128 exceeds model.max_position=64" in text
    bad = [{"name": "a", "steps": 4, "tokenz": 3}, {"name": "b", "steps": 4}]
    assert "phases[0] (a).tokenz: unknown phase key (did you mean 'tokens'?)" in refusal(
        tiny_shards_dir, steps8, "phases=" + json.dumps(bad))
    both = [{"name": "a", "steps": 4, "tokens": 100}, {"name": "b", "steps": 4}]
    assert "phases[0] (a): give exactly one of steps, tokens, fraction" in refusal(
        tiny_shards_dir, steps8, "phases=" + json.dumps(both))
    assert "phases[1] (long).model.global_rope_theta: rotary bases need model.arch=modernbert" in refusal(
        tiny_shards_dir, steps8, two_phases(long_shards_dir, model={"global_rope_theta": 160000}))
    assert "phases[1] (long).optim.betas: fixed for the whole run" in refusal(
        tiny_shards_dir, steps8, two_phases(long_shards_dir, optim={"betas": [0.9, 0.99]}))
    same = [{"name": "a", "steps": 4}, {"name": "a", "steps": 4}]
    assert "names must be unique" in refusal(tiny_shards_dir, steps8, "phases=" + json.dumps(same))
    assert "phases[1] (long): data.micro_batch_size=0" in refusal(
        tiny_shards_dir, steps8, two_phases(long_shards_dir, micro_batch_size=0))


@pytest.fixture(scope="module")
def other_tokenizer_shards(tiny_corpus_file, tmp_path_factory):
    """Shards of the tiny corpus at seq_len 64 with a tokenizer of another vocabulary (600 entries)."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer

    tokenizer = train_tokenizer([tiny_corpus_file], tmp_path_factory.mktemp("tok600"), vocab_size=600, progress=False)
    out = tmp_path_factory.mktemp("shards600") / "tiny600"
    build_shards([tiny_corpus_file], tokenizer, out, seq_len=64, shard_size_mb=TINY_SHARD_MB, num_proc=1,
                 progress=False)
    return out


def test_rotary_base_and_schedule_segment(tiny_shards_dir, long_shards_dir, tmp_path):
    """ModernBERT's context extension in miniature: phase 2 sets a new global rotary base (read by the
    forward, recorded in the checkpoint's encoder config) and its own LR segment over its own steps."""
    from pipeline.train.optim import OptimConfig, lr_at
    from pipeline.train.run_meta import RunMeta

    out = tmp_path / "run"
    segment = {"lr": 5.0e-4, "warmup_steps": 1}
    phases = [{"name": "base", "steps": 2, "model": {"global_rope_theta": 10000}},
              {"name": "extend", "steps": 3, "shards_dir": str(long_shards_dir), "micro_batch_size": 2,
               "global_batch_size": 4, "model": {"global_rope_theta": 160000}, "optim": segment}]
    assert run_inprocess("tiny-mlm", tiny_shards_dir, out, "model.arch=modernbert", "train.total_steps=5",
                         "train.checkpoint_every=2", "train.keep_last=10", "phases=" + json.dumps(phases)) == 0
    thetas = {step: RunMeta.read(tag_dir(out, step)).encoder_config["global_rope_theta"] for step in (2, 4, 5)}
    assert thetas == {2: 10000.0, 4: 160000.0, 5: 160000.0}
    rows = metric_rows(out)
    seg = OptimConfig(**{**OptimConfig().__dict__, "lr": 5.0e-4, "warmup_steps": 1, "min_lr_ratio": 0.0})
    assert [rows[s]["lr"] for s in (3, 4, 5)] == [lr_at(s - 2, seg, 3) for s in (3, 4, 5)]
    assert rows[3]["lr"] == 5.0e-4  # the segment's peak after its one warm-up step


@pytest.mark.parametrize("preset, names, steps, rope", [
    ("bert-large-2phase", ["seq128", "seq512"], [7740, 860], None),
    ("modernbert-long-2phase", ["ctx1024", "ctx8192"], [400000, 50000], [10000, 160000]),
])
def test_two_phase_presets_plan_on_their_data(tiny_shards_dir, long_shards_dir, preset, names, steps, rope):
    """The presets' phases, checked as on a GPU node (`--check --gpus`) against shards of both lengths
    (the tiny ones at 64 and 128 tokens stand in for 128/512 and 1024/8192; batches scaled down)."""
    cfg = load_config(preset, [f"data.shards_dir={tiny_shards_dir}", "data.seq_len=64", "data.global_batch_size=64",
                               "data.micro_batch_size=8", f"phases.1.shards_dir={long_shards_dir}",
                               "phases.1.seq_len=128", "phases.1.global_batch_size=32", "phases.1.micro_batch_size=4"])
    plan = check_run(cfg, 1, True)
    assert [(p.name, p.steps, p.manifest.seq_len) for p in plan.schedule.phases] == list(zip(names, steps, [64, 128]))
    assert [p.batch.grad_accum for p in plan.schedule.phases] == [8, 8]
    assert all(p.optim is not None for p in plan.schedule.phases[1:])  # phase 2 on its own schedule segment
    if rope:
        assert [p.model["global_rope_theta"] for p in plan.schedule.phases] == rope


def test_two_ranks_requeued_under_the_torchrun_wrapper_resume_into_phase_2(tiny_shards_dir, long_shards_dir, tmp_path):
    """2 ranks under `pipeline.launch_requeue` (torchrun): the ranks get SIGUSR1 in phase 2 (as from the
    scheduler), the wrapper exits 75; the same command again (the requeued job) resumes in phase 2 and
    ends with the weights of the uninterrupted 2-rank run."""
    length = ["train.total_steps=60", "train.checkpoint_every=1000"]
    phases = two_phases(long_shards_dir, short_steps=2, long_steps=58)
    reference = tmp_path / "reference"
    run_torchrun("tiny-mlm", tiny_shards_dir, reference, *length, phases)

    out = tmp_path / "run"

    def launch() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "pipeline.launch_requeue", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "pipeline.train", "--config", "tiny-mlm",
               *overrides(tiny_shards_dir, out, *length, phases)]
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    launcher = launch()
    try:
        wait_for_step(out, 3, launcher)
        ranks = subprocess.run(["pgrep", "-f", "-P", str(launcher.pid), "pipeline.train"], capture_output=True,
                               text=True).stdout.split()
        assert len(ranks) == 2, ranks
        for pid in ranks:
            subprocess.run(["kill", "-USR1", pid], check=True)
        assert wait_all([launcher]) == [REQUEUE_EXIT_CODE], output_of(launcher)[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    state = train_state(latest(out))
    assert state["phase"] == "long" and 3 <= state["step"] < 60, state
    launcher = launch()
    assert wait_all([launcher]) == [0], output_of(launcher)[-3000:]
    assert metric_rows(out) == metric_rows(reference)
    final, expected = module_state(tag_dir(out, 60)), module_state(tag_dir(reference, 60))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_phase_may_train_on_a_mixture(tiny_shards_dir, long_shards_dir):
    """`data.sources` (mixtures) exists: a phase may name its data with `sources` instead of `shards_dir`."""
    phases = [{"name": "short", "steps": 4},
              {"name": "mix", "steps": 4, "sources": [{"path": str(long_shards_dir), "weight": 1.0}],
               "micro_batch_size": 2, "global_batch_size": 4}]
    cfg = load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", "train.total_steps=8",
                                   "phases=" + json.dumps(phases)])
    plan = check_run(cfg, 1, False)
    mix = plan.schedule.phases[1]
    assert mix.data.shards_dir == "" and mix.data.sources and mix.manifest.seq_len == 128
    both = [phases[0], {**phases[1], "shards_dir": str(long_shards_dir)}]
    with pytest.raises(ConfigError, match=r"phases\[1\] \(mix\): data.sources and data.shards_dir"):
        load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", "train.total_steps=8",
                                 "phases=" + json.dumps(both)])


def test_zero3_phases_with_batch_warmup_resume_bitwise(tiny_shards_dir, long_shards_dir, tmp_path):
    """ZeRO-3, a batch warm-up inside phase 1 (2, 2, 4, 8), then phase 2: the split changes three times
    (DeepSpeed's accumulation count and its ZeRO optimizer's follow); a resume at the boundary is bitwise."""
    extra = ["deepspeed.config=zero3", "data.micro_batch_size=2", "data.global_batch_size=8",
             "data.batch_warmup=" + json.dumps({"start_global_batch_size": 2, "tokens": 8 * 64}),
             *STEPS, two_phases(long_shards_dir)]
    reference = tmp_path / "reference"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, reference, *extra) == 0
    rows = metric_rows(reference)
    assert [rows[s]["global_batch_size"] for s in range(1, 9)] == [2, 2, 4, 8, 4, 4, 4, 4]
    assert [rows[s]["consumed_samples"] for s in range(1, 9)] == [2, 4, 8, 16, 20, 24, 28, 32]
    run = shutil.copytree(reference, tmp_path / "run")
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, *extra, f"train.resume={tag_dir(run, 4)}") == 0
    assert metric_rows(run) == metric_rows(reference)


def test_extending_a_phased_run_lengthens_its_last_phase(reference, tmp_path, capsys):
    """`--resume DIR train.total_steps=N` must lengthen a phase too (the steps must sum: said so),
    and with `phases.1.steps=M` the run goes on in its last phase from its checkpoint."""
    from pipeline.train.cli import main

    run = shutil.copytree(reference, tmp_path / "run")
    assert main(["--resume", str(run), "train.total_steps=10"]) == 2
    assert "to extend a run, lengthen its last phase with it: phases.1.steps=N" in capsys.readouterr().err
    assert main(["--resume", str(run), "train.total_steps=10", "phases.1.steps=6"]) == 0
    rows = metric_rows(run)
    assert sorted(rows) == list(range(1, 11)) and [rows[s]["phase"] for s in (9, 10)] == [1, 1]
    assert rows[10]["consumed_samples"] == 56 and train_state(tag_dir(run, 10))["phase"] == "long"
