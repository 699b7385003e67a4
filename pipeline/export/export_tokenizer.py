"""The tokenizer a conversion writes: the run's own, checked before any weights are written against what
training recorded (the fingerprint of its files, `RunMeta.tokenizer_hash`; the special-token ids; the vocabulary
size) and, for a `--tokenizer DIR`, against the run's own tokenizer by content (`tokenizer_difference`); and the
`tokenizer_config.json` it writes, cleaned of how this process happened to load it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from pipeline.data.shards import SPECIAL_TOKEN_NAMES
from pipeline.model.arch import AnyEncoderConfig
from pipeline.model.warm_start import tokenizer_difference
from pipeline.tokenizer_checks import TOKENIZER_CONFIG_FILES, TOKENIZER_FILES, no_tokenizer_message
from pipeline.train.checkpoint.tags import CheckpointError
from pipeline.train.run_meta import RunMeta

#: Keys `save_pretrained` copies from the *loading* call into tokenizer_config.json; they describe
#: how the converter happened to load the tokenizer (and may hold local paths), not the tokenizer.
TOKENIZER_LOAD_KEYS = ("is_local", "local_files_only", "name_or_path", "cache_dir", "_commit_hash", "token",
                       "revision", "force_download", "trust_remote_code")


def _run_tokenizer_reference(meta: RunMeta, given: Path) -> Optional[Path]:
    """The run's own tokenizer (`tokenizer_dir` of the meta) to compare a `--tokenizer` with; None when
    it is gone (then only the special-token ids can be checked) or is `given` itself (a directory changed
    since training was refused before: `_recorded_fingerprint_problem`)."""
    recorded = Path(meta.tokenizer_dir or "")
    if not str(meta.tokenizer_dir or "") or not recorded.is_dir():
        return None
    return None if recorded.resolve() == given.resolve() else recorded


def _recorded_fingerprint_problem(meta: RunMeta, path: Path, given: bool) -> str | bool:
    """The tokenizer at `path` against the fingerprint training recorded (`RunMeta.tokenizer_hash`, the
    shards' `tokenizer_hash`: `hash_directory` of their tokenizer/): True when `path` holds those very
    files; else the refusal naming both fingerprints and paths when the run's own `tokenizer_dir` changed
    since training (shards rebuilt in place with another tokenizer), whether it is `path` or the reference
    a `--tokenizer DIR` (`given`) would be compared with; "" when there is nothing to compare (a
    checkpoint from before the record) or a `--tokenizer DIR` is left to the comparison by content."""
    from pipeline.io import hash_directory

    recorded = str(meta.tokenizer_hash or "")
    if not recorded:
        return ""
    run_dir = Path(meta.tokenizer_dir or "")
    own = not given or (run_dir.is_dir() and run_dir.resolve() == path.resolve())
    names = {p.name for p in path.rglob("*") if p.is_file()}
    if own or names <= set(TOKENIZER_FILES + TOKENIZER_CONFIG_FILES):  # (a given model directory: not hashed whole)
        current = hash_directory(path)
        if current == recorded:
            return True
        if own:
            return (f"tokenizer_dir={path} is not the tokenizer this checkpoint was trained with: fingerprint "
                    f"{current[:16]} now, {recorded[:16]} recorded at training (pipeline_meta.json tokenizer_hash, of "
                    f"{meta.tokenizer_dir}): the shards' tokenizer was rebuilt or replaced since; pass the run's "
                    "tokenizer with --tokenizer DIR")
    if run_dir.is_dir() and (now := hash_directory(run_dir)) != recorded:
        return (f"--tokenizer {path} cannot be confirmed as the run's tokenizer: the checkpoint recorded {recorded[:16]} "
                f"at training, and the run's tokenizer_dir={run_dir} has changed since ({now[:16]}), so there is "
                "nothing to compare it with; pass the tokenizer files the run trained with")
    return ""


def load_tokenizer(meta: RunMeta, tokenizer_dir: Optional[str | os.PathLike], encoder: AnyEncoderConfig):
    """The run's tokenizer, checked against the special-token ids the model was trained with; a
    `--tokenizer DIR` also against the run's own tokenizer, as training checks `model.init_from`'s."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir or meta.tokenizer_dir or "")
    if not str(path) or not path.is_dir():
        raise CheckpointError(
            f"pipeline_meta.json field tokenizer_dir={meta.tokenizer_dir!r} is not a directory; pass --tokenizer DIR"
        )
    flag = "--tokenizer " if tokenizer_dir else "pipeline_meta.json tokenizer_dir="
    missing = no_tokenizer_message(path)
    if missing:
        raise CheckpointError(f"{flag}{missing}; pass the run's tokenizer (the shards' tokenizer/ directory)")
    same_files = _recorded_fingerprint_problem(meta, path, bool(tokenizer_dir))
    if isinstance(same_files, str) and same_files:
        raise CheckpointError(same_files)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise CheckpointError(f"{path}: not loadable with AutoTokenizer: {err}") from err
    reference = _run_tokenizer_reference(meta, path) if tokenizer_dir and same_files is not True else None
    if reference is not None:
        try:
            difference = tokenizer_difference(tokenizer, AutoTokenizer.from_pretrained(str(reference),
                                                                                       local_files_only=True))
        except Exception as err:  # transformers raises many types for an unusable directory
            raise CheckpointError(f"tokenizer_dir={reference} (the run's tokenizer, to compare --tokenizer {path} "
                                  f"with): not loadable with AutoTokenizer: {err}") from err
        if difference:
            raise CheckpointError(f"--tokenizer {path} is not the tokenizer the run trained with (tokenizer_dir="
                                  f"{reference}: {difference}); pass that one, or omit --tokenizer")
    elif tokenizer_dir and same_files is not True:
        print(f"note: the run's tokenizer (tokenizer_dir={meta.tokenizer_dir}) is not there to compare --tokenizer "
              f"{path} with; only its special-token ids are checked", file=sys.stderr)
    for name in SPECIAL_TOKEN_NAMES:
        if name not in meta.special_tokens:
            continue
        wanted = int(meta.special_tokens[name])
        current = getattr(tokenizer, f"{name}_token_id", None)
        if current is None:  # the tokenizer does not declare it: declare it from the meta's id
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(wanted))
        elif current != wanted:
            raise CheckpointError(
                f"{path}: {name} token id {current} differs from special_tokens.{name}={wanted} in pipeline_meta.json"
            )
    if len(tokenizer) > encoder.vocab_size:
        raise CheckpointError(f"{path}: {len(tokenizer)} tokens but the model's vocab_size is {encoder.vocab_size}")
    tokenizer.model_max_length = encoder.max_position
    return tokenizer


def clean_tokenizer_config(directory: Path) -> None:
    """Drop `TOKENIZER_LOAD_KEYS` from `directory/tokenizer_config.json`."""
    path = directory / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in config.items() if k not in TOKENIZER_LOAD_KEYS}, indent=2,
                                   ensure_ascii=False) + "\n")
