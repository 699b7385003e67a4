"""Scaling efficiency arithmetic of the SLURM node-count sweep."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.throughput.scaling import load_rows, main, scaling_rows

BASE = dict(objective="mlm", preset="large", seq_len=128, zero=2, precision="bf16", micro_batch=32)


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_weak_scaling_efficiency(tmp_path: Path) -> None:
    one = write(tmp_path / "n1.json", [{**BASE, "nodes": 1, "world_size": 8, "tokens_per_s": 8000.0},
                                       {**BASE, "objective": "taco", "nodes": 1, "world_size": 8, "tokens_per_s": 7000.0}])
    two = write(tmp_path / "n2.json", [{**BASE, "nodes": 2, "world_size": 16, "tokens_per_s": 14400.0},
                                       {**BASE, "objective": "taco", "nodes": 2, "world_size": 16, "tokens_per_s": None}])
    rows = scaling_rows(load_rows([two, one]))
    by = {(r["objective"], r["nodes"]): r for r in rows}
    assert by[("mlm", 1)]["scaling_efficiency"] == 1.0
    assert by[("mlm", 2)]["scaling_efficiency"] == pytest.approx(0.9)  # 900 vs 1000 tokens/s per device
    assert by[("mlm", 2)]["baseline_nodes"] == 1
    assert ("taco", 2) not in by and by[("taco", 1)]["scaling_efficiency"] == 1.0  # failed run skipped
    main([str(one), str(two), "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert len(report["rows"]) == 3 and (tmp_path / "out" / "scaling.png").stat().st_size > 0


def test_families_of_the_same_size_name_scale_apart(tmp_path: Path) -> None:
    """`tiny` / `base` / `large` name sizes of both families: a ModernBERT row is never the baseline of
    a BERT row; reports from before the families (no `arch`) are BERT."""
    modern = {**BASE, "arch": "modernbert"}
    one = write(tmp_path / "n1.json", [{**BASE, "nodes": 1, "world_size": 8, "tokens_per_s": 8000.0},
                                       {**modern, "nodes": 1, "world_size": 8, "tokens_per_s": 4000.0}])
    two = write(tmp_path / "n2.json", [{**BASE, "arch": "bert", "nodes": 2, "world_size": 16, "tokens_per_s": 14400.0},
                                       {**modern, "nodes": 2, "world_size": 16, "tokens_per_s": 8000.0}])
    by = {(r["arch"], r["nodes"]): r["scaling_efficiency"] for r in scaling_rows(load_rows([one, two]))}
    assert by == {("bert", 1): 1.0, ("bert", 2): pytest.approx(0.9), ("modernbert", 1): 1.0, ("modernbert", 2): 1.0}
    main([str(one), str(two), "--out", str(tmp_path / "out")])
    configs = {r["config"] for r in json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]}
    assert configs == {"mlm/large/L128/z2/bf16", "modernbert:mlm/large/L128/z2/bf16"}


def test_rows_without_node_counts_are_refused(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.json", [{**BASE, "tokens_per_s": 1.0}])
    with pytest.raises(ValueError, match=r"bad.json: row 0 lacks \['world_size', 'nodes'\]"):
        load_rows([bad])
