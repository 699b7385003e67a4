"""`data_prep.build_shards` on a tokenizer directory without a tokenizer and on a full disk (issue 49):
one line each, the right exit code, nothing half-written left behind, and the full-disk build resumes
to the same shards once there is space.

* an empty `--tokenizer` directory: exit 2 with one line naming the directory and the files it lacks
  (transformers' own message is several lines about installing sentencepiece or tiktoken);
* ENOSPC from the shard writer (injected as pyarrow raises it: errno 28, no file name, a partial
  `.tmp` left) and a real full tmpfs (root only): exit 4 with one line, no `*.tmp` file, the
  tokenizer's staging copy and unrecorded shards removed; the same command then completes with the
  shards of an uninterrupted build.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

import data_prep.build_shards as build_module
from data_prep.build_shards import EXIT_WRITE_FAILED, STATE_FILE
from data_prep.build_shards import main as build_main
from pipeline.data.shards import TOKENIZER_SUBDIR, read_manifest
from tests.fixtures_data import TINY_SEQ_LEN, TINY_SHARD_MB
from tests.train.test_disk_full import small_tmpfs  # noqa: F401 - fixture: a size-limited tmpfs (root only)


def _args(corpus: Path, tokenizer: Path, out: Path) -> list[str]:
    return ["--input", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out), "--seq-len", str(TINY_SEQ_LEN),
            "--shard-size-mb", str(TINY_SHARD_MB), "--num-proc", "1", "--no-progress"]


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*") if p.name.endswith(".tmp"))


def _shard_hashes(out: Path) -> list[str]:
    return [s.sha256 for s in read_manifest(out).shards]


def test_an_empty_tokenizer_directory_is_one_line(tiny_corpus_file, tmp_path, capsys):
    empty = tmp_path / "tok"
    empty.mkdir()
    out = tmp_path / "shards"
    assert build_main(_args(tiny_corpus_file, empty, out)) == 2
    assert _stderr_lines(capsys) == [
        f"error: --tokenizer {empty}: no tokenizer files in this directory (none of tokenizer.json, vocab.txt, "
        "vocab.json, spiece.model, sentencepiece.bpe.model, tokenizer.model); pass the directory "
        "data_prep.train_tokenizer wrote, or a model directory with its tokenizer; nothing was written"]
    assert not out.exists()


def test_enospc_from_the_shard_writer_is_one_line_and_resumes(tiny_corpus_file, tiny_tokenizer_dir,
                                                              tiny_shards_dir, tmp_path, capsys, monkeypatch):
    real_write, calls = build_module.write_shard, []

    def full_at_the_third(path, *arrays):
        calls.append(path)
        if len(calls) == 3:  # as pyarrow fails: a partial temporary file, errno 28, no file name
            Path(str(path) + ".tmp").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        return real_write(path, *arrays)

    monkeypatch.setattr(build_module, "write_shard", full_at_the_third)
    out = tmp_path / "shards"
    assert build_main(_args(tiny_corpus_file, tiny_tokenizer_dir, out)) == EXIT_WRITE_FAILED == 4
    assert _stderr_lines(capsys) == [
        f"error: --out {out}: cannot write the shards (no space left on device); the 2 shard(s) recorded in "
        f"{out / STATE_FILE} are kept and the temporary files are removed; free space (or make it writable) and "
        "re-run the same command to resume"]
    assert _leftovers(out) == [] and sorted(p.name for p in out.glob("shard_*")) == ["shard_00000.arrow",
                                                                                   "shard_00001.arrow"]
    monkeypatch.setattr(build_module, "write_shard", real_write)
    assert build_main(_args(tiny_corpus_file, tiny_tokenizer_dir, out)) == 0
    assert _shard_hashes(out) == _shard_hashes(tiny_shards_dir)
    assert read_manifest(out).fingerprint == read_manifest(tiny_shards_dir).fingerprint


def test_a_read_error_of_an_input_is_not_called_a_full_disk(tiny_corpus_file, tiny_tokenizer_dir, tmp_path,
                                                            monkeypatch):
    def unreadable(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(tiny_corpus_file))
        yield  # a generator, as the real reader

    monkeypatch.setattr(build_module, "iter_documents", unreadable)
    monkeypatch.setattr(build_module, "check_coverage", lambda *args: None)
    with pytest.raises(OSError, match="Input/output error"):  # not exit 4: the output is not the problem
        build_main(_args(tiny_corpus_file, tiny_tokenizer_dir, tmp_path / "shards"))


def test_a_real_full_file_system(small_tmpfs, tiny_corpus_file, tiny_tokenizer_dir, tiny_shards_dir,  # noqa: F811
                                 capsys):
    tokenizer = sum(p.stat().st_size for p in (tiny_shards_dir / TOKENIZER_SUBDIR).rglob("*") if p.is_file())
    shard = max(s.bytes for s in read_manifest(tiny_shards_dir).shards)
    assert len(read_manifest(tiny_shards_dir).shards) >= 4
    size = (tokenizer + 2 * shard + 64 * 1024) // 4096 * 4096  # room for the tokenizer and about two shards
    out = small_tmpfs(size) / "shards"
    assert build_main(_args(tiny_corpus_file, tiny_tokenizer_dir, out)) == EXIT_WRITE_FAILED
    (line,) = _stderr_lines(capsys)
    assert re.fullmatch(rf"error: --out {re.escape(str(out))}: cannot write the shards \(no space left on device"
                        r"(: \S+)?\); .* re-run the same command to resume", line), line
    assert _leftovers(out) == [] and not (out / (TOKENIZER_SUBDIR + ".tmp")).exists()
    small_tmpfs.remount(16 << 20)  # space freed: the same command completes the same shards
    assert build_main(_args(tiny_corpus_file, tiny_tokenizer_dir, out)) == 0
    assert _shard_hashes(out) == _shard_hashes(tiny_shards_dir)
