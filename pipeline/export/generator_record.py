"""A converted directory's `generator/` is its own: the fingerprint `cpt-convert --with-generator` records,
and the check every reader of the generator runs.

The generator of a COCO-LM or ELECTRA export is a second model beside the main one (`convert_report.GENERATOR_SUBDIR`).
For an ELECTRA export it is the only masked LM there is (`ElectraForPreTraining` has none), so `cpt-study`
reads every masked-LM number through it (`pipeline.study.evaluate.masked_lm_dir`). Nothing in `generator/`
names the run it came from: another run's generator of the same shape (the same preset, another seed or
step) copied over it loads and gives numbers, which would be reported as this run's. So the conversion
records `generator_fingerprint` (sha256 over the names and contents of the generator's files, its model
card aside) in the export's `pipeline_meta.json` (`conversion.generator_fingerprint`), and a reader refuses
a `generator/` that no longer matches it, or that is gone, in one line naming the directory.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.export.convert_report import CONVERSION_KEY, GENERATOR_SUBDIR
from pipeline.io import sha256_file
from pipeline.train.run_meta import META_FILE

#: `conversion.generator_fingerprint` in the export's pipeline_meta.json.
GENERATOR_FINGERPRINT_KEY = "generator_fingerprint"
#: Files of the generator directory that do not change what it computes or how it tokenizes.
NOT_FINGERPRINTED = ("README.md",)


def generator_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 over the sorted relative paths and sha256 of every file below `directory` (the model card
    aside): weights, config and tokenizer alike. A symbolic link is followed (its target's bytes count)."""
    root = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in NOT_FINGERPRINTED):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + sha256_file(path).encode() + b"\0")
    return digest.hexdigest()


def generator_problem(model_dir: str | os.PathLike) -> str:
    """'' when `model_dir`'s `generator/` is the one it was converted with, or the export records none
    (converted without `--with-generator`, or before fingerprints); else one line naming the directory:
    its `generator/` is gone, or its files are not the recorded ones (both fingerprints)."""
    meta = Path(model_dir) / META_FILE
    generator = Path(model_dir) / GENERATOR_SUBDIR
    try:
        record = json.loads(meta.read_text()) if meta.is_file() else {}
        recorded = (record.get(CONVERSION_KEY) or {}).get(GENERATOR_FINGERPRINT_KEY)
    except (OSError, ValueError, AttributeError):
        return f"{model_dir}: {META_FILE} is not readable JSON; convert the checkpoint again"
    if not recorded:
        return ""
    if not generator.is_dir():
        return (f"{generator}: missing, but {META_FILE} records a generator converted with this model; restore it or "
                "convert the checkpoint again with --with-generator")
    current = generator_fingerprint(generator)
    if current == recorded:
        return ""
    return (f"{generator}: its files are not the generator this model was converted with (fingerprint {current[:16]} "
            f"now, {CONVERSION_KEY}.{GENERATOR_FINGERPRINT_KEY} {str(recorded)[:16]} in {META_FILE}); restore it "
            "or convert the checkpoint again with --with-generator")
