"""Bitwise A/B of the training loop's redesign (issue 48, part 2): the same tiny runs on two trees.

    PYTHONPATH=<tree> python -m benchmarks.loop_redesign_ab record --out A.json [--work DIR]
    python -m benchmarks.loop_redesign_ab compare A.json B.json [--md OUT.md] [--json OUT.json]

`record` trains every case below with `pipeline.train`'s own entry point (in this process, one
intra-op thread, CPU, fp32, deterministic) into fixed directories under `--work`, so paths in the
checkpoints are the same for both trees, and writes per case:

* every metrics.jsonl row without its timing fields (`TIMING`: wall-clock values differ run to run);
* the checkpoint tags left on disk (keep_last pruning), `latest`;
* per tag: the sha256 of every tensor in every `.pt` file (model weights, ZeRO optimizer partitions,
  train_state), by its key path, and `pipeline_meta.json` as JSON (compared without its last metrics'
  timing fields and without the config fields the redesign added, `NEW_FIELDS`).

`compare` says per case whether the two records are equal and, where not, the first differences.
The cases: plain MLM (ZeRO 1), TACO (ZeRO 1), ZeRO 3, a 2-phase ModernBERT run (L=64 -> L=128 with
its own LR segment and rotary base), the batch-size warm-up, and a run resumed from its step-3
checkpoint (`--resume`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

#: metrics that measure wall-clock time or memory: they differ between two runs of one tree
TIMING = ("step_time_s", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_rss_gb", "peak_mem_gb")
#: config fields the redesign added (`train.keep_best`, `train.keep_best_mode`, both off by default): in
#: B's saved config only, outside `config_hash` (`RESUME_IGNORED_FIELDS`); not compared
NEW_FIELDS = ("keep_best", "keep_best_mode")
QUIET = ["train.progress_bar=false", "train.tensorboard=false", "train.log_every=1"]


def cases(shards: Path, long_shards: Path) -> dict[str, list[list[str]]]:
    """Case name -> the argument lists of its runs (in order, into one output directory)."""
    phases = [{"name": "short", "steps": 3},
              {"name": "long", "steps": 3, "shards_dir": str(long_shards), "seq_len": 128, "micro_batch_size": 2,
               "global_batch_size": 4, "model": {"global_rope_theta": 160000},
               "optim": {"lr": 5.0e-4, "warmup_steps": 1, "min_lr_ratio": 0.0}}]
    base = ["train.total_steps=6", "train.checkpoint_every=2", "train.keep_last=2"]
    return {
        "tiny-mlm": [["--config", "tiny-mlm", *base]],
        "tiny-taco": [["--config", "tiny-taco", *base]],
        "tiny-mlm-zero3": [["--config", "tiny-mlm", *base, "deepspeed.config=zero3"]],
        "tiny-mlm-2phase": [["--config", "tiny-mlm", *base, "train.keep_last=10", "model.arch=modernbert",
                             "phases=" + json.dumps(phases)]],
        "tiny-mlm-batch-warmup": [["--config", "tiny-mlm", *base, "data.batch_warmup="
                                   + json.dumps({"start_global_batch_size": 4, "tokens": 24 * 64})]],
        "tiny-mlm-resumed": [["--config", "tiny-mlm", "train.total_steps=3", "train.checkpoint_every=3",
                              "train.keep_last=2"],
                             ["--resume", "{out}", "train.total_steps=6", "train.checkpoint_every=2"]],
    }


def build_data(work: Path) -> tuple[Path, Path]:
    """The tests' tiny corpus, tokenizer and shards (L=64 and L=128), built once under `work/data`."""
    from data_prep.build_shards import build_shards
    from data_prep.train_tokenizer import train_tokenizer
    from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB, TINY_VOCAB_SIZE, stdlib_documents, write_corpus

    data = work / "data"
    shards, long_shards = data / "tiny", data / "tiny128"
    if (long_shards / "manifest.json").is_file():
        return shards, long_shards
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    corpus = write_corpus(data / "corpus.txt", stdlib_documents())
    tok = train_tokenizer([corpus], data / "tokenizer", vocab_size=TINY_VOCAB_SIZE, progress=False)
    build_shards([corpus], tok, shards, seq_len=TINY_SEQ_LEN, shard_size_mb=TINY_SHARD_MB, num_proc=1, progress=False)
    build_shards([corpus], tok, long_shards, seq_len=128, shard_size_mb=TINY_SHARD_MB, num_proc=1, progress=False)
    return shards, long_shards


def tensor_hashes(obj: Any, prefix: str = "") -> dict[str, str]:
    """sha256 of every tensor's bytes (with dtype and shape) inside a loaded `.pt` object, by key path."""
    import torch

    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        digest = hashlib.sha256(f"{t.dtype}{tuple(obj.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[prefix] = digest.hexdigest()
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            out.update(tensor_hashes(obj[key], f"{prefix}/{key}"))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            out.update(tensor_hashes(item, f"{prefix}[{i}]"))
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out[prefix] = repr(obj)
    return out


def record_run(out: Path) -> dict[str, Any]:
    import torch

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    root = out / "checkpoints"
    tags = {}
    for tag in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")):
        files = {}
        for pt in sorted(tag.glob("*.pt")):
            files[pt.name] = tensor_hashes(torch.load(pt, map_location="cpu", weights_only=False))
        meta = json.loads((tag / "pipeline_meta.json").read_text())
        tags[tag.name] = {"tensors": files, "meta": meta}
    return {"metrics": [{k: v for k, v in r.items() if k not in TIMING} for r in rows],
            "latest": (root / "latest").read_text().strip(), "tags": tags}


def record(work: Path, only: list[str]) -> dict[str, Any]:
    import torch

    from pipeline.train.__main__ import __file__ as entry  # noqa: F401 - the tree under test is importable
    import importlib

    try:
        main = importlib.import_module("pipeline.train.cli").main
    except ModuleNotFoundError:  # the tree before the redesign: the entry point was in loop.py
        main = importlib.import_module("pipeline.train.loop").main

    torch.set_num_threads(1)
    shards, long_shards = build_data(work)
    results: dict[str, Any] = {"tree": str(Path(entry).resolve().parents[2])}
    for name, runs in cases(shards, long_shards).items():
        if only and name not in only:
            continue
        out = work / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        codes = []
        for argv in runs:
            argv = [a.replace("{out}", str(out)) for a in argv]
            extra = [] if argv[0] == "--resume" else [f"data.shards_dir={shards}", f"train.output_dir={out}", *QUIET]
            codes.append(main([*argv, *extra]))
        results[name] = {"exit_codes": codes, **record_run(out)}
        print(f"{name}: exit {codes}, {len(results[name]['metrics'])} metric rows, tags {list(results[name]['tags'])}",
              flush=True)
    return results


def first_differences(a: Any, b: Any, path: str = "", limit: int = 5) -> list[str]:
    if type(a) is not type(b):
        return [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'B' if key not in a else 'A'}")
            else:
                out += first_differences(a[key], b[key], f"{path}/{key}", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += first_differences(x, y, f"{path}[{i}]", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def compare(a: dict, b: dict) -> dict[str, Any]:
    names = [k for k in a if k != "tree"]
    for record in (a, b):  # (again: a record may hold fields named timing only later)
        for name in names:
            if name not in record:
                continue
            record[name]["metrics"] = [{k: v for k, v in r.items() if k not in TIMING} for r in record[name]["metrics"]]
            for tag in record[name]["tags"].values():  # the last logged metrics in the meta: timing too
                tag["meta"]["last_metrics"] = {k: v for k, v in tag["meta"]["last_metrics"].items() if k not in TIMING}
                for key in NEW_FIELDS:
                    tag["meta"]["config"]["train"].pop(key, None)
    out = {}
    for name in names:
        if name not in b:
            out[name] = {"equal": False, "differences": ["missing in B"]}
            continue
        diffs = first_differences(a[name], b[name])
        out[name] = {"equal": not diffs, "differences": diffs, "metric_rows": len(a[name]["metrics"]),
                     "tags": list(a[name]["tags"]),
                     "tensors": sum(len(f) for t in a[name]["tags"].values() for f in t["tensors"].values())}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--work", default="/tmp/loop_redesign_ab")
    rec.add_argument("--only", nargs="*", default=[])
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--md")
    cmp_.add_argument("--json")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        Path(args.out).write_text(json.dumps(record(Path(args.work), args.only), indent=1, sort_keys=True))
        return 0
    a, b = json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text())
    result = compare(a, b)
    lines = [f"| {n} | {'equal' if r['equal'] else 'DIFFERENT'} | {r.get('metric_rows', '')} | "
             f"{', '.join(r.get('tags', []))} | {r.get('tensors', '')} | {'; '.join(r['differences'])} |"
             for n, r in result.items()]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"a": a.get("tree"), "b": b.get("tree"), "cases": result}, indent=1))
    if args.md:
        Path(args.md).write_text("\n".join(["| case | result | metric rows | tags on disk | tensors/values hashed | "
                                            "differences |", "| --- | --- | --- | --- | --- | --- |", *lines]) + "\n")
    return 0 if all(r["equal"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
