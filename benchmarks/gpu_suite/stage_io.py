"""What every stage shares: its context (device, budget, dry run), the one writer of its files, the
versions and source it records, and the profiler summary written when it misses a target.

Files of stage NAME in `--out` (at most `plan.MAX_STAGE_FILES`): `NAME.json` (everything: rows,
tables, targets with met / missed, device, versions, commit, exact command, wall time), `NAME.md`
(the same as tables), `NAME_*.png` (a few charts) and, when a target is missed, `NAME_profile.md`
(`torch.profiler`: the 15 kernels with the most device time, CPU time on the CPU).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common.report import _atomic_write, markdown_table
from benchmarks.gpu_suite.plan import CARRY_DIR, REPO, Stage

SOURCE_FILE = "source.json"
LIBRARIES = ("torch", "triton", "deepspeed", "transformers", "tokenizers", "numpy", "pyarrow", "xxhash", "pyyaml",
             "safetensors", "liger_kernel", "cut_cross_entropy")
#: Distribution name -> module name where they differ.
IMPORT_NAMES = {"pyyaml": "yaml"}


def source_info(root: Path = REPO) -> dict[str, Any]:
    """The code a stage runs: the commit and whether the tree differed from it. The GPU machine gets
    a copy of the working tree without `.git`, so `--prepare` records this in the carried folder and
    the stage reads it from there; with a `.git` at hand it is asked directly."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty), "from": "git"}
    except (OSError, subprocess.CalledProcessError):
        recorded = root / CARRY_DIR / SOURCE_FILE
        if recorded.is_file():
            return {**json.loads(recorded.read_text()), "from": str(recorded.relative_to(root))}
        return {"commit": None, "dirty": None, "from": "unknown (no .git and no prepared source.json)"}


def versions() -> dict[str, Optional[str]]:
    """Python and library versions (None: not importable here). The module's `__version__`, else its
    distribution's metadata (xxhash has no `__version__`)."""
    from importlib import metadata

    out: dict[str, Optional[str]] = {"python": platform.python_version()}
    for lib in LIBRARIES:
        try:
            module = __import__(IMPORT_NAMES.get(lib, lib))
            out[lib] = getattr(module, "__version__", None) or metadata.version(lib)
        except Exception:  # noqa: BLE001 - absent or broken: recorded as None, the env stage says why
            out[lib] = None
    return out


def device_info() -> dict[str, Any]:
    """GPU name, compute capability, memory, driver and CUDA (or the CPU on a dry run)."""
    import torch

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        return {**info, "name": "cpu", "platform": platform.platform()}
    props = torch.cuda.get_device_properties(0)
    info.update(name=props.name, capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                cuda=torch.version.cuda)
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
    """One stage's run: where its files go, whether this is the CPU rehearsal, and its time budget."""

    stage: Stage
    out: Path
    dry_run: bool
    started: float = field(default_factory=time.monotonic)
    notes: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    @property
    def budget_s(self) -> float:
        return self.stage.dry_budget_s if self.dry_run else self.stage.budget_s

    def time_left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def has_time(self, need_s: float = 0.0) -> bool:
        """False once the budget (less `need_s`) is spent: the stage then skips what is left, with the
        reason, instead of being killed with nothing written by the command's time limit."""
        return self.time_left() > need_s

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})
        print(f"skipped {what}: {reason}", flush=True)

    @property
    def device(self):
        import torch

        return torch.device("cuda" if torch.cuda.is_available() and not self.dry_run else "cpu")

    def command(self) -> str:
        """The exact command that produced the files: the device command on a GPU, this argv otherwise."""
        if self.dry_run:
            return " ".join(["python", "-m", "benchmarks.gpu_suite", *sys.argv[1:]])
        return self.stage.command()

    def write(self, tables: dict[str, list[dict[str, Any]]], targets: list[dict[str, Any]],
              extra: Optional[dict[str, Any]] = None, charts: Optional[dict[str, Callable[[Path], None]]] = None,
              profile: Optional[Callable[[], None]] = None) -> dict[str, Path]:
        """Write NAME.json and NAME.md (+ a PNG per chart, + NAME_profile.md when a target is missed
        and `profile` is given); returns the paths."""
        name = self.stage.name
        self.out.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {}
        for chart_name, draw in (charts or {}).items():
            path = self.out / f"{name}_{chart_name}.png"
            try:
                draw(path)
                paths[chart_name] = path
            except Exception as err:  # noqa: BLE001 - a chart never costs the numbers
                self.notes.append(f"chart {chart_name} not drawn: {type(err).__name__}: {err}")
        missed = [t for t in targets if t.get("met") is False]
        if (missed or self.dry_run) and profile is not None:  # the rehearsal always writes it, to keep it working
            try:
                paths["profile"] = self.out / f"{name}_profile.md"
                _atomic_write(paths["profile"], profile_summary(profile, f"{name}: missed "
                              + (", ".join(t["name"] for t in missed) or "nothing (dry run)")).encode())
            except Exception as err:  # noqa: BLE001
                paths.pop("profile", None)
                self.notes.append(f"profile not written: {type(err).__name__}: {err}")
        payload = {
            "stage": name, "title": self.stage.title, "dry_run": self.dry_run,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": self.command(), "source": source_info(), "versions": versions(), "device": device_info(),
            "budget_s": self.budget_s, "wall_s": round(time.monotonic() - self.started, 1),
            "tables": tables, "targets": targets, "skipped": self.skipped, "notes": self.notes,
            "files": sorted(p.name for p in paths.values()) + [f"{name}.json", f"{name}.md"], **(extra or {}),
        }
        paths["json"] = self.out / f"{name}.json"
        paths["md"] = self.out / f"{name}.md"
        _atomic_write(paths["json"], json.dumps(payload, indent=2, default=str).encode())
        _atomic_write(paths["md"], render_markdown(payload).encode())
        return paths


def render_markdown(payload: dict[str, Any]) -> str:
    """A stage's Markdown: header (device, versions, commit, command), each table, targets, notes."""
    dev, ver, src = payload["device"], payload["versions"], payload["source"]
    lines = [f"# GPU suite: {payload['stage']} ({payload['title']})" + (" — CPU dry run" if payload["dry_run"] else ""),
             "", f"Device: {dev.get('name')}" + (f" (capability {dev['capability']}, driver {dev.get('driver')}, "
                                                 f"CUDA {dev.get('cuda')})" if dev.get("capability") else ""),
             "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
             f"Commit: {src.get('commit')}" + (" (working tree differed)" if src.get("dirty") else ""),
             f"Command: `{payload['command']}`", f"Wall time: {payload['wall_s']} s (budget {payload['budget_s']:.0f} s)", ""]
    for title, rows in payload["tables"].items():
        lines += [f"## {title}", "", markdown_table(rows)]
    if payload["targets"]:
        lines += ["## Targets", "", markdown_table([{**t, "met": verdict(t.get("met"))} for t in payload["targets"]])]
    if payload["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s['what']}: {s['reason']}" for s in payload["skipped"]] + [""]
    if payload["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in payload["notes"]]
    return "\n".join(lines) + "\n"


def verdict(met: Optional[bool]) -> str:
    return "met" if met is True else "MISSED" if met is False else "not judged"


def print_targets(targets: list[dict[str, Any]]) -> None:
    for t in targets:
        measured = "n/a" if t.get("measured") is None else f"{t['measured']:.4g}"
        print(f"target {t['name']}: {measured} ({t['target']}) -> {verdict(t.get('met'))}"
              + (f" [{t['note']}]" if t.get("note") else ""), flush=True)


def profile_summary(fn: Callable[[], None], title: str, top: int = 15) -> str:
    """Markdown: the `top` kernels by self device time (CPU time without CUDA) over one call of `fn`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
    total = sum(getattr(e, key, 0.0) for e in prof.key_averages()) or 1.0
    rows = [{"kernel": e.key[:90], "calls": e.count, "self_ms": round(getattr(e, key, 0.0) / 1e3, 3),
             "share": f"{getattr(e, key, 0.0) / total:.1%}"} for e in events]
    return (f"# Profile: {title}\n\ntorch.profiler, top {top} by {'device' if cuda else 'CPU'} self time over one "
            f"step\n\n" + markdown_table(rows))
