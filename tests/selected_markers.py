"""A pytest plugin for `scripts/install_test_deps.sh`: which markers the selected tests carry.

`CPT_SELECTED_MARKERS=FILE python -m pytest --collect-only -q -p tests.selected_markers ARGS...` writes
`{"selected": N, "slurm": K}` to FILE once collection and deselection (`-m`, `-k`, paths, node ids) are
done, so the script installs Debian's SLURM and munge only when the tests about to run include tests
marked `slurm`. pytest itself answers the question, so any selection syntax pytest accepts is read the
way the run that follows reads it. Without the variable the plugin does nothing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

#: The environment variable naming the file the counts go to.
OUTPUT_VARIABLE = "CPT_SELECTED_MARKERS"
#: Markers whose selected tests need something beyond pip (`slurm`: system packages and root).
COUNTED_MARKERS = ("slurm",)


def marker_counts(items: list[pytest.Item]) -> dict[str, int]:
    """How many of `items` there are, and how many carry each of `COUNTED_MARKERS` (on the test, its class
    or its module)."""
    counts = {"selected": len(items)}
    for name in COUNTED_MARKERS:
        counts[name] = sum(1 for item in items if item.get_closest_marker(name) is not None)
    return counts


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get(OUTPUT_VARIABLE)
    if path:  # written whole, then renamed: the script never reads half a file
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(marker_counts(session.items)))
        tmp.replace(path)
