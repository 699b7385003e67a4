"""Zero-shot STS in the time-to-quality study: the study file's `sts:` (checked before any compute), the work
directory's record of it, and the report's comparison with MLM (`pipeline.study.sts_comparison`) on curves made here.
The whole path (training, conversion, `sts_step_<N>.json` at every point, the report) runs in
tests/study/test_local.py and, on SLURM, tests/slurm/test_study.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.study.targets import EvalPoint
from pipeline.study.sts_comparison import comparison_rows, floor_lines, floor_rows, paired_points, separation, verdict
from pipeline.study.spec import StudyError, check_work_dir, load_study
from tests.eval.conftest import write_sts


def _study(tmp_path: Path, shards: Path | str = "s", **changes) -> Path:
    raw = {"name": "t", "work_dir": str(tmp_path / "work"), "objectives": {"mlm": {"preset": "tiny-mlm"}},
           "seeds": [1, 2], "lrs": [1e-3], "budget": {"steps": 10}, "eval_every": 5,
           "shards": {"train": str(shards), "heldout_select": str(shards), "heldout_report": str(shards)}}
    raw.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("sts, message", [
    ("sts-b", "sts: expected {dir: DIR, bootstrap: N} (the SentEval STS-B copy), got 'sts-b'"),
    ({"bootstrap": 10}, "sts: expected {dir: DIR, bootstrap: N}"),
    ({"dir": "x", "pooling": "cls"}, "sts: expected {dir: DIR, bootstrap: N}"),
    ({"dir": "x", "bootstrap": -1}, "sts.bootstrap: expected an integer >= 0 (0: no interval), got -1"),
    ({"dir": "x", "bootstrap": 2.5}, "sts.bootstrap: expected an integer >= 0"),
])
def test_a_malformed_sts_field_is_one_line_naming_the_file_and_field(tmp_path: Path, sts, message: str) -> None:
    with pytest.raises(StudyError) as err:
        load_study(_study(tmp_path, sts=sts), check_data=False)
    assert message in str(err.value) and str(tmp_path / "study.yaml") in str(err.value)


def test_the_sts_data_are_read_and_checked_when_the_study_is_loaded(tmp_path: Path, tiny_shards_dir: Path) -> None:
    missing = _study(tmp_path, tiny_shards_dir, sts={"dir": str(tmp_path / "nowhere")})
    with pytest.raises(StudyError, match=r"study.yaml: sts.dir .*nowhere: no such directory"):
        load_study(missing)
    sts = write_sts(tmp_path / "sts-b", n_pairs=10)
    lines = (sts / "test.tsv").read_text().splitlines()
    fields = lines[3].split("\t")
    fields[4] = "5.5"
    (sts / "test.tsv").write_text("\n".join([*lines[:3], "\t".join(fields), *lines[4:]]) + "\n")
    with pytest.raises(StudyError) as err:  # before any run: a study would otherwise fail at its first point
        load_study(_study(tmp_path, tiny_shards_dir, sts={"dir": str(sts)}))
    assert f"study.yaml: sts.dir: {sts / 'test.tsv'}:4: score 5.5 outside 0-5" in str(err.value)
    fields[4] = "2.5"
    (sts / "test.tsv").write_text("\n".join([*lines[:3], "\t".join(fields), *lines[4:]]) + "\n")
    study = load_study(_study(tmp_path, tiny_shards_dir, sts={"dir": str(sts)}))
    assert study.sts.dir == sts and study.sts.bootstrap == 1000


def test_sts_can_be_added_to_a_study_dir_but_not_changed(tmp_path: Path, tiny_shards_dir: Path) -> None:
    sts = write_sts(tmp_path / "sts-b", n_pairs=10)
    check_work_dir(load_study(_study(tmp_path, tiny_shards_dir)))  # a study that ran without STS
    check_work_dir(load_study(_study(tmp_path, tiny_shards_dir, sts={"dir": str(sts), "bootstrap": 50})))
    with pytest.raises(StudyError, match=r"holds a study made with other settings \(sts: .*'bootstrap': 50.* there, "
                                         r".*'bootstrap': 20.* now\)"):
        check_work_dir(load_study(_study(tmp_path, tiny_shards_dir, sts={"dir": str(sts), "bootstrap": 20})))
    check_work_dir(load_study(_study(tmp_path, tiny_shards_dir)))  # run again without it: its files stay


def _curve(values: list[float], hours_per_point: float, steps: int = 100) -> list[EvalPoint]:
    return [EvalPoint(steps * (i + 1), hours_per_point * (i + 1), {"sts_test": v}, tokens=1000 * (i + 1))
            for i, v in enumerate(values)]


def test_equal_budget_compares_final_points_and_matched_compute_reads_the_dearer_run_earlier() -> None:
    mlm = _curve([40.0, 45.0, 50.0], 1.0)
    capt = _curve([60.0, 65.0, 70.0], 2.0)  # twice MLM's cost per step: 3.0 device-hours hold its first point
    run, base = paired_points(mlm, capt, "sts_test", "equal budget")
    assert (run.step, base.step) == (300, 300)
    run, base = paired_points(mlm, capt, "sts_test", "matched compute")
    assert (run.step, run.device_hours, base.step) == (100, 2.0, 300)  # CAPT's last point within MLM's 3.0 hours
    cheap = _curve([30.0, 35.0, 38.0], 0.5)  # cheaper than MLM: MLM is the one read earlier
    run, base = paired_points(mlm, cheap, "sts_test", "matched compute")
    assert (run.step, base.step) == (300, 100)
    costly = _curve([60.0], 4.0, steps=300)  # its only point costs more than all of MLM's run
    run, base = paired_points(mlm, costly, "sts_test", "matched compute")
    assert run is None and base.step == 300


def _dev_test_curve(dev: list[float], test: list[float], hours_per_point: float = 1.0) -> list[EvalPoint]:
    return [EvalPoint(100 * (i + 1), hours_per_point * (i + 1), {"sts_dev": d, "sts_test": t}, tokens=1000 * (i + 1))
            for i, (d, t) in enumerate(zip(dev, test))]


def test_selected_on_dev_reads_each_runs_best_dev_checkpoint_on_test() -> None:
    mlm = _dev_test_curve([50.0, 55.0, 52.0], [40.0, 45.0, 42.0])  # peaks on dev at step 200
    early = _dev_test_curve([60.0, 58.0, 60.0], [61.0, 57.0, 99.0])  # a tie on dev: the earlier step is chosen
    run, base = paired_points(mlm, early, "sts_test", "selected on dev")
    assert (run.step, run.values["sts_test"]) == (100, 61.0)
    assert (base.step, base.values["sts_test"]) == (200, 45.0)
    no_dev = [EvalPoint(p.step, p.device_hours, {"sts_test": p.values["sts_test"]}, tokens=p.tokens) for p in early]
    assert paired_points(mlm, no_dev, "sts_test", "selected on dev")[0] is None


def test_selected_on_dev_rows_are_test_only_and_pair_the_seeds() -> None:
    curves = {"mlm": {s: _dev_test_curve([50.0, 55.0 + s, 52.0], [40.0, 45.0 + s, 42.0]) for s in (1, 2, 3)},
              "taco": {s: _dev_test_curve([70.0 + s, 60.0, 50.0], [65.0 + s, 60.0, 30.0]) for s in (1, 2, 3)}}
    rows = {(r["objective"], r["split"], r["basis"]): r for r in comparison_rows(curves)}
    assert ("taco", "dev", "selected on dev") not in rows
    selected = rows[("taco", "test", "selected on dev")]
    assert selected["steps"] == "100 / 200" and selected["separates"] == "higher"
    assert selected["difference_paired"] == "20.0 [20.0, 20.0]"  # (65 + s) - (45 + s) on every seed
    assert rows[("taco", "test", "equal budget")]["separates"] == "lower"  # 30 against 42 at the final points
    line = verdict(list(rows.values()))
    assert "taco higher at selected on dev" in line and "taco lower at equal budget" in line


def test_separation_needs_intervals_that_do_not_overlap() -> None:
    assert separation({"mean": 70, "lo": 65, "hi": 75}, {"mean": 50, "lo": 45, "hi": 55}) == "higher"
    assert separation({"mean": 40, "lo": 35, "hi": 44}, {"mean": 50, "lo": 45, "hi": 55}) == "lower"
    assert separation({"mean": 54, "lo": 50, "hi": 58}, {"mean": 50, "lo": 45, "hi": 55}) == "no"
    assert separation({"mean": 70, "lo": None, "hi": None}, {"mean": 50, "lo": 45, "hi": 55}).startswith("n/a")


def test_comparison_rows_per_objective_and_basis_with_the_paired_difference() -> None:
    curves = {"mlm": {s: _curve([40.0 + s, 45.0 + s, 50.0 + s], 1.0) for s in (1, 2, 3)},
              "capt": {s: _curve([60.0 + s, 65.0 + s, 70.0 + s], 2.0) for s in (1, 2, 3)},
              "taco": {s: _curve([40.0 + 2 * s, 45.0, 50.0 + s * s], 1.0) for s in (1, 2, 3)},
              "costly": {s: _curve([10.0 + s], 9.0, steps=300) for s in (1, 2, 3)}}
    rows = {(r["objective"], r["basis"]): r for r in comparison_rows(curves)}
    capt = rows[("capt", "equal budget")]
    assert capt["objective_sts"].startswith("72.0 [") and capt["mlm_sts"].startswith("52.0 [")
    assert capt["difference_paired"] == "20.0 [20.0, 20.0]" and capt["separates"] == "higher"  # every seed exactly +20
    assert rows[("capt", "matched compute")]["steps"] == "100 / 300"
    assert rows[("capt", "matched compute")]["objective_sts"].startswith("62.0 [")
    assert rows[("taco", "equal budget")]["separates"] == "no"
    assert "separates" not in rows[("costly", "matched compute")]
    assert rows[("costly", "matched compute")]["note"].startswith("no evaluation point of the objective")
    assert rows[("costly", "equal budget")]["separates"] == "lower"
    assert rows[("capt", "selected on dev")]["note"] == "no STS-B dev record to select on"  # these curves have no dev
    line = verdict(list(rows.values()))
    assert line.startswith("STS-B test, intervals not overlapping: ") and "capt higher at equal budget" in line
    assert "taco" not in line
    assert verdict(list(rows.values()), baseline_healthy=False).startswith(
        "NOT A CLAIM, the MLM baseline failed its health check")
    same = {"mlm": curves["mlm"], "taco": curves["taco"]}
    assert verdict(comparison_rows(same)).startswith("STS-B test: no objective separates from MLM")


def test_floor_rows_come_from_the_first_sts_record_with_their_pair_intervals() -> None:
    class Key:
        def __init__(self, objective: str) -> None:
            self.objective = objective

    record = {"splits": {split: {"model": {"spearman": 50.0}, "token_overlap": {"spearman": 64.9, "interval": [61.0, 68.5]},
                                 "random_init": {"spearman": 53.2, "interval": [49.0, 57.0]}} for split in ("dev", "test")}}
    other = {"splits": {"test": {"model": {"spearman": 1.0}, "token_overlap": {"spearman": 0.0},
                                 "random_init": {"spearman": 0.0}}}}
    selected = {"taco": [{"key": Key("taco"), "status": "ok", "points": [{"sts": other}]}],
                "mlm": [{"key": Key("mlm"), "status": "ok", "points": [{"sts": None}, {"sts": record}]}]}
    rows = {r["objective"]: r for r in floor_rows(selected)}
    assert rows["token overlap (STS floor)"]["sts_test"] == "64.9 [61.0, 68.5]"
    assert rows["random init (STS floor)"]["sts_dev"] == "53.2 [49.0, 57.0]"
    assert floor_lines(selected) == [(64.9, "token overlap"), (53.2, "random init")]  # the plots' lines
    assert floor_rows({"mlm": [{"key": Key("mlm"), "status": "ok", "points": [{"sts": None}]}]}) == []
