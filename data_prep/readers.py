"""Input discovery and document readers for `.txt`, `.jsonl(.gz)`, `.parquet` and `datasets` dirs.

Every reader yields `RawDocument(text, replaced)` in a fixed order, including empty documents
(the builder skips and counts them), so "the first n documents" means the same thing on every run —
that is what lets an interrupted build resume by skipping exactly the documents already packed.
Undecodable bytes become U+FFFD and are counted; a malformed or unreadable file raises
`InputError` naming the file (and line), never a bare traceback from deep inside a parser.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = _REPLACEMENT.encode()


class InputError(ValueError):
    """An input path is missing, unreadable, of an unknown kind, or malformed; the message names it."""


class RawDocument(NamedTuple):
    text: str
    replaced: int  # characters that were undecodable bytes, now U+FFFD


@dataclass(frozen=True)
class Source:
    """One input: a file or a `datasets.save_to_disk` directory."""

    path: Path
    kind: str  # "txt" | "jsonl" | "parquet" | "datasets"


@dataclass(frozen=True)
class ReadOptions:
    doc_per_line: bool = False  # .txt: one document per line (else blank-line separated)
    text_field: str = "text"  # .jsonl / .parquet / datasets: the column holding the text
    split: str = "train"  # datasets DatasetDict: which split


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "txt"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def is_datasets_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _DATASETS_MARKERS)


def resolve_inputs(paths: list[str | os.PathLike]) -> list[Source]:
    """Expand the `--input` paths into sources, in a deterministic order, checking each one.

    A directory is either a `datasets` save_to_disk directory or searched recursively for files
    with a supported suffix (sorted by path). Raises `InputError` before any work is done.
    """
    if not paths:
        raise InputError("--input: no input paths given")
    sources: list[Source] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        if is_datasets_dir(path):
            sources.append(Source(path, "datasets"))
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind_of(p))
            if not found:
                raise InputError(
                    f"{path}: directory holds no input files ({', '.join(SUPPORTED_SUFFIXES)}) "
                    "and is not a `datasets` save_to_disk directory"
                )
            sources.extend(Source(p, _kind_of(p)) for p in found)  # type: ignore[arg-type]
        else:
            kind = _kind_of(path)
            if kind is None:
                raise InputError(f"{path}: unsupported input type; expected one of {', '.join(SUPPORTED_SUFFIXES)}")
            sources.append(Source(path, kind))
    for source in sources:
        if not os.access(source.path, os.R_OK):
            raise InputError(f"{source.path}: not readable (permission denied)")
    return sources


def check_source(source: Source, options: ReadOptions) -> None:
    """Cheap up-front checks (columns present) so a wrong `--text-field` fails before compute."""
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(source.path).schema_arrow.names
        except Exception as err:  # pyarrow raises several types for a broken file
            raise InputError(f"{source.path}: cannot read as parquet ({err})") from err
        if options.text_field not in names:
            raise InputError(f"{source.path}: no column {options.text_field!r} (--text-field); columns: {names}")
    elif source.kind == "datasets":
        names = _load_dataset(source, options).column_names
        if options.text_field not in names:
            raise InputError(f"{source.path}: no column {options.text_field!r} (--text-field); columns: {names}")


def _decode(line: bytes) -> RawDocument:
    try:
        return RawDocument(line.decode("utf-8"), 0)
    except UnicodeDecodeError:
        text = line.decode("utf-8", errors="replace")
        return RawDocument(text, text.count(_REPLACEMENT) - line.count(_REPLACEMENT_BYTES))


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _read_txt(path: Path, doc_per_line: bool) -> Iterator[RawDocument]:
    with _open_binary(path) as fh:
        if doc_per_line:
            for line in fh:
                yield _decode(line.rstrip(b"\r\n"))
            return
        lines: list[str] = []
        replaced = 0
        for line in fh:
            doc_line = _decode(line.rstrip(b"\r\n"))
            if doc_line.text.strip():
                lines.append(doc_line.text)
                replaced += doc_line.replaced
            elif lines:
                yield RawDocument("\n".join(lines), replaced)
                lines, replaced = [], 0
        if lines:
            yield RawDocument("\n".join(lines), replaced)


def _read_jsonl(path: Path, field: str) -> Iterator[RawDocument]:
    with _open_binary(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            decoded = _decode(line)
            try:
                record = json.loads(decoded.text)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: malformed JSON line ({err.msg} at column {err.colno})") from err
            if not isinstance(record, dict) or field not in record:
                raise InputError(f"{path}:{lineno}: no field {field!r} (--text-field) in this JSON line")
            text = record[field]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise InputError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, expected a string")
            yield RawDocument(text, decoded.replaced)


def _read_parquet(path: Path, field: str) -> Iterator[RawDocument]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if value is None:
                yield RawDocument("", 0)
            elif isinstance(value, bytes):
                yield _decode(value)
            else:
                yield RawDocument(str(value), 0)


def _load_dataset(source: Source, options: ReadOptions):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(source.path))
    except Exception as err:
        raise InputError(f"{source.path}: cannot load as a `datasets` directory ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        if options.split not in loaded:
            raise InputError(f"{source.path}: no split {options.split!r} (--split); splits: {sorted(loaded)}")
        loaded = loaded[options.split]
    return loaded


def _read_datasets(source: Source, options: ReadOptions) -> Iterator[RawDocument]:
    dataset = _load_dataset(source, options).select_columns([options.text_field])
    for batch in dataset.iter(batch_size=4096):
        for value in batch[options.text_field]:
            yield RawDocument(value or "", 0)


def iter_documents(source: Source, options: ReadOptions) -> Iterator[RawDocument]:
    """All documents of one source, in file order (empty ones included)."""
    try:
        if source.kind == "txt":
            yield from _read_txt(source.path, options.doc_per_line)
        elif source.kind == "jsonl":
            yield from _read_jsonl(source.path, options.text_field)
        elif source.kind == "parquet":
            yield from _read_parquet(source.path, options.text_field)
        elif source.kind == "datasets":
            yield from _read_datasets(source, options)
        else:  # pragma: no cover - resolve_inputs only makes the kinds above
            raise InputError(f"{source.path}: unknown source kind {source.kind!r}")
    except InputError:
        raise
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise InputError(f"{source.path}: unreadable ({err})") from err
    except Exception as err:  # parquet/arrow decoding errors and the like
        raise InputError(f"{source.path}: cannot read ({type(err).__name__}: {err})") from err
