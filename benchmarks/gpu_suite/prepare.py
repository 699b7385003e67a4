"""`--prepare` (run here, before a lease; `--local` needs none of it): what travels with the device commands.

1. `.whl/`: the wheels the GPU image lacks (DeepSpeed, datasets' needs, Liger-Kernel, Cut
   Cross-Entropy), built by `../shared/gpu/make_wheels.sh` unless already there; git-ignored.
2. `.gpu_suite/source.json` (git-ignored): the commit and whether the tree differed from it (the
   lent machine gets the tree without `.git`). The rows write their own synthetic shards.
3. Prints every plan (the exact device commands) with its check against the lease.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.gpu_suite import plan

PEER_WHEELS = ("deepspeed-", "liger_kernel-", "cut_cross_entropy-")


def find_shared(given: Optional[str]) -> Path:
    """`--shared`, else `../shared` beside this checkout or beside the main checkout of a worktree."""
    if given:
        candidates = [Path(given)]
    else:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=plan.REPO,
                                capture_output=True, text=True).stdout.strip()
        candidates = [plan.REPO.parent / "shared"] + ([Path(common).parent.parent / "shared"] if common else [])
    for path in candidates:
        if (path / "gpu" / "make_wheels.sh").is_file():
            return path
    raise FileNotFoundError(f"--shared: none of {[str(c) for c in candidates]} holds gpu/make_wheels.sh (a lease's "
                            "terms; with a GPU of your own: python -m benchmarks.gpu_suite --local --out DIR)")


def ensure_ignored(name: str) -> None:
    """`name` must never be committed: add it to .git/info/exclude unless git already ignores it."""
    if subprocess.run(["git", "check-ignore", "-q", name], cwd=plan.REPO).returncode == 0:
        return
    exclude = Path(subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-path", "info/exclude"],
                                  cwd=plan.REPO, capture_output=True, text=True, check=True).stdout.strip())
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as f:
        f.write(f"/{name}/\n")


def build_wheels(shared: Path) -> list[str]:
    wheels = plan.REPO / plan.WHEELS_DIR
    have = sorted(p.name for p in wheels.glob("*.whl"))
    if not all(any(w.startswith(prefix) for w in have) for prefix in PEER_WHEELS):
        subprocess.run(["bash", str(shared / "gpu" / "make_wheels.sh"), plan.WHEELS_DIR], cwd=plan.REPO, check=True)
        have = sorted(p.name for p in wheels.glob("*.whl"))
    return have


def record_source() -> Path:
    """`.gpu_suite/source.json`: the commit and whether the tree differed (the lent machine gets no `.git`)."""
    path = plan.REPO / plan.CARRY_DIR / plan.SOURCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in plan.source_info().items() if k != "from"}, indent=2))
    return path


def prepare(shared_arg: Optional[str]) -> int:
    try:
        shared = find_shared(shared_arg)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name in plan.CARRY:
        ensure_ignored(name)
    wheels = build_wheels(shared)
    source = record_source()
    print(f"wheels ({plan.WHEELS_DIR}): {', '.join(wheels)}")
    print(f"source: {source.relative_to(plan.REPO)}; travelling in all (working tree + carried): "
          f"{plan.travelling_bytes() / 2**20:.1f} MiB; carry: {json.dumps(list(plan.CARRY))}\n")
    return max(plan.show_plan(name) for name in plan.PLANS)
