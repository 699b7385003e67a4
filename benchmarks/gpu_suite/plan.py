"""The GPU plan: which stages run, in which order, each as one device command, and the limits they must fit.

A lent GPU (`../shared/gpu/README.md`) gives about 30 minutes, at most 10 minutes per command, at
most 8 result files (two folders deep) back per command, 64 MiB of working tree (carried folders
included) and a 2,000-character command. The plan keeps margin under each: a stage's budget plus the
wheel install is at most `STAGE_LIMIT_S` (8 minutes), the whole plan at most `PLAN_LIMIT_S`
(25 minutes), a stage writes at most `MAX_STAGE_FILES` files. `check_plan` returns every violated
limit; a stage whose measured time exceeds its budget (the dry run's CPU time against its dry budget,
or a GPU run's recorded wall time against its GPU budget) is one of them.

Two plans, each one lease (`PLANS`): `core`, issue 22's evidence (BERT-large), runs first; `modernbert`,
issue 30's same-size architecture comparison, is a second, optional plan for the next lease. It cannot
join the core plan: the core stages take 24.3 of the 25 minutes, and ModernBERT rows beside the BERT
rows would need about 10 more minutes. Its stages re-measure the BERT partner of every ModernBERT row in
the same warm process rather than pairing with the core plan's rows, because a ratio is only read
between rows measured side by side on one GPU (another lease may be another card, or the same card
under other conditions).
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
#: The git-ignored folders that travel with every command: the wheels the image lacks, and the data.
WHEELS_DIR = ".whl"
CARRY_DIR = ".gpu_suite"
CARRY = (WHEELS_DIR, CARRY_DIR)
#: `../shared/gpu/README.md`'s install line: the image's torch/triton stay, the wheels add the rest.
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
           f"{WHEELS_DIR}/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; ")
#: Seconds assumed for the install line and the interpreter's imports before a stage starts.
INSTALL_S = 45.0
STAGE_LIMIT_S = 8 * 60.0
PLAN_LIMIT_S = 25 * 60.0
COMMAND_LIMIT = 2000
CARRY_LIMIT_BYTES = 64 * 2**20
MAX_STAGE_FILES = 8


@dataclass(frozen=True)
class Stage:
    """One device command. `budget_s`: GPU seconds after the install (the stage stops starting new
    rows when it is spent, so its files always come back); `dry_budget_s`: CPU seconds of its dry run."""

    name: str
    title: str
    budget_s: float
    dry_budget_s: float
    runner: str  # "module:function", called with a StageContext

    def command(self) -> str:
        return INSTALL + f"python3 -m benchmarks.gpu_suite --stage {self.name} --out $OUT"


#: The core plan (issue 22): run first on a lease.
STAGES: tuple[Stage, ...] = (
    Stage("env", "environment and kernel correctness", 150, 60, "benchmarks.gpu_suite.env_stage:run"),
    Stage("kernels", "fused losses against eager, compile and peers", 360, 60, "benchmarks.gpu_suite.kernels_stage:run"),
    Stage("throughput-128", "BERT-large throughput at L=128", 270, 90, "benchmarks.gpu_suite.throughput_stage:run_128"),
    Stage("throughput-512", "BERT-large throughput at L=512", 270, 90, "benchmarks.gpu_suite.throughput_stage:run_512"),
    Stage("sanity", "base-size training sanity on WikiText-2", 180, 90, "benchmarks.gpu_suite.sanity_stage:run"),
)
#: The ModernBERT plan (issue 30 item 5): BERT-large and ModernBERT large-24 pair by pair, one length per
#: command; 10 rows in a budget that gives each about as long as a core throughput row.
MODERNBERT_STAGES: tuple[Stage, ...] = (
    Stage("throughput-modernbert-128", "ModernBERT large-24 vs BERT-large throughput at L=128", 390, 90,
          "benchmarks.gpu_suite.throughput_stage:run_modernbert_128"),
    Stage("throughput-modernbert-512", "ModernBERT large-24 vs BERT-large throughput at L=512", 390, 90,
          "benchmarks.gpu_suite.throughput_stage:run_modernbert_512"),
)
PLANS: dict[str, tuple[Stage, ...]] = {"core": STAGES, "modernbert": MODERNBERT_STAGES}
#: Every stage of every plan (what `--stage NAME` runs, the dry run rehearses and `--collect` files).
ALL_STAGES: tuple[Stage, ...] = tuple(stage for stages in PLANS.values() for stage in stages)


def stage_named(name: str, stages: Sequence[Stage] = ALL_STAGES) -> Stage:
    for stage in stages:
        if stage.name == name:
            return stage
    raise KeyError(f"--stage {name!r}: no such stage; the plan has {', '.join(s.name for s in stages)}")


def check_plan(stages: Sequence[Stage] = STAGES, measured_s: Optional[Mapping[str, float]] = None,
               dry_run: bool = False, carry_bytes: Optional[int] = None,
               files_written: Optional[Mapping[str, int]] = None) -> list[str]:
    """Every limit the plan breaks, as one line each ([] when it fits).

    measured_s: stage -> seconds it took (against `dry_budget_s` for a dry run, `budget_s` on a GPU);
    carry_bytes: the working tree plus carried folders; files_written: stage -> result files."""
    problems = []
    total = 0.0
    for stage in stages:
        need = INSTALL_S + stage.budget_s
        total += need
        if need > STAGE_LIMIT_S:
            problems.append(f"{stage.name}: budget {stage.budget_s:.0f} s + install {INSTALL_S:.0f} s = {need:.0f} s "
                            f"> the {STAGE_LIMIT_S:.0f} s a stage may take")
        if len(stage.command()) > COMMAND_LIMIT:
            problems.append(f"{stage.name}: command is {len(stage.command())} characters > {COMMAND_LIMIT}")
    if total > PLAN_LIMIT_S:
        problems.append(f"plan: {total:.0f} s of GPU time > {PLAN_LIMIT_S:.0f} s")
    for name, seconds in (measured_s or {}).items():
        stage = stage_named(name, stages)
        budget = stage.dry_budget_s if dry_run else stage.budget_s
        if seconds > budget:
            problems.append(f"{name}: took {seconds:.0f} s > its {'dry-run ' if dry_run else ''}budget {budget:.0f} s")
    for name, count in (files_written or {}).items():
        if count > MAX_STAGE_FILES:
            problems.append(f"{name}: wrote {count} files > the {MAX_STAGE_FILES} that come back")
    if carry_bytes is not None and carry_bytes > CARRY_LIMIT_BYTES:
        problems.append(f"carry: {carry_bytes / 2**20:.1f} MiB of working tree and carried folders > "
                        f"{CARRY_LIMIT_BYTES / 2**20:.0f} MiB")
    return problems


def travelling_bytes(root: Path = REPO, carry: Iterable[str] = CARRY) -> int:
    """Bytes that travel: tracked and untracked-not-ignored files, plus the carried folders."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.split(b"\0")
    total = sum((root / os.fsdecode(p)).stat().st_size for p in listed if p and (root / os.fsdecode(p)).is_file())
    for folder in carry:
        for path in (root / folder).rglob("*"):
            if path.is_file():
                total += path.stat().st_size
    return total


def describe(stages: Sequence[Stage] = STAGES, name: str = "core") -> str:
    """`--plan [NAME]`: the commands in order, with the budgets and the carry list."""
    others = [p for p in PLANS if p != name]
    lines = [f"GPU plan {name!r} (one lease; the other plans, each its own lease: "
             f"{', '.join(f'--plan {p}' for p in others) or 'none'}): {len(stages)} commands, run in this order; "
             f"carry each with: {list(CARRY)}",
             f"(prepare the carried folders here first: python -m benchmarks.gpu_suite --prepare)", ""]
    total = 0.0
    for i, stage in enumerate(stages, 1):
        total += INSTALL_S + stage.budget_s
        lines += [f"{i}. {stage.name}: {stage.title} (budget {stage.budget_s:.0f} s + install {INSTALL_S:.0f} s; "
                  f"{len(stage.command())} characters)", f"   {stage.command()}"]
    lines += ["", f"total: {total / 60:.1f} min of GPU time (limits: {STAGE_LIMIT_S / 60:.0f} min a stage, "
              f"{PLAN_LIMIT_S / 60:.0f} min the plan)",
              "then, here, for each command's files: python -m benchmarks.gpu_suite --collect FILES_AT_DIR"]
    return "\n".join(lines)
