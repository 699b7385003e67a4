"""Merge shard directories built in parallel (one per input part) into one shard directory.

    python -m data_prep.merge --out shards/ parts/part_00000 parts/part_00001 ...

The SLURM data-preparation job (`slurm/prep.sbatch`) runs `data_prep.build_shards` once per
array task, each on its own slice of the inputs and with the same tokenizer, then this merge and
`data_prep.verify`. The merged directory lists the parts' shards in part order under fresh
names (`shard_00000.arrow`, ...), hard-linked when the file system allows (no copy, and the parts
stay valid) and copied otherwise; the tokenizer is copied from the first part; the manifest sums
the parts' totals and statistics and keeps every part's sources and build arguments.

All parts must agree on what makes shards interchangeable (format version, sequence length,
vocabulary, special tokens, tokenizer hash, id dtype, packing) and on the held-out rule they were built
with (`--holdout-fraction` and side, `data_prep.holdout`: a training part that held nothing out beside
one that did would let the other's validation documents train); a part without `manifest.json`
is an unfinished build. Either is an error naming the part and the field, before anything is
written. `manifest.json` is written last and atomically, so a crash leaves no manifest and a
re-run starts over; a re-run over a complete merge of the same parts does nothing, and an
`--out` holding anything else is refused.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.data.shards import (
    DATASETS_INFO_FILE,
    DATASETS_STATE_FILE,
    FORMAT_VERSION,
    MANIFEST_FILE,
    TOKENIZER_SUBDIR,
    Manifest,
    ShardInfo,
    manifest_file_sha256,
    read_manifest,
    shard_name,
    write_datasets_files,
)
from pipeline.io import hash_directory, write_atomic, xxh3_file

#: Manifest fields every part must share for its shards to be read as one dataset.
SHARED_FIELDS = ("format_version", "seq_len", "vocab_size", "special_tokens", "tokenizer_hash", "id_dtype", "packing")


class MergeRefused(RuntimeError):
    """The output directory holds something this merge must not overwrite."""


def _check_parts(parts: list[Path]) -> list[Manifest]:
    if not parts:
        raise ValueError("no part directories given")
    if len(set(p.resolve() for p in parts)) != len(parts):
        raise ValueError("a part directory is listed twice")
    manifests = []
    for part in parts:
        if not (part / MANIFEST_FILE).is_file():
            raise FileNotFoundError(f"{part}: no {MANIFEST_FILE}; this part's build_shards did not finish (re-run its array task)")
        manifests.append(read_manifest(part))
    first = manifests[0]
    for part, manifest in zip(parts[1:], manifests[1:]):
        if holdout_of(manifest) != holdout_of(first):
            raise ValueError(f"{part}: held-out rule {_describe(holdout_of(manifest))} differs from {parts[0]}'s "
                             f"{_describe(holdout_of(first))}; every part must be built with the same "
                             "--holdout-fraction (BUILD_ARGS)")
        for name in SHARED_FIELDS:
            if getattr(manifest, name) != getattr(first, name):
                raise ValueError(
                    f"{part}: {name} {getattr(manifest, name)!r} differs from {parts[0]}'s {getattr(first, name)!r}; "
                    "every part must be built with the same tokenizer, --seq-len and --packing"
                )
    return manifests


def holdout_of(manifest: Manifest) -> Optional[dict]:
    """The held-out rule a shard directory was built with (`DocumentSplit.record`), None without one; a merged
    directory's is its parts' (they agree)."""
    args = manifest.build_args or {}
    return (args.get("fingerprint_inputs") or {}).get("holdout") or args.get("holdout")


def _describe(rule: Optional[dict]) -> str:
    return "none" if rule is None else f"--holdout-fraction {rule['fraction']} ({rule['side']} side)"


def _merged_manifest(parts: list[Path], manifests: list[Manifest]) -> Manifest:
    first = manifests[0]
    shards, sources = [], []
    stats: dict[str, int] = {}
    for part_index, (part, manifest) in enumerate(zip(parts, manifests)):
        for info in manifest.shards:
            # Format-1 parts have no xxh3 hash: computed here, so the merged manifest has one for every shard.
            fast = info.xxh3_64 or xxh3_file(part / info.name)
            shards.append(ShardInfo(shard_name(len(shards)), info.rows, info.sha256, info.bytes, fast))
        sources += [dict(source, part=part_index) for source in manifest.sources]
        for key, value in manifest.stats.items():
            stats[key] = stats.get(key, 0) + int(value)
    part_records = [
        {"dir": str(part.resolve()), "fingerprint": m.fingerprint, "manifest_sha256": manifest_file_sha256(part), "build_args": m.build_args}
        for part, m in zip(parts, manifests)
    ]
    fingerprint = hashlib.sha256(json.dumps([r["manifest_sha256"] for r in part_records]).encode()).hexdigest()
    return Manifest(
        format_version=FORMAT_VERSION,
        seq_len=first.seq_len,
        vocab_size=first.vocab_size,
        special_tokens=dict(first.special_tokens),
        tokenizer_hash=first.tokenizer_hash,
        shards=shards,
        total_sequences=sum(m.total_sequences for m in manifests),
        total_tokens=sum(m.total_tokens for m in manifests),
        sources=sources,
        build_args={"merged_parts": part_records,
                    **({"holdout": holdout_of(first)} if holdout_of(first) else {})},
        id_dtype=first.id_dtype,
        packing=first.packing,
        stats=stats,
        fingerprint=fingerprint,
    )


def _place(src: Path, dest: Path) -> None:
    """Hard-link src at dest (copy across file systems), replacing a leftover from a crashed run."""
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def merge_parts(parts: Sequence[str | os.PathLike], out: str | os.PathLike) -> Manifest:
    """Merge complete shard directories `parts` (in this order) into `out`; returns its manifest."""
    parts = [Path(p) for p in parts]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MergeRefused(f"--out {out}: exists and is not a directory; --out names the shard directory to create")
    manifests = _check_parts(parts)
    merged = _merged_manifest(parts, manifests)
    if (out / MANIFEST_FILE).is_file():
        existing = read_manifest(out)
        if existing.fingerprint == merged.fingerprint:
            return existing
        raise MergeRefused(f"--out {out}: holds a different complete shard directory; choose a new --out or delete it")
    unfinished = (TOKENIZER_SUBDIR, "shard_", DATASETS_STATE_FILE, DATASETS_INFO_FILE)
    if out.is_dir() and any(not p.name.startswith(unfinished) for p in out.iterdir()):
        raise MergeRefused(f"--out {out}: not empty and not an unfinished merge; choose an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("shard_*"):  # an unfinished merge: start over
        stale.unlink()

    tokenizer_src = parts[0] / TOKENIZER_SUBDIR
    if hash_directory(tokenizer_src) != merged.tokenizer_hash:
        raise ValueError(f"{tokenizer_src}: hash differs from the manifest's tokenizer_hash (the part is corrupt; rebuild it)")
    staging = out / (TOKENIZER_SUBDIR + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(tokenizer_src, staging)
    shutil.rmtree(out / TOKENIZER_SUBDIR, ignore_errors=True)
    os.replace(staging, out / TOKENIZER_SUBDIR)

    merged_names = iter(merged.shards)
    for part, manifest in zip(parts, manifests):
        for info in manifest.shards:
            _place(part / info.name, out / next(merged_names).name)
    write_datasets_files(out, merged)  # datasets.load_from_disk(out); before the manifest that completes it
    write_atomic(out / MANIFEST_FILE, merged.to_json())
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", metavar="PART_DIR", help="complete shard directories, in the order their shards should follow")
    parser.add_argument("--out", required=True, metavar="DIR", help="merged shard directory to create")
    args = parser.parse_args(argv)
    try:
        manifest = merge_parts(args.parts, args.out)
    except (FileNotFoundError, ValueError, MergeRefused) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(args.parts)} part(s), {len(manifest.shards)} shard(s), {manifest.total_sequences:,} sequences, {manifest.total_tokens:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
