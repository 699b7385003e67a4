"""Train a tokenizer on local text and save a directory `AutoTokenizer.from_pretrained` loads offline.

    python -m data_prep.train_tokenizer --input corpus/ --out tok/                 # BERT uncased WordPiece, 30,522
    python -m data_prep.train_tokenizer --input a.jsonl --out tok/ --kind bpe      # byte-level BPE (RoBERTa style)

WordPiece follows BERT (lower-casing + accent stripping normaliser, whitespace/punctuation
pre-tokenizer, `##` continuations, `[PAD] [UNK] [CLS] [SEP] [MASK]` = ids 0..4); byte-level BPE
follows RoBERTa (`<s> <pad> </s> <unk> <mask>` = ids 0..4, no unknown bytes). The inputs are read
with the same readers as `build_shards`, so every input format works here too.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tqdm import tqdm

from data_prep.readers import InputError, ReadOptions, Source, iter_documents, resolve_inputs
from pipeline.io import write_atomic

WORDPIECE_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
BPE_SPECIALS = {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"}


def _wordpiece(vocab_size: int, lowercase: bool, min_frequency: int) -> tuple[Tokenizer, trainers.Trainer]:
    tokenizer = Tokenizer(models.WordPiece(unk_token=WORDPIECE_SPECIALS["unk"]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase or None)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(WORDPIECE_SPECIALS.values()),
        show_progress=False,
    )
    return tokenizer, trainer


def _bpe(vocab_size: int, min_frequency: int) -> tuple[Tokenizer, trainers.Trainer]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(BPE_SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tokenizer, trainer


def _documents(sources: list[Source], options: ReadOptions, max_documents: int | None, bar: tqdm, seen: list[int]) -> Iterator[str]:
    """Non-empty documents of all sources; counts them in `seen[0]` (tqdm stops counting when disabled)."""
    for source in sources:
        for doc in iter_documents(source, options):
            if not doc.text.strip():
                continue
            bar.update(1)
            seen[0] += 1
            yield doc.text
            if max_documents is not None and seen[0] >= max_documents:
                return


def train_tokenizer(
    inputs: Sequence[str],
    out: str | Path,
    kind: str = "wordpiece",
    vocab_size: int = 30522,
    lowercase: bool = True,
    min_frequency: int = 2,
    read_options: ReadOptions = ReadOptions(),
    max_documents: int | None = None,
    model_max_length: int = 512,
    progress: bool = True,
) -> Path:
    """Train and save; returns the output directory. Raises `InputError`/`ValueError` on bad input."""
    if kind not in ("wordpiece", "bpe"):
        raise ValueError(f"--kind {kind!r}: expected 'wordpiece' or 'bpe'")
    if vocab_size < 10:
        raise ValueError(f"--vocab-size {vocab_size}: too small (need room for 5 special tokens and an alphabet)")
    sources = resolve_inputs(list(inputs))
    tokenizer, trainer = _wordpiece(vocab_size, lowercase, min_frequency) if kind == "wordpiece" else _bpe(vocab_size, min_frequency)
    seen = [0]
    with tqdm(desc="reading documents", unit=" docs", disable=not progress, file=sys.stderr) as bar:
        tokenizer.train_from_iterator(_documents(sources, read_options, max_documents, bar, seen), trainer)
    if seen[0] == 0:
        raise InputError(f"--input {' '.join(map(str, inputs))}: no non-empty documents to train on")
    specials = WORDPIECE_SPECIALS if kind == "wordpiece" else BPE_SPECIALS
    ids = {name: tokenizer.token_to_id(token) for name, token in specials.items()}
    if kind == "wordpiece":
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", ids["cls"]), ("[SEP]", ids["sep"])],
        )
    else:
        tokenizer.post_processor = processors.RobertaProcessing(("</s>", ids["sep"]), ("<s>", ids["cls"]), trim_offsets=True, add_prefix_space=False)
    _save(tokenizer, Path(out), kind, specials, lowercase, model_max_length)
    return Path(out)


def _save(tokenizer: Tokenizer, out: Path, kind: str, specials: dict[str, str], lowercase: bool, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (each atomically)."""
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast

    token_kwargs = {f"{name}_token": token for name, token in specials.items()}
    if kind == "wordpiece":
        wrapped = BertTokenizerFast(tokenizer_object=tokenizer, do_lower_case=lowercase, model_max_length=model_max_length, **token_kwargs)
    else:
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length, **token_kwargs)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / ".staging"
    wrapped.save_pretrained(str(staging))
    for path in sorted(staging.iterdir()):
        write_atomic(out / path.name, path.read_bytes())
        path.unlink()
    staging.rmdir()
    if kind == "bpe":
        # transformers 5 writes its own class name ("TokenizersBackend"), which 4.x cannot resolve;
        # "PreTrainedTokenizerFast" loads the same tokenizer.json in both.
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        write_atomic(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    # Older transformers versions read the special tokens from this file rather than the config.
    write_atomic(out / "special_tokens_map.json", json.dumps(token_kwargs, indent=2, sort_keys=True) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.train_tokenizer",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="text inputs: .txt, .jsonl(.gz), .parquet, a datasets save_to_disk dir, or a directory of such files")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (AutoTokenizer-loadable)")
    parser.add_argument("--kind", choices=("wordpiece", "bpe"), default="wordpiece", help="BERT-style WordPiece or RoBERTa-style byte-level BPE")
    parser.add_argument("--vocab-size", type=int, default=30522, help="vocabulary size including special tokens")
    parser.add_argument("--cased", action="store_true", help="WordPiece: keep case and accents (default: uncased like bert-base-uncased)")
    parser.add_argument("--min-frequency", type=int, default=2, help="minimum pair/word frequency to enter the vocabulary")
    parser.add_argument("--doc-per-line", action="store_true", help=".txt: one document per line (default: documents separated by blank lines)")
    parser.add_argument("--text-field", default="text", help=".jsonl/.parquet/datasets: name of the text field")
    parser.add_argument("--split", default="train", help="datasets DatasetDict: split to read")
    parser.add_argument("--max-documents", type=int, default=None, help="train on the first N non-empty documents only")
    parser.add_argument("--model-max-length", type=int, default=512, help="model_max_length written into tokenizer_config.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = train_tokenizer(
            args.input,
            args.out,
            kind=args.kind,
            vocab_size=args.vocab_size,
            lowercase=not args.cased,
            min_frequency=args.min_frequency,
            read_options=ReadOptions(args.doc_per_line, args.text_field, args.split),
            max_documents=args.max_documents,
            model_max_length=args.model_max_length,
            progress=not args.no_progress,
        )
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    print(f"tokenizer ({args.kind}, {vocab} entries) saved to {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
