"""`cpt-status RUN_DIR [RUN_DIR ...] [--json]`: how a training run is doing, from what it writes.

Per run directory: its state, the step of the total, tokens seen, the recent speed (tokens/s and MFU
over the last `RECENT` logged steps) and the ETA at that speed, the last loss and its trend, the
learning signals' verdicts, the newest complete checkpoint with the `cpt-convert` command for it (and,
with `train.keep_best`, the best one with its own), the architecture (`model.arch`, `model.size`), the
held-out validation, and the disk its checkpoints use. A directory that is not itself a run but holds
runs (a sweep) is expanded to them, and several runs print as one table (with a validation column).
`--json`: one JSON object per run, one per line.

What it reads (no process attached, nothing written; safe on a run that is writing):
* `run_state.json` (`pipeline.train.exit_record`): running (pid, host, total steps) or the exit code
  and error line. States: `running`; `finished` (exit 0); `stopped` (exit 75, checkpointed for
  requeue: `pipeline.train.preemption`); `diverged` (exit 3: the non-finite / divergence guard);
  `failed` (any other code, with its error line); `died` (the record still says running, but its
  process is gone from this host: SIGKILL, the OOM killer); `unknown` (no record: a run from before
  exit records; a run at its last step with its final checkpoint reads as `finished`). A damaged
  record (truncated, not JSON, an `exit_code` that is not a number) is said to be damaged, and the
  state is then read from the files as without one.
* `metrics.jsonl` (`pipeline.train.metrics.read_jsonl`: a torn last line, mid-write, is skipped; any
  other line that is not a JSON object, e.g. a bare number or invalid UTF-8, is skipped and reported
  by its line number).
* `trackers.json` (`pipeline.train.trackers.read_ids`: the W&B and MLflow run ids) and the count of
  W&B offline run directories, for the line saying which tracker run to open (or `wandb sync`).
* `checkpoints/` (`pipeline.train.checkpoint.tags`: a tag counts once its `COMPLETE.json` lists every file
  at its size) and the newest tag's `pipeline_meta.json` (total steps when the record has none).

Trend: the mean loss over the last `TAIL_FRACTION` of the logged steps against the window before it
(`pipeline.monitor.signals.tail_windows`), flat within `FLAT` (1%). Signals: `final_signals` over the
same last window, each with its `trend` (`pipeline.monitor.signals.trend`: "improving" or "worsening"
only beyond noise, "" otherwise). A run that died (killed) is told how to go on: the same command
resumes it from its newest checkpoint (`train.resume=auto`), or, before its first one, starts it over.
ETA = remaining steps x the mean `step_time_s` of the recent logged steps (checkpoint saves are
kept out of that time by the loop, so a run that saves often ends somewhat later); only for a run
that is running, stopped for requeue (its requeue resumes it) or of unknown state: a run that
finished, failed, diverged or died (killed) has none.

The convert command writes into the run directory (`RUN/hf/step<N>`), beside the checkpoints it
comes from, never into the current directory (a checkout would gain an untracked `hf/`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pipeline.monitor.signals import TAIL_FRACTION, final_signals, format_signal, tail_windows, trend
from pipeline.train import exit_record
from pipeline.train.checkpoint.tags import CHECKPOINT_DIR, is_complete, list_tags
from pipeline.train.checkpoint.best import BEST_FILE, read_best
from pipeline.train.cli import EXIT_CONFIG_ERROR, EXIT_NONFINITE, EXIT_RANK_LOST, EXIT_SAVE_FAILED
from pipeline.train.metrics import read_jsonl
from pipeline.train.preemption import REQUEUE_EXIT_CODE
from pipeline.train.run_meta import RunMeta
from pipeline.train.trackers import read_ids

#: Logged steps the recent speed is averaged over.
RECENT = 5
#: A loss moving less than this (relative) between the two last windows is "flat".
FLAT = 0.01
METRICS_FILE = "metrics.jsonl"
#: What each failure exit code of `cpt-train` means (`pipeline.train.cli`'s module docstring).
EXIT_MEANINGS = {EXIT_CONFIG_ERROR: "bad config, data or checkpoint", EXIT_NONFINITE: "diverged",
                 EXIT_SAVE_FAILED: "output not writable", EXIT_RANK_LOST: "a rank died or hung",
                 REQUEUE_EXIT_CODE: "stopped for requeue"}

#: Where the suggested conversion of a run's checkpoint goes, inside the run directory (`RUN/hf/step<N>`).
EXPORT_SUBDIR = "hf"
#: States whose remaining steps will still run (a requeue resumes `stopped`), so an ETA applies.
ETA_STATES = ("running", "stopped", "unknown")


@dataclass
class RunStatus:
    """Everything `cpt-status` says about one run (the `--json` object)."""

    run_dir: str
    name: str
    state: str  # running | finished | stopped | diverged | failed | died | unknown
    detail: str  # one line saying the state in words
    exit_code: Optional[int] = None
    error: str = ""
    step: int = 0
    total_steps: Optional[int] = None
    tokens_seen: Optional[int] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    eta_s: Optional[float] = None
    loss: Optional[float] = None
    loss_trend: str = ""  # falling / flat / rising
    loss_change: Optional[float] = None  # relative change of the mean loss, last window vs the one before
    signals: list[dict[str, Any]] = field(default_factory=list)
    architecture: str = ""  # model.arch and model.size ("bert base", "modernbert tiny"), when the run records them
    checkpoint: Optional[str] = None
    checkpoint_step: Optional[int] = None
    convert_command: str = ""
    best: dict[str, Any] = field(default_factory=dict)  # train.keep_best's tag (`best_checkpoint`), {} without one
    checkpoint_bytes: int = 0
    metrics_age_s: Optional[float] = None  # seconds since metrics.jsonl was last written
    trackers: dict[str, dict[str, str]] = field(default_factory=dict)  # trackers.json: W&B / MLflow run ids
    wandb_offline_runs: int = 0  # offline-run-* directories under wandb/ (what `wandb sync` uploads)
    metrics_skipped: list[str] = field(default_factory=list)  # unreadable metrics.jsonl lines ("line 7: ...")
    validation: dict[str, Any] = field(default_factory=dict)  # latest and best val/ values (`validation_summary`)

    @property
    def signals_learned(self) -> str:
        return f"{sum(s['learned'] for s in self.signals)}/{len(self.signals)}" if self.signals else "-"


def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (METRICS_FILE, CHECKPOINT_DIR, exit_record.RUN_STATE_FILE))


def expand(paths: Sequence[str]) -> list[Path]:
    """The run directories named: each path itself when it is a run, else its sub-directories that are."""
    runs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise SystemExit(f"error: {raw}: no such directory")
        found = [path] if is_run_dir(path) else sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))
        if not found:
            raise SystemExit(f"error: {raw}: not a run directory (no {METRICS_FILE}, {CHECKPOINT_DIR}/ or "
                             f"{exit_record.RUN_STATE_FILE}) and holds none")
        runs.extend(found)
    return runs


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def disk_bytes(root: Path) -> int:
    """Bytes of every file below `root` (files that vanish mid-walk, pruned tags, are skipped)."""
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue
    return total


def newest_checkpoint(run_dir: Path) -> Optional[tuple[int, Path]]:
    """(step, tag dir) of the newest complete checkpoint, or None."""
    for step, tag in reversed(list_tags(run_dir / CHECKPOINT_DIR)):
        if is_complete(tag):
            return step, tag
    return None


def _number(value: Any, finite: bool = True) -> Optional[float]:
    """An int/float metric value (finite unless `finite=False`: a diverged loss is nan), else None (a
    hand-edited or damaged record holds anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (finite and not math.isfinite(value)):
        return None
    return value


def _mean(records: Sequence[dict], key: str) -> Optional[float]:
    values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def loss_trend(records: Sequence[dict]) -> tuple[str, Optional[float]]:
    """(falling | flat | rising, relative change) of the mean loss, last window against the one before."""
    before, end = tail_windows(len(records), TAIL_FRACTION)
    a, b = _mean(records[before], "loss"), _mean(records[end], "loss")
    if a is None or b is None or a == 0:
        return "", None
    change = (b - a) / abs(a)
    return ("flat" if abs(change) < FLAT else "falling" if change < 0 else "rising"), change


def _exit_code(record: dict) -> Optional[int]:
    """The record's exit code as an int, or None when it is missing or not a whole number."""
    value = record.get("exit_code")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return None


def state_of(record: Optional[dict], step: int, total: Optional[int], checkpoint_step: Optional[int],
             damage: str = "", resume: str = "auto") -> tuple[str, str, Optional[int], str]:
    """(state, detail, exit code, error line) from the exit record (and, without one, the files);
    `damage`: how the record file is damaged (`exit_record.read_checked`), read then as no record;
    `resume`: the run's `train.resume` (what the same command does after a death)."""
    if record is not None and record.get("state") != "running" and _exit_code(record) is None:
        damage = f"exit_code {record.get('exit_code')!r} is not a number"
        record = None
    if record is None:
        why = (f"{exit_record.RUN_STATE_FILE} is damaged: {damage}" if damage else
               f"no {exit_record.RUN_STATE_FILE}: not started by cpt-train, or older")
        if total is not None and step >= total and checkpoint_step == total:
            return "finished", f"finished ({why if damage else 'no exit record'}; final checkpoint written)", None, ""
        return "unknown", f"unknown ({why})", None, ""
    host, pid = record.get("host", "?"), record.get("pid")
    if record.get("state") == "running":
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            if total is not None and step >= total and checkpoint_step == total:
                return "finished", "finished (its process is gone without an exit record)", None, ""
            gone = f"died: process {pid} on {host} is gone without an exit record (SIGKILL, OOM killer?)"
            if checkpoint_step is None:  # train.resume=auto finds nothing: the same command trains from step 0
                return ("died", f"{gone} before its first checkpoint: nothing to resume; the same command starts it "
                                "over from step 0", None, "")
            if resume == "never":
                return ("died", f"{gone}; it has train.resume=never, so the same command starts over: add "
                                f"train.resume=auto to resume from step {checkpoint_step}", None, "")
            return "died", f"{gone}; the same command resumes it from step {checkpoint_step}", None, ""
        return "running", f"running (pid {pid} on {host})", None, ""
    code = _exit_code(record)
    assert code is not None  # checked above
    error = str(record.get("error", ""))
    if code == 0:
        return "finished", "finished (exit 0)", 0, error
    if code == REQUEUE_EXIT_CODE:
        return "stopped", f"stopped for requeue (exit {code}): checkpointed; the job's requeue resumes it", code, error
    if code == EXIT_NONFINITE:
        return "diverged", f"diverged (exit {code}): {error}" if error else f"diverged (exit {code})", code, error
    meaning = EXIT_MEANINGS.get(code, "error")
    return "failed", f"failed (exit {code}, {meaning}){': ' + error if error else ''}", code, error


def best_checkpoint(run_dir: Path) -> dict[str, Any]:
    """`train.keep_best`'s tag from `checkpoints/best.json` (`checkpoint.best.read_best`, the one reader of
    that file; fields it does not know are ignored): {"metric", "mode", "value", "step", "checkpoint",
    "convert_command"}, with "problem" when the record names a tag that is missing or incomplete; {} when
    there is no record (or it is unreadable: then "problem" says so)."""
    path = run_dir / CHECKPOINT_DIR / BEST_FILE
    if not path.exists():
        return {}
    record = read_best(run_dir / CHECKPOINT_DIR)
    if record is None:
        return {"problem": f"{path} is unreadable (damaged or hand-edited): no best checkpoint known"}
    tag = run_dir / CHECKPOINT_DIR / record.tag
    out: dict[str, Any] = {"metric": record.metric, "mode": record.mode, "value": record.value, "step": record.step,
                           "checkpoint": str(tag)}
    if not tag.is_dir():
        out["problem"] = f"{path} names {record.tag}, which is not there"
    elif not is_complete(tag):
        out["problem"] = f"{path} names {record.tag}, which is not complete"
    else:
        out["convert_command"] = f"cpt-convert {tag} {run_dir / EXPORT_SUBDIR / f'step{record.step}'}"
    return out


def architecture_of(record: Optional[dict], config: dict) -> str:
    """"<model.arch> <model.size>" from the exit record (written at start) or the checkpoint's config."""
    model = config.get("model") or {}
    arch = (record or {}).get("arch") or model.get("arch")
    size = (record or {}).get("size") or model.get("size")
    return " ".join(str(v) for v in (arch, size) if v)


def collect(run_dir: Path) -> RunStatus:
    """The status of one run directory."""
    from pipeline.train.validation import is_validation_record, validation_summary

    skipped: list[str] = []
    everything = [r for r in read_jsonl(run_dir / METRICS_FILE, skipped) if isinstance(r.get("step"), int)]
    records = [r for r in everything if not is_validation_record(r)]  # training steps (val/ records: eval.every)
    record, damage = exit_record.read_checked(run_dir)
    newest = newest_checkpoint(run_dir)
    meta_config: dict = {}
    if newest is not None:
        try:
            meta_config = RunMeta.read(newest[1]).config
        except (OSError, ValueError):
            meta_config = {}
    total = (record or {}).get("total_steps") or meta_config.get("train", {}).get("total_steps")
    total = int(total) if _number(total) is not None else None
    name = (record or {}).get("name") or meta_config.get("name") or run_dir.name
    last = records[-1] if records else {}
    step = int(last.get("step", newest[0] if newest else 0))
    resume = str((meta_config.get("train") or {}).get("resume", "auto"))
    state, detail, code, error = state_of(record, step, total, newest[0] if newest else None, damage, resume)
    recent = records[-RECENT:]
    status = RunStatus(run_dir=str(run_dir), name=name, state=state, detail=detail, exit_code=code, error=error,
                       step=step, total_steps=total, tokens_seen=_number(last.get("tokens_seen")),
                       tokens_per_s=_mean(recent, "tokens_per_s"), mfu=_mean(recent, "mfu"),
                       loss=_number(last.get("loss"), finite=False))
    step_time = _mean(recent, "step_time_s")
    status.metrics_skipped = skipped
    if total is not None and step < total and step_time is not None and state in ETA_STATES:
        status.eta_s = (total - step) * step_time
    status.loss_trend, status.loss_change = loss_trend(records)
    for signal in final_signals(records) if records else []:
        moving = trend(records, signal)  # "improving" / "worsening" beyond noise, else ""
        status.signals.append({**signal.to_dict(), "trend": moving, "still_improving": moving == "improving",
                               "text": format_signal(signal)})
    status.architecture = architecture_of(record, meta_config)
    if newest is not None:
        status.checkpoint_step, status.checkpoint = newest[0], str(newest[1])
        status.convert_command = f"cpt-convert {newest[1]} {run_dir / EXPORT_SUBDIR / f'step{newest[0]}'}"
    status.best = best_checkpoint(run_dir)
    status.checkpoint_bytes = disk_bytes(run_dir / CHECKPOINT_DIR)
    status.validation = validation_summary(everything)
    status.trackers = read_ids(run_dir)
    status.wandb_offline_runs = len(list((run_dir / "wandb").glob("offline-run-*")))
    metrics = run_dir / METRICS_FILE
    if metrics.is_file():
        status.metrics_age_s = max(0.0, time.time() - metrics.stat().st_mtime)
    return status


# ---- formatting ----------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def human_count(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def human_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _step_text(s: RunStatus) -> str:
    if s.total_steps:
        return f"{s.step}/{s.total_steps} ({100.0 * s.step / s.total_steps:.1f}%)"
    return f"{s.step}/?"


def _loss_text(s: RunStatus) -> str:
    if s.loss is None:
        return "-"
    trend = f" {s.loss_trend}" + (f" {100 * s.loss_change:+.1f}%" if s.loss_change is not None else "") if s.loss_trend else ""
    return f"{s.loss:.4f}{trend}"


def format_detail(s: RunStatus) -> str:
    """The multi-line report of one run."""
    age = f"; metrics written {human_duration(s.metrics_age_s)} ago" if s.metrics_age_s is not None else ""
    speed = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f} tokens/s"
    if s.mfu is not None:
        speed += f", MFU {100 * s.mfu:.1f}%"
    lines = [f"{s.run_dir}  ({s.name}{', ' + s.architecture if s.architecture else ''})",
             f"  state       {s.detail}{age}",
             f"  step        {_step_text(s)}, {human_count(s.tokens_seen)} tokens seen",
             f"  speed       {speed} (last {RECENT} logged steps), ETA {human_duration(s.eta_s)}",
             f"  loss        {_loss_text(s)}" + (" (last 20% of logged steps vs the 20% before)" if s.loss_trend else "")]
    if s.signals:
        lines.append(f"  signals     {s.signals_learned} learned")
        lines += [f"    {sig['text']}{TREND_WORDS.get(sig.get('trend', ''), '')}" for sig in s.signals]
    if s.validation:
        lines.append(f"  validation  {s.validation['evaluations']} evaluation(s), latest at step {s.validation['step']} "
                     "(held-out set, eval.shards_dir)")
        texts = {sig["term"]: sig["text"] for sig in s.validation["signals"]}  # each beside its chance level
        for term, v in s.validation["terms"].items():
            latest = texts.get(term, f"{term} {v['latest']:.4f}")
            lines.append(f"    {latest} (best {v['best']:.4f} at step {v['best_step']})")
    if s.checkpoint:
        lines.append(f"  checkpoint  {s.checkpoint} (step {s.checkpoint_step}, the latest); "
                     f"{human_bytes(s.checkpoint_bytes)} in checkpoints/")
        lines.append(f"  convert     {s.convert_command}")
    else:
        lines.append(f"  checkpoint  none complete yet; {human_bytes(s.checkpoint_bytes)} in checkpoints/")
    lines += best_lines(s)
    if s.trackers:
        lines.append(f"  trackers    {tracker_text(s)}")
    if s.metrics_skipped:
        lines.append(f"  metrics     {skipped_text(s)}")
    return "\n".join(lines)


#: What `cpt-status` appends to a signal by its `trend` (`pipeline.monitor.signals.trend`; "" within noise).
TREND_WORDS = {"improving": " (still improving)", "worsening": " (worsening)"}


def best_lines(s: RunStatus) -> list[str]:
    """The best checkpoint (`train.keep_best`) and its convert command, when it is not the latest."""
    best = s.best
    if not best:
        return []
    if "metric" not in best or best.get("problem"):
        return [f"  best        {best.get('problem')}"]
    what = f"{best['metric']} {best['value']:.4f} ({best['mode']}) at step {best['step']}"
    if best["step"] == s.checkpoint_step:
        return [f"  best        the latest checkpoint: {what}"]
    return [f"  best        {best['checkpoint']}: {what}", f"  convert     {best['convert_command']}"]


def skipped_text(s: RunStatus) -> str:
    """`2 unreadable lines of metrics.jsonl skipped: line 3: ...; line 9: ...` (the first few)."""
    shown = "; ".join(s.metrics_skipped[:3]) + ("; ..." if len(s.metrics_skipped) > 3 else "")
    return f"{len(s.metrics_skipped)} unreadable line(s) of {METRICS_FILE} skipped: {shown}"


def tracker_text(s: RunStatus) -> str:
    """Where the run's tracker runs are: the W&B run id (and the `wandb sync` line for offline runs)
    and the MLflow run id with its tracking URI."""
    parts = []
    if "wandb" in s.trackers:
        wandb_id = s.trackers["wandb"].get("run_id", "?")
        offline = (f" ({s.wandb_offline_runs} offline: wandb sync {Path(s.run_dir) / 'wandb'}/offline-run-*)"
                   if s.wandb_offline_runs else "")
        parts.append(f"wandb run {wandb_id}{offline}")
    if "mlflow" in s.trackers:
        mlflow_ids = s.trackers["mlflow"]
        parts.append(f"mlflow run {mlflow_ids.get('run_id', '?')} at {mlflow_ids.get('tracking_uri', '?')}")
    return "; ".join(parts)


def format_table(statuses: Sequence[RunStatus]) -> str:
    """One row per run (a sweep)."""
    header = ("RUN", "STATE", "STEP", "TOKENS", "TOK/S", "MFU", "ETA", "LOSS", "SIGNALS", "VALIDATION", "CHECKPOINT",
              "DISK")
    rows = [header]
    for s in statuses:
        state = s.state if s.exit_code in (None, 0) else f"{s.state} ({s.exit_code})"
        best = f", best step {s.best['step']}" if s.best.get("step") not in (None, s.checkpoint_step) else ""
        rows.append((Path(s.run_dir).name, state, _step_text(s), human_count(s.tokens_seen),
                     human_count(s.tokens_per_s), "-" if s.mfu is None else f"{100 * s.mfu:.1f}%",
                     human_duration(s.eta_s), _loss_text(s), s.signals_learned, validation_cell(s),
                     f"step {s.checkpoint_step}{best}" if s.checkpoint else "-", human_bytes(s.checkpoint_bytes)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    errors = [f"{Path(s.run_dir).name}: {s.error}" for s in statuses if s.error]
    errors += [f"{Path(s.run_dir).name}: {skipped_text(s)}" for s in statuses if s.metrics_skipped]
    return "\n".join(lines + errors)


def validation_cell(s: RunStatus) -> str:
    """`val/loss 2.310 (best 2.280 @400)`: the latest held-out loss (else the first `val/` term) and its best."""
    terms = (s.validation or {}).get("terms") or {}
    if not terms:
        return "-"
    name = "val/loss" if "val/loss" in terms else next(iter(terms))
    v = terms[name]
    best = "" if v["best_step"] == s.validation.get("step") else f" (best {v['best']:.3f} @{v['best_step']})"
    return f"{name} {v['latest']:.3f}{best}"


def _finite(value: Any) -> Any:
    """NaN / inf -> None, so `--json` is strict JSON (jq, JavaScript)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cpt-status", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run's output directory, or a directory of runs (a sweep)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per run, one per line (JSON Lines: jq reads it as it is)")
    args = parser.parse_args(argv)
    try:
        runs = expand(args.run_dirs)
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    statuses = [collect(run) for run in runs]
    if args.json:
        for s in statuses:
            print(json.dumps(_finite(asdict(s)), default=str))
    elif len(statuses) == 1:
        print(format_detail(statuses[0]))
    else:
        print(format_table(statuses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
