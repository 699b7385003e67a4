"""Can this tokenizer directory represent the text? The one home of the checks every tool runs on a
tokenizer it is given (`data_prep.build_shards --tokenizer`, `pipeline.eval.finetune --model`,
`cpt-convert --tokenizer`, `model.init_from`).

A directory without tokenizer files still loads: `AutoTokenizer.from_pretrained` on a converted
model directory that lost its tokenizer builds a placeholder from `config.json` alone (BERT: a
5-entry vocabulary of the special tokens), every word becomes `[UNK]`, and a tool that trusted it
would pack shards of `[UNK]` or report a fine-tuning accuracy on them with exit 0. So:

* `tokenizer_files(dir)`: the files a tokenizer is made of (`TOKENIZER_FILES`); none means no tokenizer;
* `coverage_problem(...)`: the vocabulary is below `MIN_VOCAB` entries, or more than `MAX_UNK_SHARE`
  of the tokens of the first documents are the unknown token (measured on at most
  `SAMPLE_DOCUMENTS` documents). A tokenizer trained on English text maps well under 1% of English
  to `[UNK]`; the placeholder maps about 96%.

Whether two tokenizers are the same one (vocabulary, special-token ids, normaliser, pre-tokeniser,
post-processor) is `pipeline.model.warm_start.tokenizer_difference`, used by training and conversion alike.

A converted directory's tokenizer is its own: `cpt-convert` records `tokenizer_fingerprint(dir)` (sha256
over the names and contents of its tokenizer files, as training records the shards' `tokenizer_hash`)
in the export's `pipeline_meta.json` (`conversion.tokenizer_fingerprint`), and every tool that reads a
converted directory (`cpt-finetune`, `cpt-sts`, the demo's outcome) refuses one whose tokenizer files
were swapped since (`converted_tokenizer_problem`): a model of 800 embeddings fed a 600-entry
tokenizer's ids would fine-tune and report a number on ids it never learnt.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

#: Files that hold a tokenizer's vocabulary (fast tokenizer, WordPiece, BPE, SentencePiece models).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")
#: Files beside them that change how text is split or numbered (special tokens, casing, added tokens).
TOKENIZER_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")
#: Where a converted directory's pipeline_meta.json holds the fingerprint taken at conversion:
#: `conversion.tokenizer_fingerprint` (`pipeline.export.convert_report.CONVERSION_KEY`).
CONVERSION_RECORD, FINGERPRINT_KEY = "conversion", "tokenizer_fingerprint"
#: A vocabulary below this cannot represent text (the special tokens and an alphabet need more).
MIN_VOCAB = 64
#: More of the first documents' tokens than this unknown: the tokenizer does not fit the text.
MAX_UNK_SHARE = 0.25
#: Documents (or examples) the unknown-token share is measured on.
SAMPLE_DOCUMENTS = 64


def tokenizer_files(directory: str | os.PathLike) -> list[str]:
    """The `TOKENIZER_FILES` present in `directory`."""
    return [name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()]


def no_tokenizer_message(directory: str | os.PathLike) -> str:
    """'' when `directory` holds tokenizer files, else why it has no tokenizer (for an error line)."""
    if tokenizer_files(directory):
        return ""
    return (f"{directory} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); a model directory "
            "without them loads only a placeholder of its special tokens")


def unknown_share(token_ids: Iterable[Sequence[int]], unk_id: Optional[int]) -> tuple[float, int]:
    """(share of the tokens that are `unk_id`, number of tokens) over the given token-id sequences."""
    total = unknown = 0
    for ids in token_ids:
        total += len(ids)
        if unk_id is not None:
            unknown += sum(1 for i in ids if int(i) == unk_id)
    return (unknown / total if total else 0.0), total


def coverage_problem(directory: str | os.PathLike, vocab_size: int, share: float, tokens: int, sample: str) -> str:
    """'' when a tokenizer of `vocab_size` entries that maps `share` of `tokens` tokens of `sample`
    (e.g. "the first 64 documents") to the unknown token can represent the text; else the reason,
    naming the directory, the share and, when that is the cause, the missing tokenizer files."""
    if vocab_size >= MIN_VOCAB and share <= MAX_UNK_SHARE:
        return ""
    missing = no_tokenizer_message(directory)
    cause = f"; {missing}" if missing else ""
    return (f"{directory}: this tokenizer cannot represent the text: {share:.1%} of the {tokens} tokens of {sample} "
            f"are the unknown token and its vocabulary has {vocab_size} entries (limits: at most {MAX_UNK_SHARE:.0%} "
            f"unknown, at least {MIN_VOCAB} entries){cause}")


def tokenizer_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 over the sorted names and sha256 of the tokenizer files (`TOKENIZER_FILES`,
    `TOKENIZER_CONFIG_FILES`) present in `directory`; other files (weights, config.json) do not count."""
    root = Path(directory)
    digest = hashlib.sha256()
    for name in sorted(n for n in TOKENIZER_FILES + TOKENIZER_CONFIG_FILES if (root / n).is_file()):
        digest.update(name.encode() + b"\0" + hashlib.sha256((root / name).read_bytes()).hexdigest().encode() + b"\0")
    return digest.hexdigest()


def converted_tokenizer_problem(directory: str | os.PathLike, flag: str) -> str:
    """'' when `directory` (given with `flag`, e.g. "--model") still holds the tokenizer it was converted
    with, or records none (not a converted directory, or converted before fingerprints), or has no
    tokenizer files at all (`no_tokenizer_message`'s case, said better there); else one line naming the
    directory and both fingerprints."""
    meta = Path(directory) / "pipeline_meta.json"
    if not tokenizer_files(directory):
        return ""
    try:
        recorded = (json.loads(meta.read_text()).get(CONVERSION_RECORD) or {}).get(FINGERPRINT_KEY) \
            if meta.is_file() else None
    except (OSError, ValueError, AttributeError):
        return f"{flag} {directory}: {meta.name} is not readable JSON; convert the checkpoint again"
    if not recorded:
        return ""
    current = tokenizer_fingerprint(directory)
    if current == recorded:
        return ""
    return (f"{flag} {directory}: its tokenizer files are not the ones it was converted with (fingerprint "
            f"{current[:16]} now, {CONVERSION_RECORD}.{FINGERPRINT_KEY} {str(recorded)[:16]} in {meta.name}); "
            "restore them or convert the checkpoint again")
