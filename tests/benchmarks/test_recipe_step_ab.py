"""`benchmarks/throughput/recipe_step_ab.py`: one CI-sized round (this tree against itself through the
real entry point) gives a well-formed report whose ratio is the measured after / before; bad trees are
refused before any run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.throughput.recipe_step_ab import main

REPO = Path(__file__).resolve().parents[2]


def test_one_round_writes_a_well_formed_row(tiny_shards_dir, tmp_path):
    assert main(["--before", str(REPO), "--after", str(REPO), "--shards", str(tiny_shards_dir), "--steps", "4",
                 "--warmup", "1", "--rounds", "1", "--out", str(tmp_path), "--name", "ab"]) == 0
    report = json.loads((tmp_path / "ab.json").read_text())
    (row,) = report["rows"]
    assert row["recipe"] == "tiny-mlm" and row["rounds"] == 1 and row["steps"] == "2-4"
    before, after = report["before_s"][0], report["after_s"][0]
    assert 0 < before < 10 and 0 < after < 10  # CPU seconds per step of a tiny model
    assert row["ratio_median"] == pytest.approx(after / before, abs=1e-4) == report["ratios"][0]
    md = (tmp_path / "ab.md").read_text()
    assert "recipe_step_ab --before" in md and "--rounds 1" in md


def test_a_directory_that_is_not_a_tree_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--before", str(tmp_path), "--after", str(REPO), "--shards", str(tmp_path)])
    assert f"--before {tmp_path}: not a tree of this project" in capsys.readouterr().err
