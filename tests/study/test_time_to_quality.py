"""The time-to-quality study's pieces: the work directory's settings check, held-out splits, selection on the
selection split only, the baseline health check and its refusal, resume, and the held-out metrics against
direct computations (the whole study through `cpt-study run`: tests/study/test_local.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.study.targets import EvalPoint
from pipeline.study.data import main as split_main
from pipeline.study.data import prepare_sst2, split_halves
from pipeline.study.evaluate import cached, heldout_metrics, merge_finetune_summaries, top_token_of
from pipeline.study.report import baseline_health, paper_baseline_health, target_rows
from pipeline.study.local import evaluate_run
from pipeline.study.spec import StudyError, Task, check_work_dir, load_study
from pipeline.study.units import RunKey, cumulative_hours, downstream_at, select_lrs


def test_cumulative_hours_sum_step_times_times_world_size() -> None:
    records = [{"step": 2, "step_time_s": 7200.0}, {"step": 1, "step_time_s": 3600.0}]
    assert cumulative_hours(records, world_size=4) == {1: 4.0, 2: 12.0}


def test_heldout_text_is_split_at_an_article_boundary(tmp_path: Path) -> None:
    articles = [f" = Article {i} = \n" + f" Body of article {i} , with some words .\n" * (i + 1) for i in range(4)]
    text = tmp_path / "test.txt"
    text.write_text("".join(articles))
    info = split_halves(text, tmp_path / "a.txt", tmp_path / "b.txt")
    first, second = (tmp_path / "a.txt").read_text(), (tmp_path / "b.txt").read_text()
    assert first + second == text.read_text() and info["by"] == "article"
    assert second.startswith(" = Article ") and first.count(" = Article") in (2, 3)
    plain = tmp_path / "plain.txt"
    plain.write_text("".join(f"line {i}\n" for i in range(10)))
    assert split_halves(plain, tmp_path / "c.txt", tmp_path / "d.txt")["by"] == "line"
    assert (tmp_path / "c.txt").read_text().count("\n") == 5
    assert split_main([str(text), str(tmp_path / "halves")]) == 0  # the command the study's docs give
    assert (tmp_path / "halves" / "report.txt").read_text() == second
    assert split_main([str(tmp_path / "missing.txt"), str(tmp_path / "h2")]) == 2


def _sst2_dir(root: Path, n: int = 60, test_labels: bool = True) -> Path:
    root.mkdir(parents=True)
    rows = [f"sentence number {i} is {'good' if i % 2 else 'bad'}\t{i % 2}\n" for i in range(n)]
    (root / "train.tsv").write_text("sentence\tlabel\n" + "".join(rows))
    (root / "dev.tsv").write_text("sentence\tlabel\n" + "".join(rows[:10]))
    (root / "test.tsv").write_text("sentence\tlabel\n" + "".join(rows[:10]) if test_labels else "index\tsentence\n0\tx\n")
    return root


def test_sst2_selection_split_never_overlaps_the_fine_tuning_examples(tmp_path: Path) -> None:
    from pipeline.eval.glue import GLUE_TASKS, load_split, read_tsv, subset_split

    root = _sst2_dir(tmp_path / "SST-2")
    sst2, select, note = prepare_sst2(str(root), tmp_path / "work", n_train=30, n_select=20, seed=5)
    assert sst2 == root and "selection on 20 other train examples" in note
    train = load_split(read_tsv(root / "train.tsv", "sst2"), GLUE_TASKS["sst2"])
    tuned = {train.texts[int(i)][0] for i in subset_split(train, 30, 5).ids()}  # what finetune --train-subset uses
    chosen = [line.split("\t")[0] for line in select.read_text().splitlines()[1:]]
    assert len(chosen) == 20 and not tuned & set(chosen)
    assert prepare_sst2(str(tmp_path / "absent"), tmp_path / "w2", 30, 20, 5)[:2] == (None, None)
    assert "SST-2 not found" in prepare_sst2(str(tmp_path / "absent"), tmp_path / "w2", 30, 20, 5)[2]
    with pytest.raises(ValueError, match="no labels"):
        prepare_sst2(str(_sst2_dir(tmp_path / "unlabelled", test_labels=False)), tmp_path / "w3", 30, 20, 5)
    with pytest.raises(ValueError, match="train_examples 50"):
        prepare_sst2(str(root), tmp_path / "w4", 50, 20, 5)


def _record(select_acc: float, dev_acc: float, select_loss: float, report_loss: float, status: str = "ok") -> dict:
    downstream = {"pretrained": {"select": {"mean": select_acc}, "dev": {"mean": dev_acc}}}
    heldout = {"select": {"mlm_loss": select_loss}, "report": {"mlm_loss": report_loss}}
    return {"status": status, "final": {"downstream": downstream, "heldout": heldout}}


def test_selection_reads_the_selection_split_only() -> None:
    sweep = {"mlm": {5e-4: _record(0.70, 0.90, 5.0, 4.0), 1e-3: _record(0.80, 0.60, 6.0, 3.0),
                     2e-3: _record(0.99, 0.99, 1.0, 1.0, status="failed")},
             "taco": {5e-4: _record(0.75, 0.7, 5.5, 5.0), 1e-3: _record(0.75, 0.7, 5.0, 6.0)}}
    chosen = select_lrs(sweep, "sst2_select_accuracy")
    assert chosen["mlm"]["lr"] == 1e-3  # best on select, although dev and the report half favour other rates
    assert "0.002" not in chosen["mlm"]["values"]  # a failed run is no candidate
    assert chosen["taco"]["lr"] == 1e-3  # a tie on select goes to the lower held-out *selection* loss
    assert select_lrs(sweep, "heldout_select_mlm_loss")["mlm"]["lr"] == 5e-4  # without SST-2: lower loss wins
    assert select_lrs({"capt": {1e-3: _record(0, 0, 0, 0, status="failed")}}, "sst2_select_accuracy")["capt"]["lr"] is None


def _curves(acc: list[list[float]], unigram: float = 0.05, cosine: float = 0.3, dev: float = 0.8) -> dict:
    return {seed: [EvalPoint(100 * (i + 1), 0.01 * (i + 1), {"heldout_mlm_acc": a, "heldout_mlm_loss": 5 - a,
                                                               "unigram_acc": unigram, "token_cosine": cosine,
                                                               "sst2_dev_accuracy": dev + a / 10})
                   for i, a in enumerate(values)] for seed, values in enumerate(acc, start=1)}


def test_a_healthy_baseline_gets_ratios_and_a_failed_one_gets_none() -> None:
    mlm = _curves([[0.10, 0.20, 0.30], [0.12, 0.22, 0.31], [0.11, 0.21, 0.29]])
    taco = _curves([[0.30, 0.35, 0.40], [0.31, 0.36, 0.41], [0.30, 0.34, 0.39]])
    health = baseline_health(mlm, floor_dev=[0.69, 0.7, 0.71], margin=0.05)
    assert health["passed"] and [c["passed"] for c in health["checks"]] == [True, True, True]
    rows = {(r["objective"], r["metric"]): r for r in target_rows({"mlm": mlm, "taco": taco}, health)}
    assert rows[("taco", "heldout_mlm_acc")]["step_ratio"] == "0.333 [0.333, 0.333]"
    assert rows[("mlm", "heldout_mlm_acc")]["step_ratio"] == "1.000 [1.000, 1.000]"

    collapsed = baseline_health(_curves([[0.1, 0.2, 0.3]] * 3, cosine=0.97), floor_dev=[0.7], margin=0.05)
    plateau = baseline_health(_curves([[0.05, 0.06, 0.07]] * 3), floor_dev=[0.7], margin=0.05)
    below_floor = baseline_health(mlm, floor_dev=[0.9], margin=0.05)
    # the study's case: a floor whose fine-tuning seeds spread as widely as MLM's gain is not beaten
    noisy_floor = baseline_health(mlm, floor_dev=[0.49, 0.71, 0.67], margin=0.05)
    assert noisy_floor['checks'][2]['passed'] is False and 'Welch' in noisy_floor['checks'][2]['detail']
    assert [c["passed"] for c in collapsed["checks"]] == [False, True, True]
    assert [c["passed"] for c in plateau["checks"]] == [True, False, True]
    assert [c["passed"] for c in below_floor["checks"]] == [True, True, False]
    for failed in (collapsed, plateau, below_floor):
        assert not failed["passed"]
        refused = target_rows({"mlm": mlm, "taco": taco}, failed)
        assert refused and all(r[f].startswith("refused") for r in refused
                               for f in ("steps", "hours", "step_ratio", "hours_ratio"))


def _study_file(tmp_path: Path, shards: Path, name: str = "s.yaml", **changes) -> Path:
    """A tiny study file over `shards` (2 steps, an evaluation point at each), with top-level `changes`."""
    raw = {"name": "t", "work_dir": str(tmp_path / "work"), "budget": {"steps": 2}, "eval_every": 1,
           "objectives": {"mlm": {"preset": "tiny-mlm", "overrides": ["model.size=tiny", "data.micro_batch_size=4",
                                                                    "data.global_batch_size=4"]}},
           "seeds": [1], "lrs": [1e-3], "shards": {k: str(shards) for k in ("train", "heldout_select", "heldout_report")},
           "finetune": {"seeds": [1], "lr": 1e-4, "epochs": 1}, "keep_checkpoints": False, **changes}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_work_dir_refuses_other_settings_but_grows_with_objectives_and_seeds(tmp_path: Path,
                                                                                 tiny_shards_dir: Path) -> None:
    taco = {"preset": "tiny-taco"}
    mlm = {"preset": "tiny-mlm"}
    check_work_dir(load_study(_study_file(tmp_path, tiny_shards_dir, objectives={"mlm": mlm, "taco": taco}, seeds=[1, 2])))
    check_work_dir(load_study(_study_file(tmp_path, tiny_shards_dir, objectives={"mlm": mlm, "taco": taco, "capt": {
        "preset": "tiny-capt"}}, seeds=[1, 2, 3])))  # an objective and a seed added: the study grows
    check_work_dir(load_study(_study_file(tmp_path, tiny_shards_dir, objectives={"mlm": mlm})))  # a subset: fine
    for changes, message in (({"budget": {"steps": 1}}, "budget: {'steps': 2} there, {'steps': 1} now"),
                             ({"seeds": [7, 1]}, "sweep_seed: 1 there, 7 now"),
                             ({"objectives": {"mlm": mlm, "taco": {**taco, "overrides": ["model.dropout=0.0"]}}},
                              "objectives.taco"),
                             ({"finetune": {"lr": 5e-4}}, "finetune")):
        with pytest.raises(StudyError, match="holds a study made with other settings") as err:
            check_work_dir(load_study(_study_file(tmp_path, tiny_shards_dir, **{"objectives": {"mlm": mlm}, **changes})))
        assert message in str(err.value)


def test_runs_table_names_the_signals_at_chance() -> None:
    from pipeline.study.report import signals_at_chance

    signals = [{"term": "taco/loss", "value": 0.4, "reference": 2.2, "learned": True},
               {"term": "mlm/accuracy", "value": 0.058, "reference": 0.057, "learned": False}]
    assert signals_at_chance({"signals": signals}) == "mlm/accuracy 0.058 vs 0.057"
    assert signals_at_chance({"signals": signals[:1]}) == "none"
    assert signals_at_chance({}) is None  # a run recorded before the signals were


def test_cached_results_are_not_recomputed(tmp_path: Path) -> None:
    calls = []
    for _ in range(2):
        assert cached(tmp_path / "r.json", lambda: calls.append(1) or {"value": 3}) == {"value": 3}
    assert calls == [1]


@pytest.mark.timeout(300)
def test_a_finished_run_is_skipped_on_a_rerun(tiny_shards_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from pipeline.study.data import StudyData

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    monkeypatch.setenv("PYTHONPATH", str(repo))
    study = load_study(_study_file(tmp_path, tiny_shards_dir, work_dir=str(tmp_path)))  # run locally
    assert study.tasks == [] and study.steps_of["mlm"] == 2 and study.eval_steps("mlm") == [1, 2]
    key = RunKey("mlm", 1e-3, 1)
    first = evaluate_run(study, key, curves=False)
    run_dir = key.directory(tmp_path)
    assert (run_dir / "eval" / "heldout_step_1.json").is_file() and (run_dir / "eval" / "heldout_step_2.json").is_file()
    assert first["status"] == "ok" and first["steps"] == [1, 2] and set(first["device_hours"]) == {"1", "2"}
    assert (run_dir / "hf" / "step_2" / "config.json").is_file() and not (run_dir / "checkpoints").exists()
    assert first["train_health"]["logged_steps"] == 2 and first["train_health"]["token_cosine"] is not None
    assert {s["term"] for s in first["train_health"]["signals"]} == {"mlm/accuracy", "mlm/loss", "health/token_cosine"}
    log = (run_dir / "train.log").read_text()
    assert evaluate_run(study, key, curves=False) == first  # nothing re-trained or re-converted
    assert (run_dir / "train.log").read_text() == log

    top = top_token_of(tiny_shards_dir)
    metrics = heldout_metrics(run_dir / "hf" / "step_2", tiny_shards_dir, top_token=top, max_sequences=16)
    _check_heldout_against_direct(run_dir / "hf" / "step_2", tiny_shards_dir, top, metrics)

    # SST-2 fine-tuning: one cached result per fine-tuning seed; adding a seed fine-tunes only that seed
    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    rows = [("a good film", 1), ("a bad film", 0), ("good", 1), ("bad", 0)] * 4
    for split in ("train", "dev", "test"):
        (sst2 / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    select = tmp_path / "select.tsv"
    select.write_text("sentence\tlabel\ngood film\t1\nbad film\t0\n")
    data = StudyData(tiny_shards_dir, tiny_shards_dir, tiny_shards_dir, sst2, select)
    args = study.args("mlm", Task("sst2", sst2, train_examples=8, select_examples=2))
    one = downstream_at(key, 2, data, args, tmp_path)
    seed_1 = run_dir / "downstream" / "step_2" / "seed_1.json"
    written = seed_1.stat().st_mtime_ns
    assert len(one["pretrained"]["dev"]["seeds"]) == 1 and set(one["pretrained"]) == {"dev", "select"}
    args.finetune_seeds = [1, 2]
    two = downstream_at(key, 2, data, args, tmp_path)
    assert seed_1.stat().st_mtime_ns == written  # seed 1 was not fine-tuned again
    assert two["pretrained"]["dev"]["seeds"][0] == one["pretrained"]["dev"]["seeds"][0]
    assert len(two["pretrained"]["dev"]["seeds"]) == 2 and (seed_1.parent / "seed_2.json").is_file()
    final = downstream_at(key, 2, data, args, tmp_path, final_test=True, random_init=True)
    assert len(final["pretrained"]["test"]["seeds"]) == 2 and len(final["random_init"]["dev"]["seeds"]) == 2


def test_fine_tuning_records_of_several_seeds_merge_in_order() -> None:
    a = {"pretrained": {"dev": {"seeds": [0.5], "mean": 0.5}, "test": {"seeds": [0.4], "mean": 0.4}}}
    b = {"pretrained": {"dev": {"seeds": [0.7, 0.9], "mean": 0.8}}}
    merged = merge_finetune_summaries([a, b])
    assert merged["pretrained"]["dev"] == {"seeds": [0.5, 0.7, 0.9], "mean": pytest.approx(0.7)}
    assert "test" not in merged["pretrained"]  # a mean over some of the seeds would be another figure


def _check_heldout_against_direct(model_dir: Path, shards: Path, top: int, metrics: dict) -> None:
    """The unigram plateau is measured on exactly the masked positions the accuracy is measured on."""
    from pipeline.data.corruption import CorruptionCollator
    from pipeline.data.reader import ShardDataset

    dataset = ShardDataset(shards)
    rows = np.arange(16)
    batch = CorruptionCollator({"masked"}, dataset.special_tokens, dataset.vocab_size, 0).collate(
        *dataset.take(rows), rows)
    labels = batch["mlm_labels"]
    selected = labels != -100
    # accuracy and plateau are read at the [MASK]-replaced positions only (kept tokens give a copy bonus)
    masked = selected & (batch["masked_ids"] == dataset.special_tokens["mask"])
    kept = selected & (batch["masked_ids"] == labels)
    targets = labels[masked]
    assert 0 < metrics["masked_tokens"] == targets.numel() < int(selected.sum())
    assert metrics["kept_tokens"] == int(kept.sum())
    assert metrics["unigram_acc"] == pytest.approx(float((targets == top).float().mean()))
    assert 0.0 <= metrics["mlm_acc"] <= 1.0 and -1.0 <= metrics["token_cosine"] <= 1.0
    assert metrics["collapsed"] == (metrics["token_cosine"] > 0.9)
    # the replaced regime: every selected position holds a seeded unigram draw (never a special token);
    # scored where the draw differs from the original, through the model as loaded
    import torch
    from transformers import AutoModelForMaskedLM

    from pipeline.monitor.health import unigram_counts

    counts = torch.from_numpy(unigram_counts(dataset)).double()
    swapped = batch["input_ids"].clone()
    swapped[selected] = torch.multinomial(counts, int(selected.sum()), replacement=True,
                                          generator=torch.Generator().manual_seed(0))
    assert not torch.isin(swapped[selected], torch.tensor(sorted(dataset.special_tokens.values()))).any()
    at = selected & (swapped != labels)
    assert int(selected.sum()) * 0.9 < metrics["replaced_tokens"] == int(at.sum())
    assert metrics["replaced_unigram_acc"] == pytest.approx(float((labels[at] == top).float().mean()))
    with torch.no_grad():
        logits = AutoModelForMaskedLM.from_pretrained(str(model_dir)).eval()(
            input_ids=swapped, attention_mask=batch["attention_mask"]).logits[at]
    assert metrics["replaced_acc"] == pytest.approx(float((logits.argmax(-1) == labels[at]).float().mean()))
    assert metrics["replaced_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels[at])), rel=1e-5)


def test_cocolm_gets_a_row_against_electra_the_baseline_of_its_papers_claim() -> None:
    """COCO-LM's claim is stated against ELECTRA ("ELECTRA's MNLI accuracy with 50% of its GPU hours"): with
    both in a study the targets hold COCO-LM's time to ELECTRA's final quality, paired per seed, beside its
    time to MLM's; without ELECTRA there is no such row."""
    mlm = _curves([[0.10, 0.20, 0.30], [0.12, 0.22, 0.31], [0.11, 0.21, 0.29]])
    electra = _curves([[0.05, 0.15, 0.25], [0.06, 0.16, 0.24], [0.05, 0.15, 0.26]])
    cocolm = _curves([[0.20, 0.25, 0.33], [0.19, 0.24, 0.32], [0.21, 0.26, 0.31]])
    health = baseline_health(mlm, floor_dev=[0.69, 0.7, 0.71], margin=0.05)
    curves = {"mlm": mlm, "electra": electra, "cocolm": cocolm}
    paper_health = paper_baseline_health(curves, floor_dev=[0.69, 0.7, 0.71], margin=0.05)
    assert set(paper_health) == {"electra"} and paper_health["electra"]["passed"]
    rows = {(r["objective"], r["against"], r["metric"]): r for r in target_rows(curves, health, paper_health)}
    row = rows[("cocolm", "electra", "heldout_mlm_acc")]
    assert row["reached"] == "3/3" and row["hours_ratio"] == "0.667 [0.667, 0.667]"  # step 200 of ELECTRA's 300
    assert rows[("cocolm", "mlm", "heldout_mlm_acc")]["reached"] == "3/3"
    assert ("electra", "electra", "heldout_mlm_acc") not in rows and ("mlm", "electra", "heldout_mlm_acc") not in rows
    assert not any(r["against"] == "electra" for r in target_rows({"mlm": mlm, "cocolm": cocolm}, health))


def test_a_collapsed_electra_gives_no_cocolm_ratio_against_it_whatever_mlm_did() -> None:
    """The rule of every comparison — no speed-up against a baseline that did not learn — holds for the paper's
    own baseline with its own check: ELECTRA collapsed (token cosine 0.97, as its T = 1 sampling does at small
    scale) refuses the COCO-LM-vs-ELECTRA ratios and keeps COCO-LM's against a healthy MLM; a paper baseline
    without a health record is refused too."""
    mlm = _curves([[0.10, 0.20, 0.30], [0.12, 0.22, 0.31], [0.11, 0.21, 0.29]])
    electra = _curves([[0.05, 0.15, 0.25], [0.06, 0.16, 0.24], [0.05, 0.15, 0.26]], cosine=0.97)
    cocolm = _curves([[0.20, 0.25, 0.33], [0.19, 0.24, 0.32], [0.21, 0.26, 0.31]])
    curves = {"mlm": mlm, "electra": electra, "cocolm": cocolm}
    health = baseline_health(mlm, floor_dev=[0.69, 0.7, 0.71], margin=0.05)
    paper_health = paper_baseline_health(curves, floor_dev=[0.69, 0.7, 0.71], margin=0.05)
    assert health["passed"] and not paper_health["electra"]["passed"]
    assert [c["passed"] for c in paper_health["electra"]["checks"]] == [False, True, True]
    rows = target_rows(curves, health, paper_health)
    against_electra = [r for r in rows if r["against"] == "electra"]
    assert against_electra and all(r[f] == "refused: electra (the baseline) failed its health check"
                                   for r in against_electra for f in ("steps", "hours", "step_ratio", "hours_ratio"))
    assert all(not r["hours_ratio"].startswith("refused") for r in rows if r["against"] == "mlm")
    unchecked = [r for r in target_rows(curves, health) if r["against"] == "electra"]
    assert unchecked and all(r["hours_ratio"] == "refused: electra (the baseline) has no health check"
                             for r in unchecked)

