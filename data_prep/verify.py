"""Check shard directories against their manifests; exit non-zero on any mismatch.

    python -m data_prep.verify shards/ [more/ ...]        each directory on its own
    python -m data_prep.verify --mixture wiki/ books/     the sources of one mixture (`data.sources`)
    python -m data_prep.verify --config RUN.yaml [data.sources=...]   what a run config reads

With `--mixture` (implied by `--config` with `data.sources`) every directory also has to share the
first one's tokenizer (hash, vocabulary, special-token ids) and seq_len, as training requires
(`pipeline.data.sources.mixture_mismatches`).

Checks: the manifest against itself and the directory (`pipeline.data.shards.check_layout`:
sizes, Arrow schemas, row counts, totals, `vocab_size` against the id type and the tokenizer,
the tokenizer directory's hash, the special-token ids against the tokenizer's, the manifest's
`content_hash` over every field training reads, and no shard file (`.arrow`) the manifest does not
list: the same checks training runs at start), then every shard's full bytes against its sha256 and xxh3-64
hash, that `length` is within [2, seq_len], that each row is `[CLS] ... [SEP]` followed only by
`[PAD]`, that every id is below the vocabulary size, and the token total.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.data.shards import check_layout, iter_shard_paths, open_shard, read_manifest
from pipeline.io import sha256_file, xxh3_file
from pipeline.data.sources import data_directories, mixture_mismatches


def _check_rows(name: str, ids: np.ndarray, length: np.ndarray, seq_len: int, vocab_size: int, specials: dict[str, int]) -> list[str]:
    problems = []
    if len(length) and (length.min() < 2 or length.max() > seq_len):
        problems.append(f"{name}: lengths outside [2, {seq_len}] (min {length.min()}, max {length.max()})")
        return problems
    if ids.size and int(ids.max()) >= vocab_size:
        problems.append(f"{name}: token id {int(ids.max())} >= vocab_size {vocab_size}")
    rows = np.arange(len(length))
    if len(length) and not (ids[:, 0] == specials["cls"]).all():
        problems.append(f"{name}: a row does not start with [CLS] (id {specials['cls']})")
    if len(length) and not (ids[rows, length - 1] == specials["sep"]).all():
        problems.append(f"{name}: a row does not end with [SEP] (id {specials['sep']}) at its length")
    padding = np.arange(seq_len)[None, :] >= length[:, None]
    if not (ids[padding] == specials["pad"]).all():
        problems.append(f"{name}: non-[PAD] ids after a row's length")
    return problems


def verify_directory(directory: str | Path) -> list[str]:
    """All problems found (empty list when the directory is intact)."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except (FileNotFoundError, ValueError) as err:
        return [str(err)]
    problems = check_layout(directory, manifest)
    if not (directory / "tokenizer").is_dir():
        problems.append(f"{directory / 'tokenizer'}: missing")
    total_rows = total_tokens = 0
    for info, path in iter_shard_paths(directory, manifest):
        if not path.is_file() or any(p.startswith(f"{path}:") for p in problems):
            continue  # missing or structurally damaged: already reported
        if sha256_file(path) != info.sha256:
            problems.append(f"{path}: sha256 mismatch (file changed or corrupt)")
            continue
        if info.xxh3_64 and xxh3_file(path) != info.xxh3_64:
            problems.append(f"{path}: xxh3-64 mismatch (file changed, or its manifest entry edited)")
            continue
        try:
            shard = open_shard(path, manifest.seq_len, manifest.id_dtype, info, check_hash=False)
        except ValueError as err:
            problems.append(str(err))
            continue
        try:
            problems += _check_rows(str(path), shard.input_ids, shard.length, manifest.seq_len, manifest.vocab_size, manifest.special_tokens)
            total_rows += len(shard.length)
            total_tokens += int(shard.length.sum())
        finally:
            shard.mapped.close()
    if not problems:
        if total_rows != manifest.total_sequences:
            problems.append(f"manifest: total_sequences {manifest.total_sequences}, shards hold {total_rows}")
        if total_tokens != manifest.total_tokens:
            problems.append(f"manifest: total_tokens {manifest.total_tokens}, shards hold {total_tokens}")
    return problems


def verify_mixture(directories: Sequence[str | Path]) -> list[str]:
    """`verify_directory` of each, then (all intact) the directories against the first as one mixture."""
    problems = [problem for directory in directories for problem in verify_directory(directory)]
    if not problems:
        problems = mixture_mismatches([(str(d), str(d), read_manifest(d)) for d in directories])
    return problems


def config_directories(config: str, overrides: Sequence[str]) -> tuple[list[str], bool]:
    """(directories, is a mixture) a run config reads: its `data.shards_dir` or every `data.sources` path."""
    from pipeline.train.run_config import load_config

    data = load_config(config, overrides).data
    return data_directories(data), bool(data.sources)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="*", help="shard directories written by data_prep.build_shards (with "
                        "--config: dotted overrides of the run config instead)")
    parser.add_argument("--mixture", action="store_true", help="the directories are the sources of one mixture: "
                        "they must also share one tokenizer and seq_len")
    parser.add_argument("--config", help="verify what this run config (preset or YAML) reads: data.shards_dir or "
                        "every data.sources path (as a mixture)")
    args = parser.parse_args(argv)
    mixture = args.mixture
    if args.config:
        from pipeline.config.checks import ConfigError

        try:
            directories, mixture = config_directories(args.config, args.directory)
        except ConfigError as err:
            parser.error(str(err))
    elif not args.directory:
        parser.error("give at least one shard directory (or --config RUN.yaml)")
    else:
        directories = list(args.directory)
    failed = False
    for directory in directories:
        problems = verify_directory(directory)
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        if problems:
            failed = True
            print(f"{directory}: {len(problems)} problem(s)", file=sys.stderr)
            continue
        manifest = read_manifest(directory)
        print(f"OK {directory}: {len(manifest.shards)} shards, {manifest.total_sequences:,} sequences, "
              f"{manifest.total_tokens:,} tokens")
    if mixture and not failed and len(directories) > 1:
        problems = mixture_mismatches([(str(d), str(d), read_manifest(d)) for d in directories])
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        if problems:
            print(f"mixture of {len(directories)} directories: {len(problems)} problem(s)", file=sys.stderr)
            return 1
        print(f"OK mixture of {len(directories)} directories: one tokenizer, seq_len {read_manifest(directories[0]).seq_len}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
