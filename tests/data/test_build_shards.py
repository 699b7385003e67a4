"""data_prep.build_shards + verify: round trip, formats, crash safety, refusals, bad inputs."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data_prep.build_shards import SLEEP_AFTER_SHARD_ENV, STATE_FILE, BuildRefused, build_shards
from data_prep.build_shards import main as build_main
from data_prep.readers import InputError, ReadOptions, Source, iter_documents
from data_prep.verify import main as verify_main
from data_prep.verify import verify_directory
from pipeline.data.reader import ShardDataset
from pipeline.data.shards import manifest_hash, read_manifest
from pipeline.io import sha256_file
from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB, stdlib_documents, write_corpus

REPO = Path(__file__).resolve().parents[2]


def _docs() -> list[str]:
    """Small real documents without blank lines inside (so .txt splitting is unambiguous)."""
    docs = stdlib_documents(("bisect", "heapq", "textwrap", "fractions", "queue", "string"))
    return ["\n".join(line for line in d.splitlines() if line.strip()) for d in docs]


def _content_rows(directory: Path) -> list[np.ndarray]:
    ds = ShardDataset(directory)
    shards = ds._open()
    return [s.input_ids[i, 1 : s.length[i] - 1].astype(np.int64) for s in shards for i in range(len(s.length))]


def _word_starts_rows(directory: Path) -> list[np.ndarray]:
    shards = ShardDataset(directory)._open()
    return [s.word_starts[i, 1 : s.length[i] - 1] for s in shards for i in range(len(s.length))]


def _expected_word_starts(word_ids: list[int]) -> list[int]:
    return [1] + [int(b != a) for a, b in zip(word_ids, word_ids[1:])]


def _build(inputs, tokenizer, out, **kwargs):
    kwargs.setdefault("seq_len", TINY_SEQ_LEN)
    kwargs.setdefault("shard_size_mb", TINY_SHARD_MB)
    kwargs.setdefault("progress", False)
    return build_shards([str(p) for p in inputs], tokenizer, out, **kwargs)


def test_round_trip_equals_direct_tokenization(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    docs = _docs()
    corpus = write_corpus(tmp_path / "docs.txt", docs)
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    direct = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    specials = _build([corpus], tiny_tokenizer_dir, tmp_path / "doc", packing="doc").special_tokens

    # Per-document packing: each document is exactly the concatenation of its own rows.
    rows = iter(_content_rows(tmp_path / "doc"))
    for expected in direct:
        got: list[int] = []
        while len(got) < len(expected):
            got += next(rows).tolist()
        assert got == expected
    assert next(rows, None) is None
    # Word starts agree with the tokenizer's own word segmentation (pre-tokenizer word ids).
    starts = np.concatenate(_word_starts_rows(tmp_path / "doc")).tolist()
    expected_starts = [s for d in docs for s in _expected_word_starts(tok(d, add_special_tokens=False).word_ids())]
    # A document longer than one row restarts a word at each row boundary; compare elsewhere.
    row_firsts = np.cumsum([0] + [len(r) for r in _word_starts_rows(tmp_path / "doc")])[:-1]
    keep = np.ones(len(starts), dtype=bool)
    keep[row_firsts] = False
    assert np.array_equal(np.array(starts)[keep], np.array(expected_starts)[keep])
    assert all(r[0] == 1 for r in _word_starts_rows(tmp_path / "doc"))

    # FULL-SENTENCES: the concatenated stream, without separators, is every document in order;
    # every row but the last is completely full.
    manifest = _build([corpus], tiny_tokenizer_dir, tmp_path / "full", packing="full")
    rows = _content_rows(tmp_path / "full")
    stream = np.concatenate(rows)
    assert stream[stream != specials["sep"]].tolist() == [t for d in direct for t in d]
    assert all(len(r) == TINY_SEQ_LEN - 2 for r in rows[:-1])
    assert manifest.total_tokens == sum(len(r) + 2 for r in rows)
    assert manifest.stats["documents"] == len(docs)
    assert manifest.id_dtype == "uint16" and manifest.vocab_size == 800
    assert verify_directory(tmp_path / "full") == []


def test_fixture_manifest_and_tokenizer_copy(tiny_shards_dir: Path, tiny_tokenizer_dir: Path) -> None:
    manifest = read_manifest(tiny_shards_dir)
    assert len(manifest.shards) > 3 and manifest.total_sequences == sum(s.rows for s in manifest.shards)
    assert manifest.special_tokens == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert manifest.sources[0]["sha256"] and manifest.sources[0]["bytes"] > 0
    assert manifest.build_args["seq_len"] == TINY_SEQ_LEN
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny_shards_dir / "tokenizer" / name).read_bytes() == (tiny_tokenizer_dir / name).read_bytes()
    assert len(manifest_hash(tiny_shards_dir)) == 64
    assert AutoTokenizer.from_pretrained(str(tiny_shards_dir / "tokenizer"), local_files_only=True).mask_token_id == 4


def test_verify_catches_a_flipped_byte(tmp_path: Path, tiny_shards_dir: Path, capsys: pytest.CaptureFixture) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_shards_dir, copy)
    assert verify_main([str(copy)]) == 0
    shard = copy / read_manifest(copy).shards[1].name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify_main([str(copy)]) == 1
    assert f"{shard}: sha256 mismatch" in capsys.readouterr().err


def test_verify_catches_out_of_range_ids_even_with_matching_hash(tmp_path: Path, tiny_shards_dir: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_shards_dir, copy)
    manifest = read_manifest(copy)
    manifest.vocab_size = 10  # the shards now hold ids the manifest says cannot exist
    (copy / "manifest.json").write_text(manifest.to_json())
    problems = verify_directory(copy)
    assert any(">= vocab_size 10" in p for p in problems)


def _shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard_*.arrow"))}


def test_kill_and_rerun_gives_byte_identical_shards(
    tmp_path: Path, tiny_corpus_file: Path, tiny_tokenizer_dir: Path, tiny_shards_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "data_prep.build_shards", "--input", str(tiny_corpus_file), "--tokenizer", str(tiny_tokenizer_dir),
           "--seq-len", str(TINY_SEQ_LEN), "--shard-size-mb", str(TINY_SHARD_MB), "--out", str(out), "--num-proc", "1", "--no-progress"]
    env = {**os.environ, SLEEP_AFTER_SHARD_ENV: "0.5"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # generous for a busy machine: the wait ends once 3 shards are recorded
        while True:
            state = out / STATE_FILE
            if state.is_file() and len(json.loads(state.read_text())["shards"]) >= 3:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "3 shards not recorded in 600 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "manifest.json").exists()
    recorded = json.loads((out / STATE_FILE).read_text())["shards"]
    # Make the wreck worse: a partial temp file, an unrecorded (possibly partial) shard, and a
    # recorded shard corrupted after the fact. None of them may be trusted.
    (out / "shard_00099.arrow.tmp").write_bytes(b"partial")
    (out / f"shard_{len(recorded):05d}.arrow").write_bytes(b"ARROW1 truncated")
    corrupted = out / recorded[1]["name"]
    corrupted.write_bytes(corrupted.read_bytes()[:-7] + b"garbage")

    manifest = _build([tiny_corpus_file], tiny_tokenizer_dir, out, num_proc=2)
    assert "resuming after 1 verified shard(s)" in capsys.readouterr().err  # shard 0 kept, 1 redone
    assert _shard_bytes(out) == _shard_bytes(tiny_shards_dir)
    assert [s.sha256 for s in manifest.shards] == [s.sha256 for s in read_manifest(tiny_shards_dir).shards]
    assert not (out / STATE_FILE).exists() and not list(out.glob("*.tmp"))
    assert verify_directory(out) == []
    # A third run with the same arguments finds the build complete and changes nothing.
    before = sha256_file(out / "manifest.json")
    _build([tiny_corpus_file], tiny_tokenizer_dir, out)
    assert sha256_file(out / "manifest.json") == before


def test_different_arguments_into_same_directory_are_refused(tmp_path: Path, tiny_corpus_file: Path, tiny_tokenizer_dir: Path, tiny_shards_dir: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "shards"
    shutil.copytree(tiny_shards_dir, out)
    with pytest.raises(BuildRefused, match=r"different arguments \(rows_per_shard: 106 -> 209; seq_len: 64 -> 32\); refusing.*Use a new --out"):
        _build([tiny_corpus_file], tiny_tokenizer_dir, out, seq_len=32)
    code = build_main(["--input", str(tiny_corpus_file), "--tokenizer", str(tiny_tokenizer_dir), "--out", str(out),
                       "--seq-len", "64", "--packing", "doc", "--no-progress"])
    assert code == 2 and "packing: 'full' -> 'doc'" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(BuildRefused, match="not empty"):
        _build([tiny_corpus_file], tiny_tokenizer_dir, other)
    assert verify_directory(out) == []  # nothing was touched


def test_all_input_formats_give_the_same_shards(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    import datasets

    docs = _docs()
    records = [{"id": i, "text": d} for i, d in enumerate(docs)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps({"body": r["text"]}) + "\n" for r in records)
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    oneline = tmp_path / "lines.txt"
    oneline.write_text("".join(d.replace("\n", " ") + "\n" for d in docs))

    _build([write_corpus(tmp_path / "a.txt", docs)], tiny_tokenizer_dir, tmp_path / "txt")
    reference = ShardDataset(tmp_path / "txt").take(np.arange(len(ShardDataset(tmp_path / "txt"))))[0]
    for name, inputs, kwargs in [
        ("jsonl", [tmp_path / "a.jsonl"], {}),
        ("jsonl_gz", [tmp_path / "a.jsonl.gz"], {"read_options": ReadOptions(text_field="body")}),
        ("parquet", [tmp_path / "a.parquet"], {}),
        ("datasets", [tmp_path / "hf"], {}),
    ]:
        _build(inputs, tiny_tokenizer_dir, tmp_path / name, **kwargs)
        ds = ShardDataset(tmp_path / name)
        np.testing.assert_array_equal(ds.take(np.arange(len(ds)))[0], reference, err_msg=name)
    manifest = _build([oneline], tiny_tokenizer_dir, tmp_path / "lines", read_options=ReadOptions(doc_per_line=True))
    assert manifest.stats["documents"] == len(docs)
    # A directory input expands to the supported files inside it, sorted by path.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "a.jsonl", mixed / "b.jsonl")
    shutil.copy(tmp_path / "a.parquet", mixed / "a.parquet")
    manifest = _build([mixed], tiny_tokenizer_dir, tmp_path / "mixed_out")
    assert [Path(s["path"]).name for s in manifest.sources] == ["a.parquet", "b.jsonl"]
    assert manifest.stats["documents"] == 2 * len(docs)


def test_undecodable_bytes_are_replaced_and_counted_and_empty_inputs_skipped(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 ol\xff\xfe return the list\n\n   \n\nsecond document here\n")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    blank_lines = tmp_path / "lines.jsonl"
    blank_lines.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "  "}) + "\n" + json.dumps({"text": "a real one"}) + "\n")
    manifest = _build([bad, empty, blank_lines], tiny_tokenizer_dir, tmp_path / "out")
    assert manifest.stats["replaced_chars"] == 3
    assert manifest.stats["documents"] == 3
    assert manifest.stats["skipped_empty"] == 2
    assert manifest.stats["empty_inputs"] == 1
    assert [s["documents"] for s in manifest.sources] == [2, 0, 1]
    replaced_text = "caf\ufffd ol\ufffd\ufffd return the list"
    assert next(iter_documents(Source(bad, "txt"), ReadOptions())) == (replaced_text, 3)
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    first = _content_rows(tmp_path / "out")[0]
    expected = tok(replaced_text, add_special_tokens=False)["input_ids"]
    assert first[: len(expected)].tolist() == expected and first[len(expected)] == manifest.special_tokens["sep"]


@pytest.mark.parametrize(
    "content, pattern",
    [
        ('{"text": "fine"}\n{"text": "broken\n', r"bad\.jsonl:2: malformed JSON line"),
        ('{"text": "fine"}\n{"body": "no text field"}\n', r"bad\.jsonl:2: no field 'text' \(--text-field\)"),
        ('{"text": 7}\n', r"bad\.jsonl:1: field 'text' is int"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, tiny_tokenizer_dir: Path, content: str, pattern: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=pattern):
        _build([path], tiny_tokenizer_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_inputs_fail_before_any_work(tmp_path: Path, tiny_tokenizer_dir: Path, capsys: pytest.CaptureFixture) -> None:
    no_text = tmp_path / "no_text"
    no_text.mkdir()
    (no_text / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(InputError, match=r"no_text: directory holds no input files"):
        _build([no_text], tiny_tokenizer_dir, tmp_path / "o1")
    with pytest.raises(InputError, match=r"image\.png: unsupported input type"):
        _build([no_text / "image.png"], tiny_tokenizer_dir, tmp_path / "o2")
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(InputError, match=r"p\.parquet: no column 'text' \(--text-field\)"):
        _build([tmp_path / "p.parquet"], tiny_tokenizer_dir, tmp_path / "o3")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(InputError, match=r"broken\.jsonl\.gz: unreadable"):
        _build([tmp_path / "broken.jsonl.gz"], tiny_tokenizer_dir, tmp_path / "o4")
    only_empty = tmp_path / "empty.txt"
    only_empty.write_text("")
    with pytest.raises(InputError, match=r"empty\.txt: no non-empty documents"):
        _build([only_empty], tiny_tokenizer_dir, tmp_path / "o5")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o5" / "manifest.json").exists()
    assert build_main(["--input", str(no_text), "--tokenizer", str(tiny_tokenizer_dir), "--out", str(tmp_path / "o6")]) == 2
    assert "no_text: directory holds no input files" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["data_prep.train_tokenizer", "data_prep.build_shards", "data_prep.verify"])
def test_help_texts(module: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: python -m " + module in result.stdout
    if module == "data_prep.build_shards":
        for flag in ("--input", "--tokenizer", "--seq-len", "--out", "--num-proc", "--packing", "--text-field", "--doc-per-line"):
            assert flag in result.stdout


def test_bpe_tokenizer_shards_store_pre_tokenizer_word_starts(tmp_path: Path, tiny_corpus_file: Path) -> None:
    from data_prep.train_tokenizer import train_tokenizer

    tok_dir = train_tokenizer([tiny_corpus_file], tmp_path / "bpe", kind="bpe", vocab_size=400, progress=False)
    docs = _docs()[:2]
    manifest = _build([write_corpus(tmp_path / "d.txt", docs)], tok_dir, tmp_path / "out", packing="doc", seq_len=16384)
    assert manifest.special_tokens["cls"] == 0 and manifest.special_tokens["pad"] == 1
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for doc, ids, starts in zip(docs, _content_rows(tmp_path / "out"), _word_starts_rows(tmp_path / "out")):
        encoded = tok(doc, add_special_tokens=False)
        assert ids.tolist() == encoded["input_ids"]
        assert starts.tolist() == _expected_word_starts(encoded.word_ids())


def _worker_sigterm_is_default(_: int) -> bool:
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_pool_workers_do_not_inherit_a_parents_sigterm_handler(tiny_tokenizer_dir):
    """A parent whose SIGTERM handler only takes note (a training process's preemption handler, a
    benchmark driver's clean stop) must not make the shard builder's workers immune to the pool's
    terminate(): a worker busy in native code would never run the Python handler and join() would
    wait forever (a hung CI run). The workers start with SIGTERM's default action."""
    from data_prep.build_shards import _init_worker, worker_pool
    from data_prep.tokenizer_io import load_tokenizer

    noted: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: noted.append(signum))
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        backend = load_tokenizer(tiny_tokenizer_dir).backend_json
        with worker_pool(2, backend) as pool:  # the builder's own pool
            assert pool.map(_worker_sigterm_is_default, range(4)) == [True] * 4
        # (No forked pool here: forking this test process, whose earlier tests may have left threads
        # running, is the very deadlock of issue 42.) The initializer resets the handler under any
        # start method:
        _init_worker(backend)
        assert _worker_sigterm_is_default(0) and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _worker_parent(_: int) -> int:
    return os.getppid()


#: A parent that has started threads before it builds shards with 2 workers (run in a subprocess, so
#: a deadlocked worker fails the test by its timeout instead of hanging the suite): one thread
#: tokenizes in a loop (the Rust tokenizer's own thread pool), one logs, one writes to stderr, so
#: locks are held at any instant; the workers must still start and the build must finish.
THREADED_PARENT = """
import logging, os, sys, threading
sys.setswitchinterval(1e-4)  # why: see the test's docstring
from data_prep.build_shards import build_shards, worker_pool
from tests.data.test_build_shards import _worker_parent
from data_prep.tokenizer_io import load_tokenizer
from data_prep.encode import DocumentEncoder
corpus, tokenizer, out, seq_len, shard_mb = sys.argv[1:6]
stop = threading.Event()
encoder = DocumentEncoder(load_tokenizer(tokenizer).backend_json)
text = open(corpus).read()[:4000]
def tokenize():
    while not stop.is_set():
        encoder.encode([text] * 8)
def log():
    while not stop.is_set():
        logging.getLogger("busy").warning("busy")
def write():
    while not stop.is_set():
        sys.stderr.write(".")
threads = [threading.Thread(target=f, daemon=True) for f in (tokenize, log, write)]
for t in threads:
    t.start()
build_shards([corpus], tokenizer, out, seq_len=int(seq_len), shard_size_mb=float(shard_mb), num_proc=2, progress=False)
with worker_pool(2, load_tokenizer(tokenizer).backend_json) as pool:
    parents = set(pool.map(_worker_parent, range(4)))
stop.set()
print("parents", os.getpid() in parents, flush=True)
"""


def test_shards_build_in_a_parent_that_started_threads_first(tiny_corpus_file, tiny_tokenizer_dir, tiny_shards_dir,
                                                             tmp_path):
    """Issue 42: a forked worker of a threaded parent could inherit a held lock and hang in futex_wait
    (then Pool.terminate -> join hung). The workers are started by a forkserver, not forked from the
    parent (their parent process is not the builder), and the build of a threaded parent finishes with
    the same shards as an unthreaded one.

    The parent's GIL switch interval is 0.1 ms instead of 5 ms: with three threads spinning in Python,
    each of the builder's (and its pool's handler threads') thousands of GIL hand-offs otherwise waits
    about 15 ms, so the build took 578 s on two idle cores (11 s with this line) and timed out in CI. The
    threads still spin and hold their locks at any instant; only the interpreter's scheduling is faster."""
    out = tmp_path / "shards"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", THREADED_PARENT, str(tiny_corpus_file), str(tiny_tokenizer_dir),
                           str(out), str(TINY_SEQ_LEN), str(TINY_SHARD_MB)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "parents False"  # no worker is a child of the builder: none was forked from it
    assert _shard_bytes(out) == _shard_bytes(tiny_shards_dir)
