"""Files written whole and files identified by their bytes: the file I/O every layer may use.

* `write_atomic`: write `<path>.tmp`, fsync it, rename it over `path` (`os.replace`, atomic on POSIX
  within a file system): a reader sees the old file or the new one, never half of one, and a crash
  leaves at most a stray `.tmp` beside the old file. The shard manifest, `latest`, `COMPLETE.json`,
  `best.json` and the configuration reference are written this way.
* `sha256_file`, `xxh3_file`, `hash_directory`: a file's (or a directory tree's) identity by its
  contents. sha256 is what records and `cpt-verify` compare; xxh3-64 (`xxhash`) is the fast one
  training checks a shard with on first open (`pipeline.data.shards`, measured in docs/data.md).

A foundation module (standard library only, `xxhash` on first use): the shard format, checkpoints,
warm starts, conversion and the data tools all hash and write through it, so none of them reaches
into another's module for a file helper.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

_HASH_CHUNK = 1 << 22


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write to `<path>.tmp`, fsync, then rename: a reader never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def xxh3_file(path: str | os.PathLike) -> str:
    """Hex xxh3-64 of a file's bytes, hashed through a read-only memory map (no copy)."""
    import xxhash

    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return xxhash.xxh3_64(b"").hexdigest()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_64(mapped).hexdigest()


def hash_directory(directory: str | os.PathLike) -> str:
    """sha256 over the relative names and contents of every file below `directory` (sorted)."""
    root = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(sha256_file(path).encode() + b"\0")
    return digest.hexdigest()
