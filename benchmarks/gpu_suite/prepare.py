"""`--prepare` (run here, before a GPU lease): everything that must travel with the device commands.

1. `.whl/`: the wheels the GPU image lacks (DeepSpeed, datasets' needs, Liger-Kernel, Cut
   Cross-Entropy), built by `../shared/gpu/make_wheels.sh` unless already there; git-ignored.
2. `.gpu_suite/` (git-ignored): `data/wikitext-2/{valid,test}.txt` and `data/SST-2/*.tsv` copied
   from the shared data (`../shared` does not travel), a WordPiece tokenizer trained on WikiText-2
   (valid + test; the shared copy has no train split) and its shards at L = 128
   (`shards-wikitext-L128`, the sanity stage's data), and `source.json` (the commit and whether the
   tree differed from it: the GPU machine gets no `.git`).
3. Prints the plan (the exact device commands), the carry list and the plan check with the bytes
   that will travel (64 MiB at most).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.gpu_suite import plan
from benchmarks.gpu_suite.stage_io import SOURCE_FILE

PEER_WHEELS = ("deepspeed-", "liger_kernel-", "cut_cross_entropy-")
TOKENIZER_VOCAB = 30522


def find_shared(given: Optional[str]) -> Path:
    """`--shared`, else `../shared` beside this checkout or beside the main checkout of a worktree."""
    if given:
        candidates = [Path(given)]
    else:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=plan.REPO,
                                capture_output=True, text=True).stdout.strip()
        candidates = [plan.REPO.parent / "shared"] + ([Path(common).parent.parent / "shared"] if common else [])
    for path in candidates:
        if (path / "gpu" / "make_wheels.sh").is_file() and (path / "data").is_dir():
            return path
    raise FileNotFoundError(f"--shared: none of {[str(c) for c in candidates]} holds gpu/make_wheels.sh and data/")


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


def build_carry(shared: Path) -> Path:
    """The data folder (idempotent: the tokenizer and shards are rebuilt only when absent)."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer

    carry = plan.REPO / plan.CARRY_DIR
    data = carry / "data"
    (data / "wikitext-2").mkdir(parents=True, exist_ok=True)
    (data / "SST-2").mkdir(parents=True, exist_ok=True)
    texts = []
    for split in ("valid", "test"):
        texts.append(data / "wikitext-2" / f"{split}.txt")
        shutil.copyfile(shared / "data" / "wikitext-2" / f"{split}.txt", texts[-1])
    for split in ("train", "dev", "test"):
        shutil.copyfile(shared / "data" / "glue" / "SST-2" / f"{split}.tsv", data / "SST-2" / f"{split}.tsv")
    tokenizer = carry / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        train_tokenizer([str(t) for t in texts], tokenizer, vocab_size=TOKENIZER_VOCAB, progress=False)
    from benchmarks.gpu_suite.sanity_stage import SHARDS  # one home of the carried shards' path

    build_shards([str(t) for t in texts], tokenizer, plan.REPO / SHARDS, seq_len=128, num_proc=1, progress=False)
    from benchmarks.gpu_suite.stage_io import source_info

    (carry / SOURCE_FILE).write_text(json.dumps({k: v for k, v in source_info().items() if k != "from"}, indent=2))
    return carry


def prepare(shared_arg: Optional[str]) -> int:
    try:
        shared = find_shared(shared_arg)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name in plan.CARRY:
        ensure_ignored(name)
    wheels = build_wheels(shared)
    carry = build_carry(shared)
    size = plan.travelling_bytes()
    print(f"wheels ({plan.WHEELS_DIR}): {', '.join(wheels)}")
    print(f"carried data ({carry.relative_to(plan.REPO)}): "
          f"{sum(p.stat().st_size for p in carry.rglob('*') if p.is_file()) / 2**20:.1f} MiB")
    print(f"travelling in all (working tree + carried): {size / 2**20:.1f} MiB\n")
    print(plan.describe())
    print(f"\ncarry: {json.dumps(list(plan.CARRY))}")
    problems = plan.check_plan(carry_bytes=size)
    for line in problems:
        print(f"plan check: {line}")
    print("plan check: fits every limit" if not problems else "plan check: FAILED")
    return 1 if problems else 0


def carry_problems() -> list[str]:
    """What `--plan` must warn about the carried folders: missing, or recording another commit than HEAD."""
    from benchmarks.gpu_suite.stage_io import source_info

    problems = []
    if not any((plan.REPO / plan.WHEELS_DIR).glob("deepspeed-*.whl")):
        problems.append(f"{plan.WHEELS_DIR}/ has no DeepSpeed wheel: run --prepare")
    recorded = plan.REPO / plan.CARRY_DIR / SOURCE_FILE
    if not recorded.is_file():
        problems.append(f"{recorded.relative_to(plan.REPO)} missing: run --prepare")
    else:
        now, then = source_info(), json.loads(recorded.read_text())
        if (now.get("commit"), now.get("dirty")) != (then.get("commit"), then.get("dirty")):
            problems.append(f"{recorded.relative_to(plan.REPO)} records commit {then.get('commit')} (dirty: "
                            f"{then.get('dirty')}), the tree is at {now.get('commit')} (dirty: {now.get('dirty')}): "
                            "run --prepare again so the results name the code that ran")
    return problems
