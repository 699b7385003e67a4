"""Scaling efficiency from throughput results taken at several node counts (the SLURM sweep).

The SLURM sweep runs `bench_throughput.py` once per node count, each writing its own JSON
(`slurm/bench.sbatch`, e.g. `--out results/scaling/n{1,2,4}`). This script reads those JSON
files, matches rows by (encoder family, objective, preset, seq_len, zero, precision, micro batch) and reports,
for every node count N against the smallest measured count N0 (usually 1):

    weak-scaling efficiency = (tokens/s at N / world_size N) / (tokens/s at N0 / world_size N0)

Per-device micro-batch size stays fixed across the sweep (weak scaling: the global batch grows
with the world size), so 1.0 means perfect scaling and communication overhead shows up as < 1.

CLI:
    python -m benchmarks.throughput.scaling RESULT.json [RESULT.json ...] --out DIR [--name scaling]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.report_files import line_chart, write_report  # noqa: E402

#: Row fields that identify one measured configuration across node counts (with the family, `config_key`).
CONFIG_KEYS = ("objective", "preset", "seq_len", "zero", "precision", "micro_batch")


def config_key(row: dict) -> tuple:
    """The configuration a row measured: its family (`arch`; absent in reports from before the
    families, which are BERT) and `CONFIG_KEYS`, since `tiny`, `base` and `large` name sizes of both."""
    return (row.get("arch", "bert"),) + tuple(row[k] for k in CONFIG_KEYS)


def load_rows(paths: Iterable[str | Path]) -> list[dict]:
    """Rows of every throughput JSON; each must carry `world_size`, `nodes` and `tokens_per_s`."""
    rows = []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read a throughput report ({err})") from err
        for i, row in enumerate(payload.get("rows", [])):
            missing = [k for k in ("world_size", "nodes", "tokens_per_s", *CONFIG_KEYS) if k not in row]
            if missing:
                raise ValueError(f"{path}: row {i} lacks {missing} (not a bench_throughput report?)")
            rows.append(row)
    if not rows:
        raise ValueError("no throughput rows in the given files")
    return rows


def scaling_rows(rows: Sequence[dict]) -> list[dict]:
    """Weak-scaling efficiency of every configuration at every measured node count."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("tokens_per_s") is None:
            continue  # a failed measurement (e.g. out of memory) has no throughput to compare
        groups.setdefault(config_key(row), []).append(row)
    out = []
    for key, group in groups.items():
        group = sorted(group, key=lambda r: r["nodes"])
        base = group[0]
        base_per_device = base["tokens_per_s"] / base["world_size"]
        for row in group:
            per_device = row["tokens_per_s"] / row["world_size"]
            out.append({
                **dict(zip(("arch",) + CONFIG_KEYS, key)),
                "nodes": row["nodes"],
                "world_size": row["world_size"],
                "tokens_per_s": row["tokens_per_s"],
                "tokens_per_s_per_device": per_device,
                "scaling_efficiency": per_device / base_per_device,
                "baseline_nodes": base["nodes"],
            })
    return out


def config_label(row: dict) -> str:
    family = "" if row["arch"] == "bert" else f"{row['arch']}:"  # as bench_throughput labels its configs
    return f"{family}{row['objective']}/{row['preset']}/L{row['seq_len']}/z{row['zero']}/{row['precision']}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Scaling efficiency across node counts from bench_throughput JSON files.")
    parser.add_argument("results", nargs="+", help="bench_throughput JSON files, one per node count")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--name", default="scaling")
    args = parser.parse_args(argv)
    rows = scaling_rows(load_rows(args.results))
    for row in rows:
        row["config"] = config_label(row)
    paths = write_report(args.name, rows, args.out, "Weak-scaling efficiency across node counts",
                         notes=["efficiency = per-device tokens/s at N nodes / per-device tokens/s at the "
                                "smallest node count (fixed micro batch per device)"],
                         extra={"sources": [str(p) for p in args.results]})
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        series.setdefault(row["config"], []).append((row["nodes"], row["scaling_efficiency"]))
    png = Path(args.out) / f"{args.name}.png"
    line_chart(series, png, "Weak-scaling efficiency", "nodes", "efficiency", hline=(1.0, "perfect"))
    print(f"wrote {paths['json']}, {paths['md']}, {png}")


if __name__ == "__main__":
    main()
