"""What `build_shards` leaves in `--out` and how a failed write is reported: the resume state's file
name, the shards it vouches for, and the clean-up after a write fails (disk full, quota, read-only),
so a re-run resumes to the same content hash. Split from `build_shards` to keep that file readable."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from pipeline.data.shards import TOKENIZER_SUBDIR

STATE_FILE = "build_state.json"
#: Exit code when --out cannot be written (training's `EXIT_SAVE_FAILED`, `cpt-convert`'s `EXIT_WRITE_FAILED`).
EXIT_WRITE_FAILED = 4
#: errno values that mean "the output cannot take this write" whatever the file (pyarrow's write errors
#: carry the errno but no file name).
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def _remove_unrecorded(out: Path, keep: set[str]) -> None:
    """Delete temporary files and shards the state does not vouch for (possibly partial)."""
    for path in out.iterdir():
        if path.is_file() and (path.name.endswith(".tmp") or (path.name.startswith("shard_") and path.name not in keep)):
            path.unlink()


def _recorded_shards(out: Path) -> list[str]:
    """Names of the shards `build_state.json` records (those a re-run keeps); [] when it is unreadable."""
    try:
        return [entry["name"] for entry in json.loads((out / STATE_FILE).read_text())["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def remove_leftovers(out: Path) -> None:
    """After a failed write: delete what it left (`*.tmp` files, the tokenizer's staging copy, shards
    not recorded), keeping the recorded shards and the state a re-run resumes from."""
    if not out.is_dir():
        return
    _remove_unrecorded(out, set(_recorded_shards(out)))
    shutil.rmtree(out / (TOKENIZER_SUBDIR + ".tmp"), ignore_errors=True)


def is_write_failure(err: OSError, out: Path) -> bool:
    """Whether `err` is a write of the output failing (a `WRITE_ERRNOS` code, or any error on a path
    under `out`), rather than an input that cannot be read."""
    if err.errno in WRITE_ERRNOS:
        return True
    try:
        return err.filename is not None and Path(err.filename).resolve().is_relative_to(out.resolve())
    except (OSError, ValueError, TypeError):
        return False


def write_failed_message(out: Path, err: OSError) -> str:
    """One line: why --out could not be written, what is kept, how to go on."""
    reason = os.strerror(err.errno).lower() if err.errno else str(err)
    where = f": {err.filename}" if err.filename else ""
    shards = len(_recorded_shards(out))
    kept = (f"the {shards} shard(s) recorded in {out / STATE_FILE} are kept" if shards else "no shard was complete yet")
    return (f"--out {out}: cannot write the shards ({reason}{where}); {kept} and the temporary files are removed; "
            "free space (or make it writable) and re-run the same command to resume")
