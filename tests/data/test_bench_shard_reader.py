"""`benchmarks/data/bench_shard_reader.py` at a tiny size: both framings read the same rows and the
report carries every measure with its stream / file ratio and the control's noise floor."""
from __future__ import annotations

import json

from benchmarks.data.bench_shard_reader import main


def test_tiny_run_reports_every_ratio(tmp_path):
    out = tmp_path / "out"
    assert main(["--shards", "2", "--rows", "64", "--seq-len", "16", "--batch", "8", "--batches", "3",
                 "--singles", "20", "--trials", "1", "--out", str(out)]) == 0
    rows = {row["framing"]: row for row in json.loads((out / "shard_reader.json").read_text())["rows"]}
    file, stream = rows["file (before)"], rows["stream (now)"]
    speed, noise = rows["ratio stream/file (speed)"], rows["ratio control/stream (noise)"]
    for measure in ("take_rows_per_s", "single_rows_per_s"):
        assert file[measure] > 0 and stream[measure] > 0 and noise[measure] > 0
        assert abs(speed[measure] - stream[measure] / file[measure]) <= 0.01 * speed[measure]
    # open is a time (lower is faster): its ratio is still "stream speed / file speed"
    assert abs(speed["open_s"] - file["open_s"] / stream["open_s"]) <= 0.05 * speed["open_s"]  # times are rounded
    assert (out / "shard_reader.md").is_file()
