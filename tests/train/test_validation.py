"""Validation during training (`eval.*`, `pipeline.train.validation`): every objective logs `val/*`, two
evaluations of one model agree exactly, a run with evaluation trains bit for bit as one without, kill -9
and resume keeps the evaluation schedule, and bad input is refused before compute naming the field."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.train.metrics import read_jsonl
from tests.train.runs import (DEADLINE_S, REPO, _env, kill_after_a_checkpoint, latest, metric_rows, module_state,
                              run_inprocess, start_subprocess, train_command)

VOLATILE = {"step_time_s", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_rss_gb", "peak_mem_gb"}


@pytest.fixture(scope="module")
def split_shards(tmp_path_factory, tiny_corpus_file, tiny_tokenizer_dir) -> tuple[Path, Path]:
    """(training shards, held-out shards) of the tiny corpus: 20% of its documents held out."""
    from data_prep.build_shards import build_shards

    out = tmp_path_factory.mktemp("split") / "shards"
    build_shards([tiny_corpus_file], tiny_tokenizer_dir, out, seq_len=64, shard_size_mb=0.02, num_proc=1,
                 progress=False, holdout_fraction=0.2)
    return out, out / "validation"


def _eval(held: Path, every: int = 2, *extra: str) -> list[str]:
    return [f"eval.shards_dir={held}", f"eval.every={every}", "eval.batches=2", *extra]


def _val_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(out / "metrics.jsonl") if any(k.startswith("val/") for k in r)}


def _train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k not in VOLATILE} for r in read_jsonl(out / "metrics.jsonl")
            if not any(k.startswith("val/") for k in r)}


@pytest.mark.parametrize("preset", ["tiny-mlm", "tiny-capt", "tiny-cocolm"])
def test_evaluation_changes_nothing_in_training(preset, split_shards, tmp_path):
    """The key promise: the training metrics of every step and the final weights are bitwise those of the
    run without evaluation (eval takes nothing from the training RNG, sample order or objective state:
    CAPT's memory queue, COCO-LM's generator sampling), and the run logs val/* at steps 2, 4 and 5."""
    shards, held = split_shards
    plain, evaluated = tmp_path / "plain", tmp_path / "eval"
    assert run_inprocess(preset, shards, plain, "train.total_steps=5") == 0
    assert run_inprocess(preset, shards, evaluated, "train.total_steps=5", *_eval(held)) == 0
    assert _train_records(evaluated) == _train_records(plain)
    a, b = module_state(latest(plain)), module_state(latest(evaluated))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    vals = _val_records(evaluated)
    assert sorted(vals) == [2, 4, 5]
    objectives = {k.split("/")[1] for k in vals[5] if k.count("/") == 2}
    expected = {"tiny-mlm": {"mlm"}, "tiny-capt": {"mlm", "capt"}, "tiny-cocolm": {"cocolm"}}[preset]
    assert expected | {"mlm_head", "health"} <= objectives
    assert all(torch.isfinite(torch.tensor(v)) for k, v in vals[5].items() if k.startswith("val/"))
    # where it shows: the checkpoint's meta (the model card's source), cpt-status, the card's section
    from pipeline.export.model_card import validation_section
    from pipeline.status import collect, format_detail
    from pipeline.train.run_meta import RunMeta

    summary = RunMeta.read(latest(evaluated)).validation
    assert summary["step"] == 5 and summary["evaluations"] == 3
    assert summary["terms"]["val/loss"]["latest"] == vals[5]["val/loss"]
    assert summary["terms"]["val/loss"]["best"] == min(v["val/loss"] for v in vals.values())
    assert collect(evaluated).validation == summary and "val/mlm_head/accuracy" in format_detail(collect(evaluated))
    card = "\n".join(validation_section(summary))
    assert "## Validation (held-out documents, step 5)" in card and "`val/mlm_head/accuracy`" in card
    assert "vs plateau" in card  # beside its chance level


def _validator(preset: str, shards: Path, held: Path, overrides: tuple[str, ...] = (), **eval_options):
    from pipeline.train.run_config import check_run, load_config
    from pipeline.train.validation import open_validator
    from pipeline.train.loop import build_run_model

    cfg = load_config(preset, [f"data.shards_dir={shards}", f"eval.shards_dir={held}", "eval.every=1",
                               *[f"eval.{k}={v}" for k, v in eval_options.items()], *overrides])
    plan = check_run(cfg, 1, False)
    model = build_run_model(cfg, plan)
    return model, open_validator(cfg, plan, model, 0, 1, torch.device("cpu"))


@pytest.mark.parametrize("preset", ["tiny-capt", "tiny-cocolm", "tiny-infoword"])
def test_two_evaluations_agree_and_leave_the_model_as_it_was(preset, split_shards):
    """Same model, two evaluations (and a second validator, as another run on the same set would build):
    identical values; the global RNGs, the weights, the objectives' state (CAPT's queue) and train mode
    are as before."""
    shards, held = split_shards
    model, validator = _validator(preset, shards, held)
    _, other = _validator(preset, shards, held)  # (building a model seeds torch: before the RNG is read)
    model.train()
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    extra = json.dumps(model.extra_state_for_checkpoint(), default=lambda t: t.tolist())
    first = validator.evaluate(model, model, 3, 10, 2)
    second = validator.evaluate(model, model, 3, 10, 2)
    third = other.evaluate(model, model, 3, 10, 2)
    assert first == second == third and "val/mlm_head/accuracy" in first
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert json.dumps(model.extra_state_for_checkpoint(), default=lambda t: t.tolist()) == extra


@pytest.mark.timeout(900)
def test_validation_of_a_compiled_model_is_eager_validation_and_keeps_it_compiled(split_shards):
    """`model.compile=true`: the validator's numbers are those of the eager model with the same weights (float
    tolerance: compiled kernels sum in another order), two evaluations agree exactly, and evaluating (eval mode,
    no_grad, its own micro-batch size of 3 against training's 4) pushes no compiled layer into dynamo's eager
    fallback (`pipeline.model.compile_watch`), so the run's training steps stay compiled."""
    from pipeline.model import compile_watch

    shards, held = split_shards
    eager, eager_validator = _validator("tiny-capt", shards, held, micro_batch_size=3)
    compiled, compiled_validator = _validator("tiny-capt", shards, held, ("model.compile=true",), micro_batch_size=3)
    weights = compiled.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in eager.state_dict().items())  # one seed, one initialisation
    from torch._dynamo.utils import counters

    before, compiled_frames = dict(compile_watch.eager_fallbacks), counters["frames"]["ok"]
    first = compiled_validator.evaluate(compiled, compiled, 3, 10, 2)
    assert counters["frames"]["ok"] > compiled_frames  # the evaluation ran compiled layers
    second = compiled_validator.evaluate(compiled, compiled, 3, 10, 2)
    reference = eager_validator.evaluate(eager, eager, 3, 10, 2)
    assert first == second and first.keys() == reference.keys() and "val/capt/loss" in first
    for key, value in reference.items():
        assert first[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert compile_watch.eager_fallbacks == before


def test_masked_positions_fixed_by_the_eval_seed(split_shards):
    """The validation batches are a function of eval.seed alone: another seed, other masks."""
    shards, held = split_shards
    _, a = _validator("tiny-mlm", shards, held)
    _, b = _validator("tiny-mlm", shards, held, seed=1)
    batch_a, again, batch_b = a.host_batches()[0], _validator("tiny-mlm", shards, held)[1].host_batches()[0], \
        b.host_batches()[0]
    assert torch.equal(batch_a["mlm_labels"], again["mlm_labels"])
    assert not torch.equal(batch_a["mlm_labels"], batch_b["mlm_labels"])


def test_kill_and_resume_keeps_the_evaluation_schedule(split_shards, tmp_path):
    """kill -9 after a checkpoint, resume: the evaluations are at the same steps, each once, with the values of
    the uninterrupted run."""
    shards, held = split_shards
    extra = ["train.total_steps=8", "train.checkpoint_every=2", "train.keep_best=val/mlm_head/loss", *_eval(held, 3)]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_inprocess("tiny-mlm", shards, whole, *extra) == 0
    proc = start_subprocess("tiny-mlm", shards, killed, *extra)
    saved = kill_after_a_checkpoint(killed, 5, proc)
    assert saved < 8
    rerun = subprocess.run(train_command("tiny-mlm", shards, killed, *extra), cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    steps = [r["step"] for r in read_jsonl(killed / "metrics.jsonl") if any(k.startswith("val/") for k in r)]
    assert steps == [3, 6, 8]
    assert _val_records(killed) == _val_records(whole)
    from pipeline.train.run_meta import RunMeta  # the best values survived the kill (history from metrics.jsonl)

    assert RunMeta.read(latest(killed)).validation == RunMeta.read(latest(whole)).validation
    best = json.loads((whole / "checkpoints" / "best.json").read_text())  # train.keep_best: the same tag kept
    assert best["metric"] == "val/mlm_head/loss" and best["step"] in (3, 6, 8)
    assert json.loads((killed / "checkpoints" / "best.json").read_text()) == best
    assert (killed / "checkpoints" / best["tag"]).is_dir()
    assert metric_rows(killed).keys() == metric_rows(whole).keys()


def test_keep_best_naming_a_metric_the_evaluation_does_not_log(split_shards, tmp_path):
    """A `val/` name of a known objective but no such term: refused at the first evaluation, listing the names."""
    shards, held = split_shards
    out = tmp_path / "run"
    proc = subprocess.run(train_command("tiny-mlm", shards, out, "train.total_steps=4", *_eval(held),
                                        "train.keep_best=val/mlm/accurcy", "train.keep_best_mode=max"),
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: train.keep_best=val/mlm/accurcy: no evaluation logs it (did you mean 'val/mlm/accuracy'?)"), errors


@pytest.fixture(scope="module")
def other_sets(tmp_path_factory, tiny_corpus_file, tiny_tokenizer_dir) -> dict[str, Path]:
    """Held-out sets that do not fit the run: another tokenizer, another seq_len, a tiny one."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer
    from tests.fixtures_data import stdlib_documents, write_corpus

    root = tmp_path_factory.mktemp("other")
    other_tok = train_tokenizer([tiny_corpus_file], root / "tok", vocab_size=600, progress=False)
    small = write_corpus(root / "small.txt", stdlib_documents(("bisect",)))
    sets = {"tokenizer": (other_tok, 64, tiny_corpus_file), "seq_len": (tiny_tokenizer_dir, 32, tiny_corpus_file),
            "small": (tiny_tokenizer_dir, 64, small)}
    for name, (tok, seq_len, corpus) in sets.items():
        build_shards([corpus], tok, root / name, seq_len=seq_len, shard_size_mb=0.02, num_proc=1, progress=False)
    return {name: root / name for name in sets}


@pytest.mark.parametrize("case, message", [
    ("tokenizer", "eval.shards_dir={held} was built with another tokenizer than the training data"),
    ("seq_len", "eval.shards_dir={held} has seq_len=32 but data.seq_len has seq_len=64"),
    ("small", "eval.shards_dir={held} holds"),
    ("itself", "eval.shards_dir={held} is the training data itself"),
    ("every0", "eval.every=0 with eval.shards_dir={held}"),
    ("every_above", "eval.every=9 exceeds train.total_steps=4"),
    ("missing", "eval.shards_dir={held}: no such directory"),
    ("best_typo", "train.keep_best=val/mlmx/loss: no objective logs it (did you mean 'mlm'?)"),
    ("best_mode", "train.keep_best=val/mlm_head/accuracy with train.keep_best_mode=min: higher is better for it"),
    ("best_no_eval", "train.keep_best=val/loss: a validation metric, but eval.shards_dir is not set"),
])
def test_bad_validation_input_is_one_line_before_compute(case, message, split_shards, other_sets, tmp_path):
    shards, good = split_shards
    held = {"itself": shards, "missing": tmp_path / "nowhere"}.get(case) or other_sets.get(case) or good
    every = {"every0": 0, "every_above": 9}.get(case, 2)
    extra = {"small": ["eval.micro_batch_size=64"], "best_typo": ["train.keep_best=val/mlmx/loss"],
             "best_mode": ["train.keep_best=val/mlm_head/accuracy"]}.get(case, [])
    evaluation = [f"eval.shards_dir={held}", f"eval.every={every}"]
    if case == "best_no_eval":
        evaluation = ["train.keep_best=val/loss"]
    out = tmp_path / "run"
    proc = subprocess.run(train_command("tiny-mlm", shards, out, "train.total_steps=4", *evaluation, *extra),
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.format(held=held) in errors[0], proc.stderr[-2000:]
    assert not out.exists()  # nothing written


def test_held_out_documents_are_never_in_training(split_shards, tiny_shards_dir, tiny_corpus_file):
    """By document: each document of the corpus is packed by exactly one of the two builds, the one the
    rule (xxh3 of its text) names; together they hold the whole corpus (the build without a holdout)."""
    from data_prep.holdout import DocumentSplit
    from data_prep.readers import ReadOptions, iter_documents, resolve_inputs
    from pipeline.data.shards import read_manifest

    shards, held = split_shards
    train, val, whole = read_manifest(shards), read_manifest(held), read_manifest(tiny_shards_dir)
    texts = [d.text for s in resolve_inputs([tiny_corpus_file]) for d in iter_documents(s, ReadOptions())
             if d.text.strip()]
    held_out = [t for t in texts if DocumentSplit(0.2, "validation").keeps(t)]
    assert 0 < len(held_out) < len(texts)
    assert val.stats["documents"] == len(held_out) == train.stats["other_side_documents"]
    assert train.stats["documents"] == len(texts) - len(held_out) == val.stats["other_side_documents"]
    assert train.stats["text_tokens"] + val.stats["text_tokens"] == whole.stats["text_tokens"]
    assert train.build_args["fingerprint_inputs"]["holdout"]["side"] == "train"
    assert val.build_args["fingerprint_inputs"]["holdout"]["side"] == "validation"
    assert val.tokenizer_hash == train.tokenizer_hash and val.seq_len == train.seq_len


def test_a_phase_with_its_own_seq_len_needs_a_matching_set(split_shards, other_sets, tmp_path):
    shards, held = split_shards
    phases = [{"name": "short", "steps": 2},
              {"name": "other", "steps": 2, "shards_dir": str(other_sets["seq_len"]), "seq_len": 32}]
    out = tmp_path / "run"
    proc = subprocess.run(train_command("tiny-mlm", shards, out, "train.total_steps=4", f"eval.shards_dir={held}",
                                        "eval.every=2", "phases=" + json.dumps(phases)),
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: eval.shards_dir={held} has seq_len=64 but phases[1] (other) has seq_len=32: validation "
                      "needs a held-out set of the same seq_len (build one with that --seq-len)"], proc.stderr[-2000:]
    assert not out.exists()


def test_held_out_masked_accuracy_leaves_the_plateau(split_shards, tmp_path):
    """After 300 steps of the learning guard's recipe (tests/objectives/test_learning_signals.py), the
    shared MLM head reads held-out documents above the unigram plateau + PLATEAU_MARGIN and below the unigram
    entropy (measured: 0.091 vs plateau 0.049; 5.22 vs 5.61 nats), and the one-line verdicts say learned."""
    from pipeline.monitor.signals import PLATEAU_MARGIN
    from pipeline.train.validation import val_signals

    shards, held = split_shards
    out = tmp_path / "learn"
    recipe = ("model.dropout=0.0", "model.attention_dropout=0.0", "optim.lr=3e-3", "optim.warmup_steps=20",
              "data.micro_batch_size=32", "data.global_batch_size=32", "train.total_steps=300",
              "train.checkpoint_every=300", "train.log_every=50")
    assert run_inprocess("tiny-mlm", shards, out, *recipe, f"eval.shards_dir={held}", "eval.every=300",
                         "eval.batches=8") == 0
    final = _val_records(out)[300]
    assert final["val/mlm_head/accuracy"] >= final["val/health/unigram_accuracy"] + PLATEAU_MARGIN
    assert final["val/mlm_head/loss"] < final["val/health/unigram_entropy"]
    verdicts = {s.term: s.learned for s in val_signals(final)}
    assert verdicts["val/mlm_head/accuracy"] and verdicts["val/mlm_head/loss"] and verdicts["val/mlm/loss"]


def test_two_ranks_evaluate_their_slices_as_one_rank_evaluates_all(split_shards, tmp_path):
    """2 ranks under ZeRO-3 (gloo) x 2 evaluation batches read the 4 micro-batches 1 rank reads with 4: the
    same positions, masks and samples (keyed by position), reduced once, so the same val/ values within the
    fp32 reduction-order tolerance of training across rank counts (`test_multirank.py`); dropout off."""
    from tests.train.runs import run_torchrun

    shards, held = split_shards
    run = ["train.total_steps=4", "deepspeed.config=zero3", "model.dropout=0.0", "model.attention_dropout=0.0",
           f"eval.shards_dir={held}", "eval.every=2"]
    two, one = tmp_path / "two", tmp_path / "one"
    run_torchrun("tiny-mlm", shards, two, *run, "eval.batches=2")
    assert run_inprocess("tiny-mlm", shards, one, *run, "eval.batches=4") == 0
    a, b = _val_records(two), _val_records(one)
    assert sorted(a) == sorted(b) == [2, 4]
    for step in (2, 4):
        assert a[step].keys() == b[step].keys() and a[step]["val/mlm_head/positions"] == b[step]["val/mlm_head/positions"]
        keys = sorted(k for k in a[step] if k.startswith("val/"))
        torch.testing.assert_close(torch.tensor([a[step][k] for k in keys]), torch.tensor([b[step][k] for k in keys]),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.slow  # three training runs: outside the GPU lease's 40 s pytest row (benchmarks.gpu_suite.kernel_rows)
def test_bf16_validation_and_resume_from_a_bf16_checkpoint(split_shards, tmp_path):
    """On a GPU, `deepspeed.precision=bf16`: the run logs finite val/* at every evaluation step; killed after a
    checkpoint, its bf16 checkpoint passes the safe loader on resume (`pipeline.safe_load`: every .pt of
    the tag unpickled with weights_only and the allow-list), and the evaluations after resume are the
    uninterrupted run's within bf16 rounding (GPU kernels need not repeat bit for bit)."""
    shards, held = split_shards
    extra = ["deepspeed.precision=bf16", "train.total_steps=8", "train.checkpoint_every=2", *_eval(held, 3)]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_inprocess("tiny-mlm", shards, whole, *extra) == 0
    proc = start_subprocess("tiny-mlm", shards, killed, *extra)
    assert kill_after_a_checkpoint(killed, 5, proc) < 8
    rerun = subprocess.run(train_command("tiny-mlm", shards, killed, *extra), cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    a, b = _val_records(whole), _val_records(killed)
    assert sorted(a) == sorted(b) == [3, 6, 8]
    for key, value in a[8].items():
        if key.startswith("val/"):
            assert torch.isfinite(torch.tensor(value)), key
            assert b[8][key] == pytest.approx(value, rel=2e-2, abs=1e-3), key


def test_an_mlm_run_reports_one_validation_loss(split_shards, tmp_path):
    """Issue 58/57: in an MLM-only run the objective's loss *is* the head's yardstick (same positions, targets,
    logits): `val/mlm/loss`, `val/mlm_head/loss` and `val/loss` are one number (the set's loss over all its masked
    positions), and the two accuracies one too. A run of MLM beside another objective keeps `val/loss` their
    weighted sum."""
    out = tmp_path / "mlm"
    assert run_inprocess("tiny-mlm", split_shards[0], out, "train.total_steps=4", *_eval(split_shards[1])) == 0
    for record in _val_records(out).values():
        assert record["val/mlm/loss"] == record["val/mlm_head/loss"] == record["val/loss"]
        assert record["val/mlm/accuracy"] == record["val/mlm_head/accuracy"]
    both = tmp_path / "mlm_capt"
    assert run_inprocess("tiny-capt", split_shards[0], both, "train.total_steps=4", *_eval(split_shards[1])) == 0
    record = _val_records(both)[4]
    assert record["val/mlm/loss"] == record["val/mlm_head/loss"]
    from pipeline.train.run_config import load_config

    weights = load_config("tiny-capt").objectives
    assert record["val/loss"] == pytest.approx(sum(w * record[f"val/{n}/loss"] for n, w in weights.items()), rel=1e-6)
