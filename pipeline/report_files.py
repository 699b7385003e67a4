"""The one writer of report files: JSON (with hardware and versions), a Markdown table, a PNG.

Used by the study's report (`pipeline.study`) and by every benchmark (`benchmarks/`). Every file goes through
`pipeline.io.write_atomic` with a temporary of its own (`shared=True`: a killed process never leaves half a
file, and two processes writing one path never share a temporary): `write_json` for result records,
`write_report` for a report, `save_figure` for a plot, the GPU suite's stage files (`gpu_suite/runner.py`
builds their payload).

`write_report(name, rows, out_dir, title, bar=("label_column", "value_column"))` writes
`<out_dir>/<name>.json`, `<name>.md` and (when `bar` is given) `<name>.png`, each atomically.
`line_chart(series, path, ...)` draws curves (e.g. quality against steps) for reports with more plots,
`panel_chart(panels, path, ...)` a grid of them (one axis per panel).
"""
from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from pipeline.io import write_atomic


def hardware_info() -> dict[str, Any]:
    """Device, CPU count and library versions, recorded beside every result."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpu_count": torch.cuda.device_count(),
    }
    for lib in ("deepspeed", "transformers", "datasets", "tokenizers", "triton", "pyarrow"):
        try:
            info[lib] = __import__(lib).__version__
        except Exception:  # noqa: BLE001 - a missing or broken optional library is just "absent"
            info[lib] = None
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip() or None
    except OSError:
        info["git_commit"] = None
    return info


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """GitHub Markdown table of `rows` (columns: the union of keys, in first-seen order)."""
    if not rows:
        return "_no rows_\n"
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, payload: Any, indent: int = 1) -> None:
    """A result record as JSON, atomically (parent folders created)."""
    write_atomic(path, json.dumps(payload, indent=indent, default=str) + "\n", shared=True, parents=True)


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure as PNG atomically (rendered in memory, then `write_atomic`) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, png.getvalue(), shared=True, parents=True)


def bar_chart(rows: Sequence[dict[str, Any]], label: str, value: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r.get(label)) for r in rows if r.get(value) is not None]
    values = [float(r[value]) for r in rows if r.get(value) is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(labels) + 2), 4))
    ax.bar(range(len(values)), values, color="#4C72B0")
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right")
    ax.set_ylabel(value)
    ax.set_title(title)
    save_figure(fig, path)


def line_chart(
    series: dict[str, Sequence[tuple]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    hline: tuple[float, str] | None = None,
    hlines: Sequence[tuple[float, str]] = (),
) -> None:
    """Curves `{label: [(x, y), ...]}` on one axis (PNG, atomic). Points may be `(x, y, lo, hi)`:
    the interval is drawn as a shaded band (where both bounds are known). `hline=(y, label)` draws a
    target line, `hlines` more reference lines (e.g. a random-initialisation floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        if points:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            line, = ax.plot(xs, ys, marker="o", markersize=3, label=label)
            band = [p for p in points if len(p) >= 4 and p[2] is not None and p[3] is not None]
            if band:
                ax.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band],
                                color=line.get_color(), alpha=0.2, linewidth=0)
    for y, label in hlines:
        ax.axhline(y, color="black", linestyle=":", linewidth=1, label=label)
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def panel_chart(
    panels: dict[str, dict[str, Sequence[tuple[float, float]]]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    hlines: dict[str, Sequence[tuple[float, str]]] | None = None,
    columns: int = 2,
) -> None:
    """One small axis per panel (`{panel title: {label: [(x, y), ...]}}`, e.g. a curve per seed of
    each learning signal), a shared x label, and per panel reference lines `hlines[panel] =
    [(y, label), ...]` (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(panels) or ["(no data)"]
    rows = (len(names) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(5.0 * columns, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for label, points in panels.get(name, {}).items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.2, label=label)
        for i, (y, label) in enumerate((hlines or {}).get(name, ())):  # the first line dotted, the others dashed
            ax.axhline(y, color="black" if i == 0 else "grey", linestyle=":" if i == 0 else "--", linewidth=1,
                       label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def write_report(
    name: str,
    rows: list[dict[str, Any]],
    out_dir: str | os.PathLike,
    title: str,
    bar: tuple[str, str] | None = None,
    notes: Iterable[str] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write JSON + Markdown (+ PNG bar chart of `bar=(label_col, value_col)`); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes = list(notes)
    hw = hardware_info()
    payload = {
        "name": name,
        "title": title,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "hardware": hw,
        "notes": notes,
        "rows": rows,
        **(extra or {}),
    }
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    write_atomic(paths["json"], json.dumps(payload, indent=2, default=str), shared=True)
    md = [f"# {title}", "", f"Device: {hw['device']} ({hw['cpu_count']} CPU cores); torch {hw['torch']}, "
          f"deepspeed {hw['deepspeed']}, triton {hw['triton']}; command: `{payload['command']}`", ""]
    md.append(markdown_table(rows))
    md += [f"- {n}" for n in notes]
    write_atomic(paths["md"], "\n".join(md) + "\n", shared=True)
    if bar is not None and rows:
        paths["png"] = out / f"{name}.png"
        bar_chart(rows, bar[0], bar[1], paths["png"], title)
    return paths
