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
`more`, is optional) and `modernbert` (ModernBERT large-24 beside BERT-large, pair by pair, on
full rows and on packed shards whose rows pad; one command). The rows whose target the first lease
missed also profile a short window after their timed steps (`breakdown`: where the step's time
goes). Estimates come from the first lease's measured wall times (`MEASURED_S`, NVIDIA H200,
2026-11-28) x `MARGIN`; every result records each row's `wall_s` beside its `estimate_s`: correct
`MEASURED_S` from them. The first lease also measured the lease's own costs: install + imports
4-9 s a command (`INSTALL_S` 20), start and idle gaps about 50 s in all over three commands (731 s of
device time for 681 s of command wall; `START_S` 90 and `IDLE_S` 30 keep a margin).
"""
from __future__ import annotations

import json
import math
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
START_S = 90.0
IDLE_S = 30.0
DEVICE_COMMAND_LIMIT_S = 10 * 60.0
#: Seconds assumed for the install line and the interpreter's imports before the first row (measured 4-9 s).
INSTALL_S = 20.0
COMMAND_CHARS = 2000
CARRY_LIMIT_BYTES = 64 * 2**20
MAX_STAGE_FILES = 8


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


#: Wall seconds of each row on the first lease (NVIDIA H200, torch 2.11 / Triton 3.6, 2026-11-28:
#: `wall_s` in benchmarks/results/gpu/nvidia-h200-2026-11-28/{headline,more,modernbert}.json; the
#: largest where a row ran in more than one command). Estimates are these x `MARGIN`, rounded up,
#: plus `PROFILE_S` for a row that also profiles; rows never measured use the guesses below.
MEASURED_S: dict[str, float] = {
    "env": 8.7, "mlm L=128": 13.0, "hf-bert L=128": 19.1, "mlm L=512": 18.9, "hf-bert L=512": 17.0,
    "taco L=128": 18.7, "capt L=128": 22.7, "cocolm L=128": 24.7, "infoword L=128": 28.4,
    "taco L=512": 18.1, "capt L=512": 20.7, "cocolm L=512": 23.4, "infoword L=512": 21.1,
    "modernbert mlm L=128": 19.1, "modernbert mlm L=512": 20.0, "modernbert taco L=128": 19.3,
    "modernbert capt L=128": 24.0, "modernbert cocolm L=128": 24.0, "modernbert infoword L=128": 26.6,
    "queue InfoNCE share of a CAPT step": 0.1, "pytest -m gpu": 35.5,
    "activation checkpointing: largest micro-batch, tokens/s": 43.3,
    # kernel rows: measured with the 5 implementations of `LCE_MEASURED_IMPLS` (linear CE) or `EAGER` (token)
    "kernel linear_cross_entropy 16k": 10.1, "kernel linear_cross_entropy 64k": 28.6,
    "kernel token_contrastive_loss 16k": 0.4, "kernel token_contrastive_loss 64k": 1.7,
}
MARGIN = 1.3
#: A profiled window (`train_rows.PROFILE_STEPS` steps, or one kernel step) and its summary: a guess
#: (no lease has profiled yet): two steps of at most 0.6 s, the profiler's start and the trace's parse.
PROFILE_S = 10.0
#: Estimates of rows no lease has measured yet: packed-shard rows write their shards first (about the
#: full rows' time plus a few seconds); a new objective gets the slowest measured objective's.
PACKED_EXTRA_S = 6.0
NEW_OBJECTIVE_S = 37.0


def estimate(name: str, default: float, profile: bool = False, scale: float = 1.0) -> float:
    """Seconds a row is planned for: its measured wall time (`MEASURED_S`, times `scale` when the row now
    does more, e.g. more implementations) x `MARGIN`, rounded up; `default` when never measured; plus
    `PROFILE_S` with a profiled window."""
    base = math.ceil(MARGIN * MEASURED_S[name] * scale) if name in MEASURED_S else default
    return float(base + (PROFILE_S if profile else 0.0))


def env_row() -> Row:
    return Row("env", "env", estimate("env", 30))


def train_row(objective: str, length: int, arch: str = "bert", profile: bool = False, packed: bool = False) -> Row:
    """A training row (`train_rows.train_row`): `profile` adds the breakdown window, `packed` trains on
    packed shards with padded rows (unpadded attention) instead of full rows."""
    prefix = "" if arch == "bert" else f"{arch} "
    name = f"{prefix}{objective} L={length}"
    full = estimate(name, NEW_OBJECTIVE_S, profile)
    params = (("objective", objective), ("length", length), ("arch", arch)) + (("profile", True),) * profile
    if packed:
        return Row(f"{name} packed", "train", full + PACKED_EXTRA_S, params + (("packed", True),))
    return Row(name, "train", full, params)


def hf_row(length: int, profile: bool = False) -> Row:
    name = f"hf-bert L={length}"
    return Row(name, "hf", estimate(name, 28, profile), (("length", length),) + (("profile", True),) * profile)


def kernel_row(case: str, size: str, impls: tuple[str, ...], profile: bool = False) -> Row:
    """Fused losses against eager and peers; `profile`: also one profiled forward + backward of ours (`triton`)."""
    name = f"kernel {case} {size}"
    measured_impls = LCE_MEASURED_IMPLS if case == "linear_cross_entropy" else EAGER
    row_s = estimate(name, 20, profile, scale=len(impls) / len(measured_impls))
    return Row(name, "kernel", max(row_s, 5.0), (("case", case), ("size", size), ("impls", impls))
               + (("profile", True),) * profile)


EAGER = ("triton", "eager_bf16", "eager_fp32")
LCE_MEASURED_IMPLS = EAGER + ("liger", "cce")
#: Our fused linear CE at two smaller scores buffers beside the default (`bench_kernels.CHUNK_VARIANTS`):
#: what its peak memory against Cut Cross-Entropy's costs in time.
LCE_PEERS = ("triton", "triton_chunk128", "triton_chunk64", "eager_bf16", "eager_fp32", "liger", "cce")

#: The objectives every plan measures (the MLM baseline first), in value order.
OBJECTIVES = ("mlm", "taco", "capt", "cocolm", "infoword", "electra")
#: Rows whose target the first lease missed get a breakdown (`profile`): MLM's MFU at both lengths, hf-bert at
#: L=512 (MLM only 1.20x it), InfoWord at both lengths, ModernBERT's MLM (22% MFU), the fused losses.
PROFILED = {("mlm", 128), ("mlm", 512), ("infoword", 128), ("infoword", 512)}
#: The largest micro-batch with and without `model.activation_checkpointing` (`benchmarks.memory.activation_checkpointing`);
#: its gpu_s is also the budget the row divides among its searches (measured 43.3 s at 40: model builds on top).
CHECKPOINTING_ROW = Row("activation checkpointing: largest micro-batch, tokens/s", "checkpointing", 40)


def core_stages(objectives: Sequence[str] = OBJECTIVES) -> tuple[Stage, Stage]:
    """The core plan: `headline` (command 1) and `more` (command 2, optional)."""
    others = [o for o in objectives if o != "mlm"]
    headline = Stage(
        "headline", "the headline numbers: BERT-large MLM and hf-bert at L=128 and 512, every objective at L=128, fused "
        "losses against eager / Liger / CCE (and ours at smaller chunks); breakdowns of the rows that missed a target",
        365, (env_row(),
              train_row("mlm", 128, profile=True), hf_row(128), train_row("mlm", 512, profile=True),
              hf_row(512, profile=True),
              *(train_row(o, 128, profile=(o, 128) in PROFILED) for o in others),
              kernel_row("linear_cross_entropy", "16k", LCE_PEERS, profile=True),
              kernel_row("token_contrastive_loss", "16k", EAGER, profile=True)))
    # command 2 measures MLM at L=512 again: an objective's MFU is judged against the MLM row of its own process
    more = Stage(
        "more", "the objectives at L=512 (beside MLM), the queue InfoNCE share of a CAPT step, pytest -m gpu, the second "
        "kernel size, the largest micro-batch with and without activation checkpointing", 370, (
            train_row("mlm", 512), *(train_row(o, 512, profile=(o, 512) in PROFILED) for o in others),
            Row("queue InfoNCE share of a CAPT step", "queue", 5),
            Row("pytest -m gpu", "pytest", 65, (("timeout_s", 60),)),
            kernel_row("linear_cross_entropy", "64k", LCE_PEERS),
            kernel_row("token_contrastive_loss", "64k", EAGER),
            CHECKPOINTING_ROW))
    return headline, more


def modernbert_stage(objectives: Sequence[str] = OBJECTIVES) -> Stage:
    """ModernBERT large-24 beside BERT-large, pair by pair in one process: full rows (MLM at L=128 and 512, every
    objective at L=128), then MLM on packed shards whose rows pad (unpadded attention) at both lengths, the
    ModernBERT MLM rows at L=512 with a breakdown."""
    full = [(o, 128) for o in objectives]
    full.insert(1, ("mlm", 512))
    rows = [r for objective, length in full for r in (
        train_row(objective, length, "bert"),
        train_row(objective, length, "modernbert", profile=(objective, length) == ("mlm", 512)))]
    rows += [r for length in (128, 512) for r in (
        train_row("mlm", length, "bert", packed=True),
        train_row("mlm", length, "modernbert", packed=True, profile=length == 512))]
    return Stage("modernbert", "ModernBERT large-24 beside BERT-large, pair by pair: MLM at L=128 and 512 and every "
                 "objective at L=128 on full rows, MLM at both lengths on packed shards (unpadded attention)", 580,
                 tuple(rows))


HEADLINE, MORE = core_stages()
MODERNBERT = modernbert_stage()
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
