"""The GPU plans in one place: the rows in value order, grouped into device commands, and the lease they must fit.

A lent GPU (`../shared/gpu/README.md`) gives 15 minutes of device time in all: the machine's start
(`START_S`), every command, the idle gap held after each command (`IDLE_S`) and any failed start;
at most 10 minutes a command, at most 8 result files back per command, 64 MiB of working tree
(carried folders included) and a 2,000-character command. So a plan costs

    device seconds = START_S + sum over its commands of (limit_s + IDLE_S)

where a command's `limit_s` is the wall time it may take, install included: its runner stops
starting rows at `limit_s - INSTALL_S` from its own start (`Stage.deadline_s`) and starts a row
only when the row's estimate (`Row.gpu_s`) still fits before it. `check_plan` fails a plan over
`LEASE_S`, a command whose install plus row estimates exceed its own limit, a limit over the
device's 10 minutes, and every other limit above.

Two plans, one lease each (`PLANS`): `core` (command 1, `headline`, yields MLM and hf-bert at
L=128 and L=512, every objective at L=128 and the fused kernels against their peers; command 2,
`more`, is optional) and `modernbert` (ModernBERT large-24 beside BERT-large, pair by pair, one
command sized like `headline`). Row estimates are first guesses for an H100 (not yet measured:
each result records every row's `wall_s`; correct `gpu_s` from them).
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
#: The git-ignored folders that travel with every command on a lease: the wheels the image lacks and
#: `source.json` (the commit: the device gets no `.git`). `--local` needs neither.
WHEELS_DIR = ".whl"
CARRY_DIR = ".gpu_suite"
CARRY = (WHEELS_DIR, CARRY_DIR)
SOURCE_FILE = "source.json"
#: `../shared/gpu/README.md`'s install line: the image's torch/triton stay, the wheels add the rest.
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
           f"{WHEELS_DIR}/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; ")
LEASE_S = 15 * 60.0
START_S = 120.0
IDLE_S = 30.0
DEVICE_COMMAND_LIMIT_S = 10 * 60.0
#: Seconds assumed for the install line and the interpreter's imports before the first row.
INSTALL_S = 45.0
COMMAND_CHARS = 2000
CARRY_LIMIT_BYTES = 64 * 2**20
MAX_STAGE_FILES = 8
OBJECTIVES = ("mlm", "taco", "capt", "cocolm", "infoword")


@dataclass(frozen=True)
class Row:
    """One measurement: `kind` picks its runner (`benchmarks.gpu_suite.rows.RUNNERS`), `params` its
    arguments; `gpu_s`: the device seconds it is expected to take (its runner's warm-up included)."""

    name: str
    kind: str
    gpu_s: float
    params: tuple[tuple[str, Any], ...] = ()

    def arg(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class Stage:
    """One device command: its rows in the order they run and the wall time it may take (install included)."""

    name: str
    title: str
    limit_s: float
    rows: tuple[Row, ...] = field(default=())

    @property
    def deadline_s(self) -> float:
        """Seconds from the process's start after which no row starts."""
        return self.limit_s - INSTALL_S

    def command(self) -> str:
        return INSTALL + f"python3 -m benchmarks.gpu_suite --stage {self.name} --out $OUT"


def env_row(gpu_s: float = 30) -> Row:
    return Row("env", "env", gpu_s)


def train_row(objective: str, length: int, arch: str = "bert", gpu_s: float = 33) -> Row:
    prefix = "" if arch == "bert" else f"{arch} "
    return Row(f"{prefix}{objective} L={length}", "train", gpu_s,
               (("objective", objective), ("length", length), ("arch", arch)))


def hf_row(length: int, gpu_s: float = 28) -> Row:
    return Row(f"hf-bert L={length}", "hf", gpu_s, (("length", length),))


def kernel_row(case: str, size: str, impls: tuple[str, ...], gpu_s: float = 20) -> Row:
    return Row(f"kernel {case} {size}", "kernel", gpu_s, (("case", case), ("size", size), ("impls", impls)))


EAGER = ("triton", "eager_bf16", "eager_fp32")
LCE_PEERS = EAGER + ("liger", "cce")

HEADLINE = Stage("headline", "the headline numbers: BERT-large MLM and hf-bert at L=128 and 512, every objective "
                 "at L=128, fused losses against eager / Liger / CCE", 385, (
                     env_row(),
                     train_row("mlm", 128), hf_row(128), train_row("mlm", 512), hf_row(512),
                     *(train_row(o, 128) for o in OBJECTIVES[1:]),
                     kernel_row("linear_cross_entropy", "16k", LCE_PEERS),
                     kernel_row("token_contrastive_loss", "16k", EAGER)))
#: The largest micro-batch with and without `model.activation_checkpointing` (`benchmarks.memory.activation_checkpointing`).
CHECKPOINTING_ROW = Row("activation checkpointing: largest micro-batch, tokens/s", "checkpointing", 40)
#: Command 2 measures MLM at L=512 again: an objective's MFU is judged against the MLM row of its own process.
MORE = Stage("more", "the objectives at L=512 (beside MLM), the queue InfoNCE share of a CAPT step, pytest -m gpu, "
             "the second kernel size, the largest micro-batch with and without activation checkpointing", 335, (
                 train_row("mlm", 512), *(train_row(o, 512, gpu_s=30) for o in OBJECTIVES[1:]),
                 Row("queue InfoNCE share of a CAPT step", "queue", 10),
                 Row("pytest -m gpu", "pytest", 45, (("timeout_s", 40),)),
                 kernel_row("linear_cross_entropy", "64k", LCE_PEERS),
                 kernel_row("token_contrastive_loss", "64k", EAGER),
                 CHECKPOINTING_ROW))
#: ELECTRA (the baseline of COCO-LM's claim) is measured here, where the lease has room: the core plan is full.
MODERNBERT = Stage("modernbert", "ModernBERT large-24 beside BERT-large, pair by pair: MLM at L=128 and 512, every "
                   "objective at L=128 (ELECTRA included)", 480, tuple(
                       r for objective, length in [("mlm", 128), ("mlm", 512), *((o, 128) for o in OBJECTIVES[1:]),
                                                   ("electra", 128)]
                       for r in (train_row(objective, length, "bert", 28), train_row(objective, length, "modernbert", 28))))
PLANS: dict[str, tuple[Stage, ...]] = {"core": (HEADLINE, MORE), "modernbert": (MODERNBERT,)}
#: Every stage of every plan (what `--stage NAME` runs, the dry run rehearses and `--collect` files).
ALL_STAGES: tuple[Stage, ...] = tuple(stage for stages in PLANS.values() for stage in stages)


def stage_named(name: str, stages: Sequence[Stage] = ALL_STAGES) -> Stage:
    for stage in stages:
        if stage.name == name:
            return stage
    raise KeyError(f"--stage {name!r}: no such stage; the plans have {', '.join(s.name for s in stages)}")


def device_seconds(stages: Sequence[Stage]) -> float:
    """What a plan costs of a lease: the start, then each command's limit and the idle gap after it."""
    return START_S + sum(stage.limit_s + IDLE_S for stage in stages)


def check_plan(stages: Sequence[Stage], carry_bytes: Optional[int] = None,
               files_written: Optional[dict[str, int]] = None) -> list[str]:
    """Every limit the plan breaks, one line each ([] when it fits); the arithmetic only, no clock."""
    problems = []
    for stage in stages:
        need = INSTALL_S + sum(row.gpu_s for row in stage.rows)
        if need > stage.limit_s:
            problems.append(f"{stage.name}: install {INSTALL_S:.0f} s + row estimates "
                            f"{need - INSTALL_S:.0f} s = {need:.0f} s > its limit {stage.limit_s:.0f} s")
        if stage.limit_s > DEVICE_COMMAND_LIMIT_S:
            problems.append(f"{stage.name}: limit {stage.limit_s:.0f} s > the device's "
                            f"{DEVICE_COMMAND_LIMIT_S:.0f} s a command")
        if len(stage.command()) > COMMAND_CHARS:
            problems.append(f"{stage.name}: command is {len(stage.command())} characters > {COMMAND_CHARS}")
    total = device_seconds(stages)
    if total > LEASE_S:
        problems.append(f"plan: {total / 60:.1f} device minutes (start {START_S:.0f} s + commands + "
                        f"{IDLE_S:.0f} s idle after each) > the lease's {LEASE_S / 60:.0f}")
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
        total += sum(p.stat().st_size for p in (root / folder).rglob("*") if p.is_file())
    return total


def describe(stages: Sequence[Stage], name: str) -> str:
    """`--plan [NAME]`: the commands to type, in order, each with its rows, limit and the lease arithmetic."""
    others = [p for p in PLANS if p != name]
    lines = [f"GPU plan {name!r} (one lease; {', '.join(f'--plan {p}' for p in others)}: another lease): "
             f"{len(stages)} command(s), in this order; carry {list(CARRY)}; give each command a timeout of its limit", ""]
    for i, stage in enumerate(stages, 1):
        rows = sum(r.gpu_s for r in stage.rows)
        lines += [f"{i}. {stage.name}{' (optional)' if i > 1 else ''}: {stage.title}",
                  f"   limit {stage.limit_s:.0f} s = install {INSTALL_S:.0f} s + rows until {stage.deadline_s:.0f} s "
                  f"(estimates {rows:.0f} s): " + ", ".join(r.name for r in stage.rows),
                  f"   {stage.command()}"]
    total = device_seconds(stages)
    lines += ["", f"device time: start {START_S:.0f} s + " + " + ".join(f"({s.limit_s:.0f} + {IDLE_S:.0f} idle) s"
                                                                       for s in stages)
              + f" = {total:.0f} s = {total / 60:.1f} min of the lease's {LEASE_S / 60:.0f}",
              "then, here, for each command's returned folder: python -m benchmarks.gpu_suite --collect FILES_AT_DIR",
              "", *own_gpu(name)]
    return "\n".join(lines)


def own_gpu(name: str) -> list[str]:
    """The same commands on a GPU machine of your own: no lease, so no $OUT, wheels, carried folders or deadline."""
    plan_arg = f" {name}" if name != "core" else ""
    return ["On a GPU machine of your own (no lease): $OUT above is only the result folder, and the install line, "
            "--prepare, .whl/ and .gpu_suite/ exist for the lent machine's bare image. With this project installed "
            "(torch with CUDA, DeepSpeed, triton; `pip install -e .`), from the repository root:",
            f"  python -m benchmarks.gpu_suite --local{plan_arg} --out DIR            "
            "# every command above, one process each, no deadline",
            "  python -m benchmarks.gpu_suite --stage NAME --out DIR --deadline-s inf   # or one command by its name",
            "  python -m benchmarks.gpu_suite --collect DIR                             # then file the results here",
            "The 'not prepared yet' lines below concern a lease only."]


def show_plan(name: str) -> int:
    """The plan, its limit check (exit 1 when broken) and, separately, what is not prepared yet."""
    stages = PLANS[name]
    print(describe(stages, name))
    problems = check_plan(stages, carry_bytes=travelling_bytes())
    for line in problems:
        print(f"plan check: {line}")
    print("plan check: fits the lease and every limit" if not problems else "plan check: FAILED")
    for line in readiness():
        print(f"not prepared yet: {line}")
    return 1 if problems else 0


def readiness() -> list[str]:
    """What a lease still needs (reported by `--plan`, never hiding it): the wheels, and a `source.json`
    that names the commit the tree is at."""
    problems = []
    if not any((REPO / WHEELS_DIR).glob("deepspeed-*.whl")):
        problems.append(f"{WHEELS_DIR}/ has no DeepSpeed wheel (the image lacks DeepSpeed): run --prepare")
    recorded = REPO / CARRY_DIR / SOURCE_FILE
    if not recorded.is_file():
        problems.append(f"{recorded.relative_to(REPO)} missing: run --prepare")
    else:
        now, then = source_info(), json.loads(recorded.read_text())
        if (now.get("commit"), now.get("dirty")) != (then.get("commit"), then.get("dirty")):
            problems.append(f"{recorded.relative_to(REPO)} records commit {then.get('commit')} (dirty: "
                            f"{then.get('dirty')}), the tree is at {now.get('commit')} (dirty: {now.get('dirty')}): "
                            "run --prepare again so the results name the code that ran")
    return problems


def source_info(root: Path = REPO) -> dict[str, Any]:
    """The commit and whether the tree differed from it: from git, else from the `source.json` that
    `--prepare` puts in the carried folder (the lent machine gets the tree without `.git`)."""
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
