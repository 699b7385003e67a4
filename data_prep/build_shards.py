"""Tokenize and pack text into checksummed Arrow IPC shards (see `pipeline.data.shards` for the format).

    python -m data_prep.build_shards --input corpus/ --tokenizer tok/ --seq-len 512 --out shards/ --num-proc 8

Crash safety: every shard and the manifest are written under a temporary name and renamed.
After each shard, `build_state.json` records the shard's sha256 and the resume point (documents
consumed, packer buffer, counters). A re-run with the same arguments re-hashes the recorded
shards, keeps the valid prefix, deletes anything else (partial `.tmp` files, unrecorded shards)
and continues from the last recorded point, so its output is byte-identical to an uninterrupted
run. A re-run with different arguments (or changed input files / tokenizer) is refused.
`manifest.json` is written last; its presence means the build is complete.

Tokenization uses the Rust tokenizer's batch encoder in `--num-proc` worker processes fed with
document chunks in order (`imap`), so the output does not depend on `--num-proc`. The workers are
started by a `forkserver` (`POOL_START_METHOD`), never forked from the caller: a process forked
while another of the caller's threads holds a lock (a tokenizer's thread pool, logging, a tracker's
upload thread) inherits the lock held forever, and the worker hangs in `futex_wait` (then the pool's
terminate() -> join() hangs too).

Before anything is written the tokenizer must be able to represent the text
(`pipeline.tokenizer_checks`): a vocabulary below `MIN_VOCAB` entries, or more than `MAX_UNK_SHARE`
of the first documents' tokens unknown (a converted model directory that lost its tokenizer files
loads as a 5-token placeholder: ~96% `[UNK]`), is refused with the share in the message (exit 2).
An interrupt (Ctrl-C, SIGINT) ends with one line and exit 130; the shards recorded so far are kept
and the same command resumes. A write that fails (a full disk or quota, a read-only filesystem) ends
with one line and exit 4 (`EXIT_WRITE_FAILED`, training's code for a failed save): the shards
recorded so far are kept, what the failed write left (`*.tmp` files, the tokenizer's staging copy, a
shard written but not recorded) is removed, and the same command resumes once there is space.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from data_prep.packing import PACKING_MODES, Packer
from data_prep.readers import InputError, ReadOptions, Source, check_source, iter_documents, resolve_inputs
from data_prep.encode import DocumentEncoder
from data_prep.holdout import DEFAULT_SUBDIR, DocumentSplit
from data_prep.tokenizer_io import LoadedTokenizer, load_tokenizer
from pipeline.tokenizer_checks import SAMPLE_DOCUMENTS, coverage_problem, unknown_share
from pipeline.data.shards import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    TOKENIZER_SUBDIR,
    Manifest,
    ShardInfo,
    id_dtype_for,
    read_manifest,
    rows_per_shard,
    shard_name,
    write_datasets_files,
    write_shard,
)
from pipeline.io import hash_directory, sha256_file, write_atomic, xxh3_file

from data_prep.output_state import (  # STATE_FILE and EXIT_WRITE_FAILED are imported from here by callers
    EXIT_WRITE_FAILED,
    STATE_FILE,
    _recorded_shards,
    _remove_unrecorded,
    is_write_failure,
    remove_leftovers,
    write_failed_message,
)

#: Test hook: seconds to sleep after each shard is recorded, so a test can kill the build mid-way.
SLEEP_AFTER_SHARD_ENV = "DATA_PREP_SLEEP_AFTER_SHARD"
CHUNK_DOCUMENTS = 512
CHUNK_CHARS = 4 << 20
#: How the tokenizer workers start: from a clean server process, not by forking the (maybe threaded) caller.
POOL_START_METHOD = "forkserver"
EXIT_INTERRUPTED = 130



class BuildRefused(RuntimeError):
    """The output directory holds something this build must not overwrite."""


@dataclass
class BuildStats:
    documents: int = 0  # documents packed
    raw_documents: int = 0  # documents read, empty ones included (the resume position)
    skipped_empty: int = 0  # empty / whitespace-only documents (or ones with no tokens)
    replaced_chars: int = 0  # undecodable byte sequences replaced by U+FFFD
    sequences: int = 0
    tokens: int = 0  # non-padding tokens in the sequences, [CLS]/[SEP] included
    text_tokens: int = 0  # tokens of the documents themselves (no [CLS]/[SEP])
    per_source_raw: list[int] = field(default_factory=list)
    per_source_documents: list[int] = field(default_factory=list)
    other_side: int = 0  # non-empty documents the held-out rule gives to the other set (`data_prep.holdout`)


def _source_record(source: Source) -> dict[str, Any]:
    if source.path.is_dir():
        size = sum(p.stat().st_size for p in source.path.rglob("*") if p.is_file())
        digest = hash_directory(source.path)
    else:
        size, digest = source.path.stat().st_size, sha256_file(source.path)
    return {"path": str(source.path.resolve()), "kind": source.kind, "bytes": size, "sha256": digest}


def _fingerprint(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _describe_sources(old: list, new: list) -> str:
    """Which input files differ between two builds' `[path, sha256]` lists, by name."""
    before, after = dict(map(tuple, old or [])), dict(map(tuple, new or []))
    edited = [p for p in after if p in before and before[p] != after[p]]
    parts = [f"{p} changed since the build (its sha256 differs)" for p in edited[:3]]
    parts += [f"{p} is new" for p in after if p not in before][:3]
    parts += [f"{p} is no longer an input" for p in before if p not in after][:3]
    if not parts and list(before) != list(after):
        parts = ["the input files are in another order"]
    return "input " + ("; ".join(parts) or "files differ")


def _describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    changed = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "sources":
                changed.append(_describe_sources(old.get(key), new.get(key)))
            else:
                changed.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return "; ".join(changed) or "unknown difference"


def _check_out_dir(out: Path, fingerprint: str, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """Return the saved build state to resume from (None for a fresh build); refuse foreign content."""
    if out.exists() and not out.is_dir():
        raise BuildRefused(f"--out {out}: exists and is not a directory; --out names the shard directory to create")
    manifest_path, state_path = out / MANIFEST_FILE, out / STATE_FILE
    previous: dict[str, Any] | None = None
    if manifest_path.is_file():
        manifest = read_manifest(out)
        previous = {"fingerprint": manifest.fingerprint, "fingerprint_inputs": manifest.build_args.get("fingerprint_inputs", {}), "complete": True}
    elif state_path.is_file():
        previous = json.loads(state_path.read_text())
    elif out.is_dir() and any(out.iterdir()):
        raise BuildRefused(f"--out {out}: directory exists, is not empty, and holds no shard build; choose an empty or new directory")
    if previous is not None and previous["fingerprint"] != fingerprint:
        diff = _describe_difference(previous.get("fingerprint_inputs", {}), inputs)
        raise BuildRefused(
            f"--out {out}: already holds a build made with different arguments ({diff}); "
            "refusing to mix them. Use a new --out directory, or delete this one to rebuild."
        )
    return previous


def _copy_tokenizer(src: Path, out: Path, expected_hash: str) -> None:
    dest = out / TOKENIZER_SUBDIR
    if dest.is_dir() and hash_directory(dest) == expected_hash:
        return
    staging = out / (TOKENIZER_SUBDIR + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)


def _valid_prefix(out: Path, recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recorded shards whose files still hash as recorded, up to the first that does not."""
    valid = []
    for entry in recorded:
        path = out / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            break
        valid.append(entry)
    return valid


_WORKER_TOKENIZER: DocumentEncoder | None = None


def _set_tokenizer(backend_json: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = DocumentEncoder(backend_json)


def _init_worker(backend_json: str) -> None:
    """A pool worker: SIGTERM's default action, SIGINT ignored, the tokenizer loaded."""
    # A worker that inherited a handler that only notes SIGTERM (a training process's preemption
    # handler, a driver's clean stop: whatever the start method carries over) would make the pool's
    # terminate() unable to end it while it is busy in the tokenizer's native code, and join() would
    # wait forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Ctrl-C reaches the whole process group: the parent alone reports it (one line) and ends the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_tokenizer(backend_json)


def _tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _WORKER_TOKENIZER.encode(texts)


def _chunks(sources: list[Source], options: ReadOptions, skip: int,
            split: DocumentSplit | None = None) -> Iterator[list[tuple[int, str | None, int]]]:
    """(source index, text, replaced chars) in chunks, after skipping the first `skip` raw documents;
    a document `split` gives to the other set comes as text None (counted, not tokenized)."""
    chunk: list[tuple[int, str, int]] = []
    chars = 0
    seen = 0
    for index, source in enumerate(sources):
        for doc in iter_documents(source, options):
            seen += 1
            if seen <= skip:
                continue
            if split is not None and doc.text.strip() and not split.keeps(doc.text):
                chunk.append((index, None, 0))
                continue
            chunk.append((index, doc.text, doc.replaced))
            chars += len(doc.text)
            if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
                yield chunk
                chunk, chars = [], 0
    if chunk:
        yield chunk


def worker_pool(num_proc: int, backend_json: str) -> multiprocessing.pool.Pool:
    """`num_proc` tokenizer workers (`_init_worker`), started by `POOL_START_METHOD`."""
    return multiprocessing.get_context(POOL_START_METHOD).Pool(num_proc, _init_worker, (backend_json,))


def check_coverage(tokenizer: LoadedTokenizer, sources: list[Source], options: ReadOptions) -> None:
    """Refuse (ValueError naming --tokenizer and the unknown share) a tokenizer that cannot represent
    the first `SAMPLE_DOCUMENTS` non-empty documents (`pipeline.tokenizer_checks`)."""
    texts: list[str] = []
    for chunk in _chunks(sources, options, 0):
        texts += [text for _, text, _ in chunk if text.strip()][: SAMPLE_DOCUMENTS - len(texts)]
        if len(texts) >= SAMPLE_DOCUMENTS:
            break
    if not texts:
        return  # no documents: the build reports that itself
    ids, _, lengths = DocumentEncoder(tokenizer.backend_json).encode(texts)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    share, tokens = unknown_share((ids[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])),
                                  tokenizer.special_tokens["unk"])
    problem = coverage_problem(tokenizer.directory, tokenizer.vocab_size, share, tokens,
                               f"the first {len(texts)} documents")
    if problem:
        raise ValueError(f"--tokenizer {problem}; nothing was written")


def _tokenized(chunks: Iterator[list[tuple[int, str, int]]], tokenizer: LoadedTokenizer, num_proc: int):
    """Yield (chunk, tokenized non-empty texts) in input order, using `num_proc` processes."""
    def texts_of(chunk: list[tuple[int, str, int]]) -> list[str]:
        return [text for _, text, _ in chunk if text is not None and text.strip()]

    if num_proc <= 1:
        _set_tokenizer(tokenizer.backend_json)  # in this process: its own signal handlers stay
        for chunk in chunks:
            yield chunk, _tokenize_chunk(texts_of(chunk))
        return
    # A bounded window of chunks in flight (Pool.imap would read the whole corpus ahead into memory).
    window: deque = deque()
    with worker_pool(num_proc, tokenizer.backend_json) as pool:
        for chunk in chunks:
            window.append((chunk, pool.apply_async(_tokenize_chunk, (texts_of(chunk),))))
            if len(window) >= 2 * num_proc:
                done, result = window.popleft()
                yield done, result.get()
        while window:
            done, result = window.popleft()
            yield done, result.get()


class _ShardWriter:
    """Accumulates sequences; writes a shard every `rows` sequences and records the resume point."""

    def __init__(self, out: Path, seq_len: int, rows: int, dtype: np.dtype, state: dict[str, Any]) -> None:
        self.out, self.rows, self.state = out, rows, state
        self.ids = np.zeros((rows, seq_len), dtype=dtype)
        self.starts = np.zeros((rows, seq_len), dtype=np.uint8)
        self.lengths = np.zeros(rows, dtype=np.int32)
        self.filled = 0
        self.sleep = float(os.environ.get(SLEEP_AFTER_SHARD_ENV, "0") or 0)

    def add(self, ids: np.ndarray, starts: np.ndarray, length: int) -> bool:
        """Add one sequence; True when the shard buffer is full (call `flush`)."""
        self.ids[self.filled], self.starts[self.filled], self.lengths[self.filled] = ids, starts, length
        self.filled += 1
        return self.filled == self.rows

    def flush(self, resume: dict[str, Any] | None) -> None:
        if self.filled == 0:
            return
        name = shard_name(len(self.state["shards"]))
        info = write_shard(self.out / name, self.ids[: self.filled], self.starts[: self.filled], self.lengths[: self.filled])
        self.state["shards"].append({**asdict(info), "resume": resume})
        write_atomic(self.out / STATE_FILE, json.dumps(self.state, sort_keys=True))
        self.filled = 0
        if self.sleep:
            time.sleep(self.sleep)


def build_shards(
    inputs: Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    seq_len: int = 512,
    packing: str = "full",
    read_options: ReadOptions = ReadOptions(),
    shard_size_mb: float = 256.0,
    num_proc: int = 1,
    progress: bool = True,
    holdout_fraction: float = 0.0,
    holdout_dir: str | os.PathLike | None = None,
    split: DocumentSplit | None = None,
) -> Manifest:
    """Build (or resume, or confirm) a shard directory; returns its manifest.

    `holdout_fraction` > 0: that share of the documents (`data_prep.holdout`) goes to a validation shard
    directory of its own, `holdout_dir` (default `<out>/validation`), built after `out` with the same
    tokenizer and seq_len (`split`: the side one build packs, set by that recursion).
    Raises `InputError` for bad inputs, `ValueError` for bad arguments, `BuildRefused` when `out`
    holds a different build.
    """
    out = Path(out)
    if holdout_fraction:
        held_dir = Path(holdout_dir) if holdout_dir else out / DEFAULT_SUBDIR
        created = [d for d in (out, held_dir) if not d.exists()]  # what this command makes, and removes on failure
        try:
            train_side = build_shards(inputs, tokenizer, out, seq_len, packing, read_options, shard_size_mb, num_proc,
                                      progress, split=DocumentSplit(holdout_fraction, "train"))
            build_shards(inputs, tokenizer, held_dir, seq_len, packing, read_options, shard_size_mb, num_proc,
                         progress, split=DocumentSplit(holdout_fraction, "validation"))
        except InputError as err:
            # one side without documents (or bad input): a training set left without its validation set would be
            # refused by the re-run with another fraction ("holds a different build"), so nothing made here stays
            for directory in reversed(created):
                shutil.rmtree(directory, ignore_errors=True)
            if created:
                err.args = (f"{err}; nothing was written",)
            raise
        return train_side
    if packing not in PACKING_MODES:
        raise ValueError(f"--packing {packing!r}: expected one of {PACKING_MODES}")
    if seq_len < 8:
        raise ValueError(f"--seq-len {seq_len}: must be at least 8")
    if shard_size_mb <= 0:
        raise ValueError(f"--shard-size-mb {shard_size_mb}: must be positive")
    sources = resolve_inputs(list(inputs))
    for source in sources:
        check_source(source, read_options)
    loaded = load_tokenizer(tokenizer)
    check_coverage(loaded, sources, read_options)
    tokenizer_hash = hash_directory(loaded.directory)
    dtype = id_dtype_for(loaded.vocab_size)
    rows = rows_per_shard(seq_len, dtype, shard_size_mb)
    records = [_source_record(s) for s in tqdm(sources, desc="hashing inputs", disable=not progress or len(sources) < 2, file=sys.stderr)]
    fingerprint_inputs = {
        "format_version": FORMAT_VERSION,
        "seq_len": seq_len,
        "packing": packing,
        "rows_per_shard": rows,
        "read_options": asdict(read_options),
        "tokenizer_hash": tokenizer_hash,
        "sources": [[r["path"], r["sha256"]] for r in records],
        **({"holdout": split.record()} if split is not None else {}),
    }
    fingerprint = _fingerprint(fingerprint_inputs)
    previous = _check_out_dir(out, fingerprint, fingerprint_inputs)
    if previous is not None and previous.get("complete"):
        from data_prep.verify import verify_directory

        problems = verify_directory(out)
        if problems:
            raise BuildRefused(f"--out {out}: complete build with the same arguments, but verification fails: {problems[0]} (delete it to rebuild)")
        (out / STATE_FILE).unlink(missing_ok=True)  # left behind if a run died right after the manifest
        return read_manifest(out)

    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    valid = _valid_prefix(out, previous["shards"]) if previous else []
    _remove_unrecorded(out, {entry["name"] for entry in valid})
    state = {"fingerprint": fingerprint, "fingerprint_inputs": fingerprint_inputs, "shards": valid}
    write_atomic(out / STATE_FILE, json.dumps(state, sort_keys=True))  # first: from here on a re-run resumes
    _copy_tokenizer(loaded.directory, out, tokenizer_hash)

    specials = loaded.special_tokens
    packer = Packer(seq_len, specials["cls"], specials["sep"], specials["pad"], packing)
    stats = BuildStats(per_source_raw=[0] * len(sources), per_source_documents=[0] * len(sources))
    if valid:
        resume = valid[-1]["resume"]
        stats = BuildStats(**resume["stats"])
        packer.load_state(resume["packer"])
        print(f"resuming after {len(valid)} verified shard(s), {stats.raw_documents} documents", file=sys.stderr)
    writer = _ShardWriter(out, seq_len, rows, dtype, state)
    start_tokens, started = stats.tokens, time.perf_counter()

    def emit(sequences: Iterator[tuple[np.ndarray, np.ndarray, int]], bar: tqdm) -> None:
        for ids, starts, length in sequences:
            stats.sequences += 1
            stats.tokens += length
            bar.update(length)
            if writer.add(ids, starts, length):
                writer.flush({"stats": asdict(stats), "packer": packer.state()})

    with tqdm(desc="tokenizing", unit=" tok", unit_scale=True, disable=not progress, file=sys.stderr) as bar:
        chunks = _chunks(sources, read_options, stats.raw_documents, split)
        for chunk, (ids, starts, lengths) in _tokenized(chunks, loaded, num_proc):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            encoded = 0
            for source_index, text, replaced in chunk:
                stats.raw_documents += 1
                stats.per_source_raw[source_index] += 1
                stats.replaced_chars += replaced
                if text is None:
                    stats.other_side += 1
                    continue
                if not text.strip():
                    stats.skipped_empty += 1
                    continue
                lo, hi = offsets[encoded], offsets[encoded + 1]
                encoded += 1
                if hi == lo:
                    stats.skipped_empty += 1
                    continue
                stats.documents += 1
                stats.text_tokens += int(hi - lo)
                stats.per_source_documents[source_index] += 1
                packer.add_document(ids[lo:hi], starts[lo:hi])
                emit(packer.ready(), bar)
            bar.set_postfix(docs=stats.documents, seqs=stats.sequences, refresh=False)
        emit(packer.finish(), bar)
        writer.flush({"stats": asdict(stats), "packer": packer.state()})

    if stats.documents == 0:
        shutil.rmtree(out / TOKENIZER_SUBDIR, ignore_errors=True)
        (out / STATE_FILE).unlink()
        if made_out:
            with contextlib.suppress(OSError):  # the directory this build made, when nothing else is in it
                out.rmdir()
        sources_text = " ".join(map(str, inputs))
        if split is not None and stats.other_side:  # the documents exist: the held-out rule gave them all away
            raise split.nothing_on_this_side(stats.other_side, sources_text)
        raise InputError(f"--input {sources_text}: no non-empty documents ({stats.skipped_empty} empty skipped)")
    for record, raw, docs in zip(records, stats.per_source_raw, stats.per_source_documents):
        record.update(raw_documents=raw, documents=docs)
    shards = [ShardInfo(e["name"], e["rows"], e["sha256"], e["bytes"], e.get("xxh3_64") or xxh3_file(out / e["name"]))
              for e in state["shards"]]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        seq_len=seq_len,
        vocab_size=loaded.vocab_size,
        special_tokens=specials,
        tokenizer_hash=tokenizer_hash,
        shards=shards,
        total_sequences=sum(s.rows for s in shards),
        total_tokens=stats.tokens,
        sources=records,
        build_args={
            "inputs": [str(p) for p in inputs],
            "tokenizer": str(tokenizer),
            "seq_len": seq_len,
            "packing": packing,
            "shard_size_mb": shard_size_mb,
            "num_proc": num_proc,
            **asdict(read_options),
            "fingerprint_inputs": fingerprint_inputs,
        },
        id_dtype=dtype.name,
        packing=packing,
        stats={
            "documents": stats.documents,
            "text_tokens": stats.text_tokens,
            "skipped_empty": stats.skipped_empty,
            "replaced_chars": stats.replaced_chars,
            "empty_inputs": sum(1 for raw in stats.per_source_raw if raw == 0),
            "padding_tokens": stats.sequences * seq_len - stats.tokens,
            **({"other_side_documents": stats.other_side} if split is not None else {}),
        },
        fingerprint=fingerprint,
    )
    write_datasets_files(out, manifest)  # datasets.load_from_disk(out); before the manifest that completes it
    write_atomic(out / MANIFEST_FILE, manifest.to_json())
    (out / STATE_FILE).unlink()
    elapsed = time.perf_counter() - started
    if progress:
        print(summary(manifest, (stats.tokens - start_tokens) / max(elapsed, 1e-9)), file=sys.stderr)
    return manifest


def summary(manifest: Manifest, tokens_per_second: float | None = None) -> str:
    """Human-readable end-of-build summary."""
    s = manifest.stats
    padding = s["padding_tokens"] / max(1, manifest.total_sequences * manifest.seq_len)
    lines = [
        f"documents: {s['documents']:,} (skipped empty: {s['skipped_empty']:,}; empty input files: {s['empty_inputs']})",
        f"tokens: {manifest.total_tokens:,}  sequences: {manifest.total_sequences:,} x {manifest.seq_len}  padding: {padding:.2%}",
        f"shards: {len(manifest.shards)}  undecodable characters replaced: {s['replaced_chars']:,}",
    ]
    if tokens_per_second is not None:
        lines.append(f"throughput: {tokens_per_second:,.0f} tokens/s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.build_shards",
        description="Tokenize text and pack it into fixed-length, checksummed Arrow shards plus manifest.json. "
        "Re-running the same command after an interruption resumes; different arguments into the same --out are refused.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="inputs: .txt, .jsonl(.gz), .parquet, a datasets save_to_disk dir, or a directory of such files")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="local tokenizer directory (AutoTokenizer-loadable); copied to OUT/tokenizer")
    parser.add_argument("--seq-len", type=int, default=512, help="sequence length, [CLS] and [SEP] included")
    parser.add_argument("--out", required=True, metavar="DIR", help="output shard directory")
    parser.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 1)), help="tokenizer processes (output does not depend on it)")
    parser.add_argument("--packing", choices=PACKING_MODES, default="full", help="full: documents joined by [SEP] (RoBERTa FULL-SENTENCES); doc: each document starts a new sequence")
    parser.add_argument("--doc-per-line", action="store_true", help=".txt: one document per line (default: documents separated by blank lines)")
    parser.add_argument("--text-field", default="text", help=".jsonl/.parquet/datasets: name of the text field")
    parser.add_argument("--split", default="train", help="datasets DatasetDict: split to read")
    parser.add_argument("--shard-size-mb", type=float, default=256.0, help="upper bound on one shard's size in MiB")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or summary")
    parser.add_argument("--holdout-fraction", type=float, default=0.0,
                        help="hold out this share of the documents (by document, data_prep.holdout) into a validation "
                             "shard directory of its own, for eval.shards_dir; 0: none")
    parser.add_argument("--holdout-dir", metavar="DIR", help="the validation set's directory (default: OUT/validation)")
    return parser


def interrupted_message(out: Path) -> str:
    """What an interrupted build left: the shards its state records (kept) and how to resume."""
    shards = len(_recorded_shards(out))
    kept = f"the {shards} shard(s) recorded in {out / STATE_FILE} are kept" if shards else "no shard was complete yet"
    return f"interrupted (SIGINT): {kept}; re-run the same command to resume"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = build_shards(
            args.input,
            args.tokenizer,
            args.out,
            seq_len=args.seq_len,
            packing=args.packing,
            read_options=ReadOptions(args.doc_per_line, args.text_field, args.split),
            shard_size_mb=args.shard_size_mb,
            num_proc=args.num_proc,
            progress=not args.no_progress,
            holdout_fraction=args.holdout_fraction,
            holdout_dir=args.holdout_dir,
        )
    except (InputError, ValueError, BuildRefused) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: {interrupted_message(Path(args.out))}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:
        if not is_write_failure(err, Path(args.out)):
            raise
        remove_leftovers(Path(args.out))
        print(f"error: {write_failed_message(Path(args.out), err)}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    print(f"{args.out}: {manifest.total_sequences:,} sequences in {len(manifest.shards)} shard(s)")
    if args.holdout_fraction:
        held = read_manifest(args.holdout_dir or Path(args.out) / DEFAULT_SUBDIR)
        print(f"{args.holdout_dir or Path(args.out) / DEFAULT_SUBDIR}: {held.total_sequences:,} held-out sequences "
              f"({held.stats['documents']:,} documents) for eval.shards_dir")
    return 0


if __name__ == "__main__":
    sys.exit(main())
