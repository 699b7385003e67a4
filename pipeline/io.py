"""Files written whole and files identified by their bytes: the file I/O every layer may use.

* `write_atomic`: write `<path>.tmp`, fsync it, rename it over `path` (`os.replace`, atomic on POSIX
  within a file system): a reader sees the old file or the new one, never half of one, and a crash
  leaves at most a stray `.tmp` beside the old file. The shard manifest, `latest`, `COMPLETE.json`,
  `best.json` and the configuration reference are written this way. `shared=True` is for a path that
  several processes may write at once (the study's parallel SLURM tasks each recording the same cached
  file, `pipeline.study`): each write has its own temporary, `.<name>.tmp-<host>-<pid>-<n>`, so no writer
  renames, or truncates, another's half-written one; the last rename wins and every version is whole.
* `sha256_file`, `xxh3_file`, `hash_directory`: a file's (or a directory tree's) identity by its
  contents. sha256 is what records and `cpt-verify` compare; xxh3-64 (`xxhash`) is the fast one
  training checks a shard with on first open (`pipeline.data.shards`, measured in docs/data.md).

A foundation module (standard library only, `xxhash` on first use): the shard format, checkpoints,
warm starts, conversion and the data tools all hash and write through it, so none of them reaches
into another's module for a file helper.
"""
from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import socket
from pathlib import Path

_HASH_CHUNK = 1 << 22
_WRITES = itertools.count()  # numbers this process's shared writes: two of them never share a temporary


def write_atomic(path: str | os.PathLike, data: bytes | str, *, shared: bool = False, parents: bool = False) -> None:
    """Write to `<path>.tmp`, fsync, then rename: a reader never sees a half-written file. `shared`: a
    temporary of this write's own (module docstring), for a path other processes may be writing too;
    `parents`: make the missing parent folders first."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    if shared:
        tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{next(_WRITES)}")
    else:
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
