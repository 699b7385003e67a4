"""`benchmarks/memory/activation_checkpointing.py` (a tiny run): one row per family x setting, the same loss
for every setting of a family (the same step, recomputed or not), peak memory falling as more layers are
checkpointed, ratios = the peaks' quotient, and the JSON / Markdown / PNG report with its method."""
from __future__ import annotations

import json

import pytest

from benchmarks.memory.activation_checkpointing import main


def test_tiny_run_writes_a_well_formed_report(tmp_path):
    assert main(["--layers", "4", "--seq-lens", "64", "--settings", "none,2,all", "--vocab-size", "128",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "activation_checkpointing.json").read_text())
    rows = {(r["family"], r["checkpointing"]): r for r in report["rows"]}
    assert set(rows) == {(f, s) for f in ("bert", "modernbert") for s in ("none", "2", "all")}
    for family in ("bert", "modernbert"):
        none, every2, every = rows[(family, "none")], rows[(family, "2")], rows[(family, "all")]
        assert none["ratio_vs_none"] == 1.0 and every["loss_equal_none"] and every2["loss_equal_none"]
        assert every["peak_mib"] < every2["peak_mib"] < none["peak_mib"]  # the saved activations shrink
        assert every["ratio_vs_none"] == pytest.approx(every["peak_mib"] / none["peak_mib"])
    assert any("Total Allocated" in n for n in report["notes"]) and report["command"]
    for suffix in ("md", "png"):
        assert (tmp_path / f"activation_checkpointing.{suffix}").is_file()


def test_settings_without_the_baseline_are_refused():
    with pytest.raises(SystemExit):
        main(["--settings", "all", "--out", "unused"])
