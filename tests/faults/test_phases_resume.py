"""Issue 49, phases and mixtures (docs/guarantees.md, "phases and mixtures on resume"): a phase's mixture
is planned over the phase's own length (its `on_exhausted: stop` sources refused before compute, its
token budgets a share of the phase's samples, the reader on the same plan), phase 0's start is logged,
a resume that would rewrite trained phases is refused naming the phase field, and a resume that
changes a mixture's interleave mid-stream is refused naming the source field."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.config.checks import ConfigError
from pipeline.train.run_config import check_run, load_config
from pipeline.data.mixture import open_run_data
from pipeline.data.shards import read_manifest
from pipeline.data.sources import Interleave
from pipeline.train.cli import EXIT_CONFIG_ERROR, main
from pipeline.train.run_meta import RunMeta
from tests.fixtures_data import TINY_SEQ_LEN, stdlib_documents, write_corpus
from tests.train.runs import metric_rows, run_inprocess, tag_dir


@pytest.fixture(scope="module")
def small_source(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A small source (one stdlib module's docstrings) with the tiny tokenizer."""
    from data_prep.build_shards import build_shards

    root = tmp_path_factory.mktemp("small_source")
    corpus = write_corpus(root / "small.txt", stdlib_documents(("queue", "heapq", "bisect", "statistics")))
    build_shards([corpus], tiny_tokenizer_dir, root / "small", seq_len=TINY_SEQ_LEN, shard_size_mb=0.02, num_proc=1,
                 progress=False)
    return root / "small"


def mixed_phases(big: Path, small: Path, first: int, second: int, **small_entry) -> str:
    """`phases=[...]`: 'plain' on the run's data, then 'mix' on a mixture of `big` and `small`."""
    entry = {"path": str(small), "weight": 1.0, **small_entry}
    return "phases=" + json.dumps([{"name": "plain", "steps": first},
                                   {"name": "mix", "steps": second,
                                    "sources": [{"path": str(big), "weight": 1.0}, entry]}])


def base(shards: Path, total: int) -> list[str]:
    return [f"data.shards_dir={shards}", f"train.total_steps={total}", "data.mixture_block=16"]


# ---- item 1: a phase's mixture against the phase's own length ----------------------------------------
def test_a_stop_source_that_runs_out_inside_its_phase_is_refused_before_compute(tiny_shards_dir, small_source,
                                                                                  tmp_path, capsys):
    n = read_manifest(small_source).total_sequences  # half of each 16-position block reads `small`
    fits = n // 8 * 2  # 8 samples a step, 4 of every 8 small's (exact every 2 steps): fits x 4 <= n
    steps = fits + 2  # ... and 8 more: it runs out inside the phase
    phases = mixed_phases(tiny_shards_dir, small_source, 2, steps, on_exhausted="stop")
    with pytest.raises(ConfigError, match=rf"phases\[1\] \(mix\): data.sources\[1\] \({small_source}, on_exhausted: "
                                          rf"stop\): its {n} sequences run out at step \d+ \(step \d+ of "
                                          rf"phases.1.steps={steps}\)"):
        check_run(load_config("tiny-mlm", [*base(tiny_shards_dir, 2 + steps), phases]), 1, False)
    out = tmp_path / "run"  # the command line: exit 2, nothing computed (no checkpoint, no metrics)
    assert main(["--config", "tiny-mlm", *base(tiny_shards_dir, 2 + steps), f"train.output_dir={out}", phases]) \
        == EXIT_CONFIG_ERROR
    assert "phases.1.steps=" in capsys.readouterr().err and not (out / "checkpoints").exists()
    check_run(load_config("tiny-mlm", [*base(tiny_shards_dir, 2 + fits),
                                       mixed_phases(tiny_shards_dir, small_source, 2, fits, on_exhausted="stop")]), 1, False)


def test_a_token_budget_inside_a_phase_is_a_share_of_the_phase(tiny_shards_dir, small_source, tmp_path, caplog):
    """Planned over the phase's 2 steps x 8 samples (not the run's 4 x 8, nor refused as needing
    train.total_steps), and the reader of the phase reads that plan: the logged per-source counters
    are the interleave of the phase's plan. Phase 0's start is logged at set-up like phase 1's."""
    budget = read_manifest(small_source).total_tokens // read_manifest(small_source).total_sequences * 4
    phases = mixed_phases(tiny_shards_dir, small_source, 2, 2)
    phases = phases.replace('"weight": 1.0}]', f'"tokens": {budget}}}]')
    args = [*base(tiny_shards_dir, 4), phases]
    plan = check_run(load_config("tiny-mlm", args), 1, False)
    mix = plan.schedule.phases[1]
    assert mix.samples == 16
    phase_plan = open_run_data(mix.data, mix.samples, check=False).plan
    run_plan = open_run_data(mix.data, 32, check=False).plan
    assert phase_plan.quotas != run_plan.quotas  # the test tells the two apart
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert run_inprocess("tiny-mlm", tiny_shards_dir, out, *args[1:]) == 0
    starts = [r.getMessage() for r in caplog.records if "starts (" in r.getMessage()]
    assert starts[0].startswith("step 1: phase 'plain' starts") and starts[1].startswith("step 3: phase 'mix' starts")
    expected = Interleave(phase_plan, mix.seed).counts_before(16)
    assert metric_rows(out)[4]["data/small/samples"] == int(expected[1])
    assert RunMeta.read(tag_dir(out, 4)).manifest_hash == mix.manifest_hash


# ---- item 2: phases edited on --resume ----------------------------------------------------------------
def test_a_resume_may_not_rewrite_trained_phases_but_may_reshape_later_steps(tiny_shards_dir, tmp_path, capsys,
                                                                            caplog):
    """[6, 6] trained to step 12 (checkpoints every 3): resumed at step 6 as [4, 8] (the boundary
    before the checkpoint) is refused naming the phase's field, with `--resume`'s own allowance and
    with train.allow_config_change=true alike; a renamed trained phase too. Resumed at step 3 as
    [4, 8] (the boundary after the checkpoint) it is accepted, logged, and the run records 4 + 8,
    which is what it trains (the phase index of every logged step says so)."""
    phases = "phases=" + json.dumps([{"name": "a", "steps": 6}, {"name": "b", "steps": 6}])
    run = tmp_path / "run"
    assert run_inprocess("tiny-mlm", tiny_shards_dir, run, "train.total_steps=12", "train.checkpoint_every=3",
                         "train.keep_last=10", phases) == 0
    moved = ["phases.0.steps=4", "phases.1.steps=8"]
    for extra in ([], ["train.allow_config_change=true"]):
        capsys.readouterr()
        assert main(["--resume", str(tag_dir(run, 6)), *moved, *extra]) == EXIT_CONFIG_ERROR
        err = capsys.readouterr().err
        assert "phases[0] (a): phases.0.steps gives it 4 steps (steps 1-4), but the checkpoint at step 6 trained it " \
               "for steps 1-6" in err and "would rewrite steps already trained" in err, err
    assert main(["--resume", str(tag_dir(run, 6)), "phases.0.name=first"]) == EXIT_CONFIG_ERROR
    assert "phases[0].name: the checkpoint at step 6 trained phase 'a' here" in capsys.readouterr().err
    assert main(["--resume", str(tag_dir(run, 9)), "phases.0.global_batch_size=4"]) == EXIT_CONFIG_ERROR
    assert "phases[0] (a).global_batch_size: None -> 4, but the phase was trained to its end" in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        assert main(["--resume", str(tag_dir(run, 3)), *moved]) == 0
    assert "phases reshaped after it" in caplog.text and "phases[0] (a) ends at step 4 (was 6)" in caplog.text
    rows = metric_rows(run)
    assert [rows[s]["phase"] for s in range(4, 13)] == [0] + [1] * 8
    meta = RunMeta.read(tag_dir(run, 12))
    assert [(p["name"], p["steps"]) for p in meta.corpus["phases"]] == [("a", 4), ("b", 8)]
    assert [p["steps"] for p in meta.config["phases"]] == [4, 8]


# ---- item 4: a mixture's shares changed on --resume -------------------------------------------------------
def sources(wiki_dir: Path, small_dir: Path, wiki: float, small: float, swap: bool = False) -> str:
    entries = [f"{{path: {wiki_dir}, weight: {wiki}, name: wiki}}", f"{{path: {small_dir}, weight: {small}, name: small}}"]
    return "data.sources=[" + ", ".join(entries[::-1] if swap else entries) + "]"


def test_new_shares_on_resume_continue_each_source_where_it_stood(tiny_shards_dir, small_source, tmp_path, capsys,
                                                                  caplog):
    """0.75 / 0.25 over blocks of 16 for 4 steps (32 samples: 24 + 8), then resumed with 0.5 / 0.5 to
    step 8: the new shares apply from sample 32 (16 + 16 more samples), every source goes on in
    its own pass order (no row skipped or read twice), the counters never go back, and a resume inside
    the new shares is bit for bit. A source moved to another index is refused naming it."""
    from pipeline.train.run_config import load_config as load

    run = tmp_path / "run"
    first = ["data.shards_dir=", "data.mixture_block=16", sources(tiny_shards_dir, small_source, 0.75, 0.25),
             "train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=10"]
    assert run_inprocess("tiny-mlm", Path(""), run, *first) == 0
    assert main(["--resume", str(run), "train.total_steps=8",
                 sources(tiny_shards_dir, small_source, 0.5, 0.5, swap=True)]) == EXIT_CONFIG_ERROR
    assert "data.sources[0]: source small was data.sources[1]" in capsys.readouterr().err
    with caplog.at_level(logging.INFO):
        assert main(["--resume", str(run), "train.total_steps=8", sources(tiny_shards_dir, small_source, 0.5, 0.5)]) == 0
    assert "new shares from sample 32 of the stream (per 16 positions: wiki 12, small 4 -> wiki 8, small 8)" in caplog.text
    rows = metric_rows(run)
    assert [rows[s]["data/small/samples"] for s in (4, 8)] == [8, 8 + 16]  # exact at block boundaries
    assert [rows[s]["data/wiki/samples"] for s in (4, 8)] == [24, 24 + 16]
    for name in ("wiki", "small"):
        counts = [rows[s][f"data/{name}/samples"] for s in range(1, 9)]
        assert counts == sorted(counts)
    # the rows read: each source's in its pass order, the new segment going on from its count
    old = load("tiny-mlm", first).data
    new = load("tiny-mlm", [*first[:2], sources(tiny_shards_dir, small_source, 0.5, 0.5)]).data
    seed = load("tiny-mlm", first).train.seed
    before = open_run_data(old, 32, check=False)
    after = open_run_data(new, 64, check=False)
    assert after.continue_stream(RunMeta.read(tag_dir(run, 4)).mixture, "", 32, seed, 64) is not None
    read = np.concatenate([before.mixture_rows(seed, np.arange(32)), after.mixture_rows(seed, np.arange(32, 64))])
    for s, dataset in enumerate(after.datasets):
        offset, size = int(after._offsets[s]), len(dataset)
        mine = read[(read >= offset) & (read < offset + size)] - offset
        expected = [after._pass(seed, s, k // size)[k % size] for k in range(len(mine))]
        assert mine.tolist() == [int(r) for r in expected]
    again = shutil.copytree(run, tmp_path / "again")
    assert main(["--resume", str(tag_dir(again, 6))]) == 0
    assert metric_rows(again) == rows


def test_a_checkpoint_without_the_record_refuses_new_shares(tiny_shards_dir, small_source):
    """A checkpoint written before the read position was recorded cannot place the new segment: the
    interleave must stay (`interleave_change` names the field), weights written otherwise pass."""
    from pipeline.data.sources import interleave_change

    cfg = load_config("tiny-mlm", ["data.shards_dir=", "data.mixture_block=16",
                                   sources(tiny_shards_dir, small_source, 0.75, 0.25)])
    same = load_config("tiny-mlm", ["data.shards_dir=", "data.mixture_block=16",
                                    sources(tiny_shards_dir, small_source, 3, 1)])
    moved = load_config("tiny-mlm", ["data.shards_dir=", "data.mixture_block=16",
                                     sources(tiny_shards_dir, small_source, 0.5, 0.5)])
    assert interleave_change(cfg.data, 32, same.data, 64) is None
    assert interleave_change(cfg.data, 32, moved.data, 64) == \
        "data.sources[0].weight: source wiki's share moves from 12 to 8 of every 16 positions"
    assert interleave_change(cfg.data, 32, moved.data, 64, continued=True) is None


def test_a_phase_lr_segment_keeps_its_trained_rates(tiny_shards_dir):
    """The phase a checkpoint is in may change its length only where its own LR segment gives its
    trained steps the same rates: a linear decay over the phase's steps re-stretched is refused; a
    wsd segment whose decay starts after the checkpoint is lengthened (the stable rates unchanged)."""
    from types import SimpleNamespace

    from pipeline.train.phases.resume import check_resume

    def schedule_of(first: int, second: int, segment: dict):
        phases = [{"name": "a", "steps": first, "optim": segment}, {"name": "b", "steps": second}]
        cfg = load_config("tiny-mlm", [f"data.shards_dir={tiny_shards_dir}", f"train.total_steps={first + second}",
                                       "phases=" + json.dumps(phases)])
        return check_run(cfg, 1, False).schedule

    def meta_of(schedule, step: int):
        return SimpleNamespace(step=step, config=schedule.root.to_dict(), mixture={},
                               corpus={"phases": [{"name": p.name, "steps": p.steps} for p in schedule.phases]})

    linear = {"warmup_steps": 0, "schedule": "linear"}
    with pytest.raises(ConfigError, match=r"phases\[0\] \(a\): phases.0.steps / optim change the learning rate of its "
                                          r"step 2 \(run step 2\), already trained"):
        check_resume(schedule_of(8, 4, linear), meta_of(schedule_of(6, 6, linear), 3))
    stable = {"warmup_steps": 0, "schedule": "wsd", "decay_steps": 2}
    check_resume(schedule_of(8, 4, stable), meta_of(schedule_of(6, 6, stable), 3))  # steps 1-3 at the peak both ways


def test_a_source_renamed_on_resume_keeps_its_counter_and_its_place(tiny_shards_dir, small_source, tmp_path, caplog):
    """Issue 57: a source is what it reads (its manifest), not its display name. Renamed on `--resume` (same
    path, same index), it goes on from its own count: the rows read and the losses are bitwise the
    uninterrupted run's, and its counter (now `data/<new name>/...`) never goes back."""
    run = tmp_path / "run"
    first = ["data.shards_dir=", "data.mixture_block=16", sources(tiny_shards_dir, small_source, 0.75, 0.25),
             "train.total_steps=8", "train.checkpoint_every=4", "train.keep_last=10"]
    assert run_inprocess("tiny-mlm", Path(""), run, *first) == 0
    reference = metric_rows(run)
    renamed = ("data.sources=[" + f"{{path: {tiny_shards_dir}, weight: 0.75, name: encyclopedia}}, "
               f"{{path: {small_source}, weight: 0.25, name: small}}" + "]")
    with caplog.at_level(logging.INFO):
        assert main(["--resume", str(tag_dir(run, 4)), renamed]) == 0
    assert "renamed since the checkpoint (wiki -> encyclopedia)" in caplog.text
    rows = metric_rows(run)
    for step in range(5, 9):
        assert rows[step]["loss"] == reference[step]["loss"], step
        assert rows[step]["data/encyclopedia/samples"] == reference[step]["data/wiki/samples"]
        assert rows[step]["data/encyclopedia/tokens"] == reference[step]["data/wiki/tokens"]
    assert rows[5]["data/encyclopedia/samples"] > rows[4]["data/wiki/samples"]  # never back


def test_a_renamed_source_moved_to_another_index_is_refused(tiny_shards_dir, small_source):
    """Matched by what it reads, a source that moved keeps being refused, whatever its new name."""
    from pipeline.data.sources import interleave_change

    cfg = load_config("tiny-mlm", ["data.shards_dir=", "data.mixture_block=16",
                                   sources(tiny_shards_dir, small_source, 0.75, 0.25)])
    moved = load_config("tiny-mlm", ["data.shards_dir=", "data.mixture_block=16",
                                     "data.sources=[" + f"{{path: {small_source}, weight: 1, name: tiny}}, "
                                     f"{{path: {tiny_shards_dir}, weight: 3, name: big}}" + "]"])
    assert interleave_change(cfg.data, 32, moved.data, 64, continued=True) == \
        "data.sources[0]: source tiny was data.sources[1] (named small then) (a source keeps its index: its pass " \
        "order is drawn from it; add new sources at the end)"
