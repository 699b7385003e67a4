"""The one runner: a command's rows in plan order, each result on disk (through `pipeline/report_files.py`, the
one writer) as soon as it exists.

`run_stage` checks the requirements (`kernel_rows.require_environment`; missing ones stop the command
before any compute, exit 1), then runs the stage's rows in order in this process. Before each row it
compares the row's estimate with the time left before the deadline (counted from this process's
start: `Stage.deadline_s` on a lease; none with `--local` or the dry run unless `--deadline-s` gives
one) and skips, naming the reason, what would not finish. After every row it rewrites `NAME.json`
and `NAME.md` atomically - rows so far, versions, device, commit, exact command, targets judged so
far - and prints one summary line, so a command killed at its limit (even by SIGKILL) leaves every
finished row on disk for `--collect`. A row that fails (an OOM, a missing peer) is that row's result.

`NAME.json` (at most `plan.MAX_STAGE_FILES` files, here two): `stage`, `title`, `dry_run`, `created`,
`command`, `source` (commit, dirty), `versions`, `device`, `optimizer`, `deadline_s`, `wall_s`,
`complete` (false until the last row is done or skipped), `rows` (each: `row`, `kind`, `estimate_s`,
`wall_s` and its measurements), `skipped`, `targets`, `notes`, `files`.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common.breakdown import breakdown_line
from pipeline.io import write_atomic
from pipeline.report_files import markdown_table
from benchmarks.gpu_suite import kernel_rows, train_rows
from benchmarks.gpu_suite.plan import Row, Stage, source_info
from benchmarks.gpu_suite.targets import judge, judge_pairs


def checkpointing_row(ctx: Any, row: Row) -> dict[str, Any]:
    """`benchmarks.memory.activation_checkpointing.gpu_suite_row`, imported when the row runs (it imports torch)."""
    from benchmarks.memory.activation_checkpointing import gpu_suite_row

    return gpu_suite_row(ctx, row)


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "env": kernel_rows.env_row, "kernel": kernel_rows.kernel_row, "pytest": kernel_rows.pytest_row,
    "train": train_rows.train_row, "hf": train_rows.hf_row, "queue": train_rows.queue_row,
    "checkpointing": checkpointing_row}


def device_info() -> dict[str, Any]:
    """GPU name, compute capability, memory, driver and CUDA (or the CPU on a dry run)."""
    import torch

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        return {**info, "name": "cpu", "platform": platform.platform()}
    props = torch.cuda.get_device_properties(0)
    info.update(name=props.name, capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                memory_gib=round(props.total_memory / 2**30, 1))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = None
    return info


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (a folder name)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "unknown"


@dataclass
class StageContext:
    """One command's run: its stage, files, dry run or not, deadline, scratch folder and what rows share."""

    stage: Stage
    out: Path
    dry_run: bool
    deadline_s: Optional[float]
    work: Path
    started: float = field(default_factory=time.monotonic)
    cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def paired(self) -> bool:
        """A ModernBERT comparison: BERT rows get the same-shape partner size of the ModernBERT rows."""
        return any(row.arg("arch") == "modernbert" for row in self.stage.rows)

    @property
    def device(self):
        import torch

        return torch.device("cuda" if torch.cuda.is_available() and not self.dry_run else "cpu")

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class Writer:
    """A command's stage files: the payload so far; `write` rewrites both through `pipeline.io.write_atomic`."""

    def __init__(self, ctx: StageContext, command: str) -> None:
        self.ctx, self.path = ctx, ctx.out / f"{ctx.stage.name}.json"
        ctx.out.mkdir(parents=True, exist_ok=True)
        self.payload: dict[str, Any] = {
            "stage": ctx.stage.name, "title": ctx.stage.title, "dry_run": ctx.dry_run,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
            "source": source_info(), "versions": kernel_rows.versions(), "device": device_info(),
            "optimizer": train_rows.OPTIMIZER, "deadline_s": ctx.deadline_s, "wall_s": 0.0, "complete": False,
            "rows": [], "skipped": [], "targets": [], "notes": [],
            "files": [f"{ctx.stage.name}.json", f"{ctx.stage.name}.md"]}

    def write(self) -> None:
        p = self.payload
        p["wall_s"] = round(self.ctx.elapsed(), 1)
        gpu = not self.ctx.dry_run
        p["targets"] = judge_pairs(p["rows"], gpu) if self.ctx.paired else judge(p["rows"], gpu=gpu)
        write_atomic(self.path, json.dumps(p, indent=2, default=str), shared=True, parents=True)
        write_atomic(self.ctx.out / f"{self.ctx.stage.name}.md", render_markdown(p), shared=True, parents=True)


def run_stage(stage: Stage, out: Path, dry_run: bool, deadline_s: Optional[float], command: str,
              started: Optional[float] = None) -> int:
    """Run every row of `stage` in this process (see the module docstring); 0 done, 1 could not measure.
    `started`: the process's start (`time.monotonic()`), from which the deadline counts."""
    ctx = StageContext(stage, out, dry_run, deadline_s, Path(tempfile.mkdtemp(prefix=f"gpu_suite_{stage.name}_")),
                       started=time.monotonic() if started is None else started)
    writer = Writer(ctx, command)
    notes = writer.payload["notes"]
    print(f"stage {stage.name}: {len(stage.rows)} rows, deadline "
          f"{'none' if deadline_s is None else f'{deadline_s:.0f} s'}{' (dry run)' if dry_run else ''}", flush=True)
    try:
        writer.payload["requirements"] = kernel_rows.require_environment(dry_run)
    except kernel_rows.EnvironmentError_ as err:
        notes.append(f"stopped before any compute: {err}")
        writer.write()
        shutil.rmtree(ctx.work, ignore_errors=True)  # the work dir is removed on every return (finally below)
        print(f"error: {err}", file=sys.stderr)
        return 1
    pair_lines: list[str] = []
    try:
        for i, row in enumerate(stage.rows, 1):
            left = None if deadline_s is None else deadline_s - ctx.elapsed()
            if left is not None and row.gpu_s > left:
                reason = f"deadline: {max(left, 0):.0f} s left, the row needs about {row.gpu_s:.0f} s"
                writer.payload["skipped"].append({"row": row.name, "reason": reason})
                print(f"row {i}/{len(stage.rows)} {row.name}: skipped ({reason})", flush=True)
                continue
            writer.payload["rows"].append(measure_row(ctx, row))
            pair_lines = train_rows.add_ratios(writer.payload["rows"], ctx.paired)
            writer.write()
            print(f"row {i}/{len(stage.rows)} {summary(writer.payload['rows'][-1])}", flush=True)
        notes += notes_for(ctx) + pair_lines
        writer.payload["complete"] = True
        writer.write()
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    for t in writer.payload["targets"]:
        print(f"target {t['name']}: {'n/a' if t['measured'] is None else format(t['measured'], '.4g')} ({t['target']}) "
              f"-> {verdict(t['met'])}", flush=True)
    print(f"stage {stage.name}: {writer.payload['wall_s']} s; files: {', '.join(writer.payload['files'])}", flush=True)
    return 0


def measure_row(ctx: StageContext, row: Row) -> dict[str, Any]:
    started = time.monotonic()
    record: dict[str, Any] = {"row": row.name, "kind": row.kind, "estimate_s": row.gpu_s}
    if row.arg("length") is not None:
        record["length"] = row.arg("length")
    try:
        record.update(RUNNERS[row.kind](ctx, row))
    except Exception as err:  # noqa: BLE001 - an OOM or a failed run is this row's result; the rest still run
        record.update(arch=row.arg("arch", "bert"), objective=row.arg("objective"),
                      error=f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
    record["wall_s"] = round(time.monotonic() - started, 1)
    return record


def summary(r: dict[str, Any]) -> str:
    """One line per finished row."""
    head = f"{r['row']}: "
    if "error" in r:
        return head + f"error {r['error']} ({r['wall_s']} s)"
    if r["kind"] in ("train", "hf"):
        mfu = "" if r.get("mfu") is None else f", MFU {r['mfu']:.1%}"
        mfu += "" if r.get("tokens_vs_bert") is None else f", {r['tokens_vs_bert']:.3f}x BERT's tokens/s"
        largest = breakdown_line(r.get("breakdown"))
        return head + (f"{r['tokens_per_s']:,.0f} tokens/s{mfu}, step {r['step_time_s']:.3f} s (spread "
                       f"{r['spread']:.0%} over {r['measured_steps']}), {r['wall_s']} s"
                       + (f"; largest: {largest}" if largest else ""))
    if r["kind"] == "env":
        return head + f"{'every fused loss correct' if r['all_correct'] else 'A FUSED LOSS IS WRONG'}, {r['wall_s']} s"
    if r["kind"] == "kernel":
        several = len({x["case"] for x in r["results"]}) > 1
        return head + ", ".join((f"{x['case']} " if several else "") + (f"{x['impl']} {x['ms']:.3g} ms" if x.get("ms")
                                                                        else f"{x['impl']} failed")
                                for x in r["results"]) + f" ({r['wall_s']} s)"
    if r["kind"] == "queue":
        return head + f"{r['queue_ms']:.3f} ms = {r['share']:.2%} of a CAPT micro-batch step"
    return head + f"{r.get('summary')} ({r['wall_s']} s)"


def notes_for(ctx: StageContext) -> list[str]:
    from benchmarks.common.runs import MFU_FORMULA

    notes = [MFU_FORMULA, f"training rows: {train_rows.WARMUP} warm-up + {train_rows.STEPS} timed unlogged steps "
             f"(dry run: {train_rows.DRY['warmup']} + {train_rows.DRY['steps']}), no checkpoint, each step timed alone; "
             f"{train_rows.GRAD_ACCUM} micro-batches per optimizer step (the presets take 32-256 on one GPU: "
             "preset_grad_accum), so tokens/s and MFU are a lower bound on the presets'",
             f"kernel tolerances: loss relative error < {kernel_rows.LOSS_TOL:g}, every gradient < "
             f"{kernel_rows.GRAD_TOL:g}, accuracy within {kernel_rows.ACCURACY_TOL:g}"]
    if ctx.dry_run:
        notes.append("dry run: tiny models and shapes, fp32 on the CPU, Triton in the interpreter; times are not "
                     "performance, no performance target judged")
    return notes


def verdict(met: Optional[bool]) -> str:
    return "met" if met is True else "MISSED" if met is False else "not judged"


TRAIN_COLUMNS = ("row", "size", "shards", "real_token_fraction", "tokens_per_s", "mfu", "step_time_s", "spread",
                 "peak_above_start_gb", "tokens_vs_mlm", "tokens_vs_hf_bert", "tokens_vs_bert", "mfu_vs_bert",
                 "estimate_s", "wall_s", "error")


def breakdown_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per profiled window (a training row's, or each case of a kernel row's): wall and device
    idle per step and the three largest costs with their share of the wall time."""
    out = []
    for r in rows:
        found = r.get("breakdown")
        windows = ({r["row"]: found} if r["kind"] in ("train", "hf") else
                   {f"{r['row']} ({case})": b for case, b in found.items()}) if found else {}
        for name, b in windows.items():
            if "error" in b:
                out.append({"row": name, "error": b["error"]})
                continue
            line = {"row": name, "source": b["source"], "wall ms/step": b["wall_ms_per_step"],
                    "device idle ms/step": b["device_idle_ms_per_step"]}
            for i, x in enumerate(b["largest"], 1):
                share = "" if x["share_of_wall"] is None else f" ({x['share_of_wall']:.0%})"
                line[f"largest {i}"] = f"{x['cost']} {x['ms_per_step']:.1f} ms{share}"
            out.append(line)
    return out


def render_markdown(p: dict[str, Any]) -> str:
    """A command's Markdown: header (device, versions, commit, command), its rows by kind, targets, notes."""
    dev, src, rows = p["device"], p["source"], p["rows"]
    lines = [f"# GPU suite: {p['stage']} ({p['title']})" + (" - CPU dry run" if p["dry_run"] else ""), "",
             f"Device: {dev.get('name')}" + (f" (capability {dev['capability']}, driver {dev.get('driver')}, CUDA "
                                             f"{dev.get('cuda')})" if dev.get("capability") else ""),
             "Versions: " + ", ".join(f"{k} {v}" for k, v in p["versions"].items()),
             f"Optimizer: {p['optimizer']}",
             f"Commit: {src.get('commit')}" + (" (working tree differed)" if src.get("dirty") else ""),
             f"Command: `{p['command']}`",
             f"Wall time: {p['wall_s']} s (deadline {p['deadline_s']}); {'complete' if p['complete'] else 'INCOMPLETE'}", ""]
    train = [{k: r.get(k) for k in TRAIN_COLUMNS if k in r or k == "row"} for r in rows if r["kind"] in ("train", "hf")]
    if train:
        lines += ["## Training steps", "", markdown_table(train)]
    profiled = breakdown_rows(rows)
    if profiled:
        lines += ["## Where the time goes (profiled window after the timed steps)", "",
                  "Each profiled row's CUDA time per step by category and the device's idle time (waiting for "
                  "the host); the full breakdown, the longest kernels and host operators are in the JSON "
                  "(`breakdown`).", "", markdown_table(profiled)]
    kernels = [{"size": r["size"], **{k: v for k, v in x.items() if k != "dtype"}}
               for r in rows if r["kind"] == "kernel" and "error" not in r for x in r["results"]]
    if kernels:
        lines += ["## Fused losses: forward + backward", "", markdown_table(kernels)]
    for r in rows:
        if r["kind"] == "env" and "error" not in r:
            lines += ["## Kernel correctness (bf16 kernel vs fp32 reference)", "", markdown_table(r["correctness"])]
        elif r["kind"] in ("queue", "pytest") or (r["kind"] in ("env", "kernel") and "error" in r):
            lines += [f"## {r['row']}", "", markdown_table([{k: v for k, v in r.items() if k not in ("kind", "tracebacks")}])]
            for failure in r.get("tracebacks") or []:  # pytest's short traceback of each failure (bounded)
                lines += [f"`{failure['test']}`:", "", "```", failure["traceback"], "```", ""]
        elif r["kind"] == "checkpointing":
            lines += [f"## {r['row']}", "", r.get("method", r.get("error", "")), "", markdown_table(r.get("results", []))]
    if p.get("requirements"):
        lines += ["## Requirements", "", markdown_table(p["requirements"])]
    if p["targets"]:
        lines += ["## Targets", "", markdown_table([{**t, "met": verdict(t.get("met"))} for t in p["targets"]])]
    if p["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s['row']}: {s['reason']}" for s in p["skipped"]] + [""]
    if p["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in p["notes"]]
    return "\n".join(lines) + "\n"
