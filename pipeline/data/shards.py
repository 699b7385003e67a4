"""The shard format: the one contract between `data_prep` (writer) and `pipeline.data.reader` (reader).

A shard directory holds
  manifest.json          written last, atomically; its presence means the build is complete
  shard_00000.arrow ...  Arrow IPC *stream* format (what `datasets` writes), one record batch per shard
  state.json, dataset_info.json   so the directory is a `datasets` dataset (`write_datasets_files`)
  tokenizer/             the tokenizer used (loadable with `transformers.AutoTokenizer`)

Other tools read it with their usual calls: `datasets.load_from_disk(DIR)` (all shards, in order),
`datasets.Dataset.from_file(SHARD)`, `pyarrow.ipc.open_stream(pyarrow.memory_map(SHARD))`.
Directories written before the stream framing (Arrow IPC *file* format, no state.json) stay
readable here (the framing is told by the file's first bytes, `ipc_reader`) and by
`datasets.load_dataset("arrow", data_files=...)`.

Every shard has the same schema (`shard_schema`):
  input_ids    fixed_size_list<uint8|uint16|uint32>[seq_len]  `[CLS] ... [SEP]` then `[PAD]`
  word_starts  fixed_size_list<uint8>[seq_len]                  1 at the first sub-token of a word
  length       int32                                            tokens before the padding

Fixed-size lists make a shard a dense `[rows, seq_len]` matrix that the reader maps zero-copy
(`pa.memory_map` -> numpy view); the id type is the smallest unsigned integer that holds the
vocabulary, so a 30k vocabulary costs 2 bytes per token. Word starts are stored (not recomputed)
because whole-word and InfoWord span masking need them and the tokenizer is not run at train time.

Integrity: the manifest records per shard its size, sha256 (what `data_prep.verify` checks) and,
since format 2, an xxh3-64 hash (`xxhash`), about 12x faster to compute than sha256 (measured in
docs/data.md), which training checks on every rank when it first opens a shard
(`open_shard(..., expected=info)`). A format-1 manifest has no xxh3 hash; its shards are then
checked against their sha256 (correct, slower). `check_layout` is the cheap part that needs no
full read (sizes, Arrow schemas, row counts, sequence length, vocabulary against the tokenizer),
run before any model is built.

What training reads from the manifest is covered by `content_hash` (`Manifest.content_hash`,
written with every manifest): the sha256 of `TRAINING_FIELDS` (sequence length, vocabulary, id
type, special-token ids, tokenizer hash, packing, totals, and the shard list with each file's
name, rows, size and hashes). `check_layout` recomputes it, checks the special-token ids against
the tokenizer beside the shards, and lists shard files in the directory that the manifest does
not name, so a hand-edited id or a shard dropped from the manifest is refused by training (at
start) and by `cpt-verify` alike. Format 3 (the first that always writes the hash) requires it: an
edit that also blanks `content_hash` is refused like any other; manifests of formats 1 and 2 (built
before the hash existed) are read without it. The hash holds no build settings (`build_args`, `num_proc`, input
paths) and never reads a shard, so byte-identical builds have the same hash whatever the shard
file framing; it is the data identity recorded in checkpoints (`manifest_hash`).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from pipeline.io import hash_directory, sha256_file, write_atomic, xxh3_file

FORMAT_VERSION = 3  # 2: per-shard xxh3_64 hash; 3: `content_hash` always written, so required
READABLE_FORMAT_VERSIONS = (1, 2, 3)
#: From this format on every build writes `content_hash`: a manifest of it without one was edited.
CONTENT_HASH_REQUIRED_FROM = 3
MANIFEST_FILE = "manifest.json"
TOKENIZER_SUBDIR = "tokenizer"
SPECIAL_TOKEN_NAMES = ("pad", "cls", "sep", "mask", "unk")


def shard_name(index: int) -> str:
    """File name of shard number `index` (zero-padded so names sort in build order)."""
    return f"shard_{index:05d}.arrow"


def id_dtype_for(vocab_size: int) -> np.dtype:
    """Smallest unsigned integer dtype that holds every id in `range(vocab_size)`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def shard_schema(seq_len: int, id_dtype: np.dtype | str) -> pa.Schema:
    """Arrow schema of every shard of a build with this sequence length and id dtype."""
    return pa.schema(
        [
            pa.field("input_ids", pa.list_(pa.from_numpy_dtype(np.dtype(id_dtype)), seq_len), nullable=False),
            pa.field("word_starts", pa.list_(pa.uint8(), seq_len), nullable=False),
            pa.field("length", pa.int32(), nullable=False),
        ]
    )


def rows_per_shard(seq_len: int, id_dtype: np.dtype | str, shard_size_mb: float) -> int:
    """How many sequences fit in a shard of at most `shard_size_mb` MiB (at least one)."""
    row_bytes = seq_len * (np.dtype(id_dtype).itemsize + 1) + 4
    return max(1, int(shard_size_mb * (1 << 20)) // row_bytes)


class ShardError(ValueError):
    """A shard file that does not match its manifest (damaged, truncated, replaced, or the manifest edited)."""


@dataclass
class ShardInfo:
    """One shard file: name inside the directory, row count, sha256 of its bytes, size in bytes, and
    the xxh3-64 hash of its bytes (hex; empty in format-1 manifests)."""

    name: str
    rows: int
    sha256: str
    bytes: int
    xxh3_64: str = ""


@dataclass
class Manifest:
    """Everything a reader (or a person) needs to know about a shard directory."""

    format_version: int
    seq_len: int
    vocab_size: int
    special_tokens: dict[str, int]  # pad, cls, sep, mask, unk -> id
    tokenizer_hash: str  # `hash_directory(<dir>/tokenizer)`
    shards: list[ShardInfo]
    total_sequences: int
    total_tokens: int  # non-padding tokens, special tokens included
    sources: list[dict[str, Any]]  # {path, bytes, sha256, documents}
    build_args: dict[str, Any]  # the exact arguments of `data_prep.build_shards`
    id_dtype: str = "uint16"
    packing: str = "full"  # "full" (documents joined by [SEP]) or "doc" (one document per sequence run)
    stats: dict[str, int] = field(default_factory=dict)  # documents, skipped_empty, replaced_chars, ...
    fingerprint: str = ""  # hash of everything that determines the shard bytes (for resume/refusal)
    content_hash: str = ""  # `content_hash(self)` when written (empty in manifests from before it)

    def to_json(self) -> str:
        """The manifest file's text, with `content_hash` computed from the fields it covers now."""
        self.content_hash = content_hash(self)
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "manifest") -> "Manifest":
        known = set(cls.__dataclass_fields__)
        fields = cls.__dataclass_fields__.values()
        required = [f.name for f in fields if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"{where}: missing fields {missing}")
        if raw["format_version"] not in READABLE_FORMAT_VERSIONS:
            raise ValueError(f"{where}: format_version {raw['format_version']} unsupported (this version reads "
                             f"{list(READABLE_FORMAT_VERSIONS)})")
        values = {k: v for k, v in raw.items() if k in known}
        values["shards"] = [ShardInfo(**s) for s in raw["shards"]]
        absent = [n for n in SPECIAL_TOKEN_NAMES if n not in raw["special_tokens"]]
        if absent:
            raise ValueError(f"{where}: special_tokens lacks {absent}")
        return cls(**values)


#: The manifest fields training reads (the shard list with every `ShardInfo` field); `content_hash` covers them.
TRAINING_FIELDS = ("format_version", "seq_len", "vocab_size", "id_dtype", "special_tokens", "tokenizer_hash", "packing",
                   "total_sequences", "total_tokens", "shards")


def content_hash(manifest: Manifest) -> str:
    """sha256 of the canonical JSON of the manifest's `TRAINING_FIELDS`: what a build produced, not
    how it ran (no `build_args`, paths or `num_proc`), and computed without reading any shard."""
    raw = asdict(manifest)
    blob = json.dumps({name: raw[name] for name in TRAINING_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def unlisted_shards(directory: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Names of shard files in `directory` that the manifest does not list (a shard dropped from the
    manifest): files with a listed shard's extension (`.arrow`), or named like one (`shard_*`),
    other than the `.tmp` of an unfinished write. By name only, whatever the files' framing."""
    listed = {info.name for info in manifest.shards}
    suffixes = {Path(name).suffix for name in listed} or {Path(shard_name(0)).suffix}
    found = (p.name for p in Path(directory).iterdir() if p.is_file() and not p.name.endswith(".tmp")
             and (p.suffix in suffixes or p.name.startswith("shard_")))
    return sorted(name for name in found if name not in listed)


def check_manifest_fields(directory: str | os.PathLike, manifest: Manifest) -> list[str]:
    """The manifest against its own `content_hash` and the shard files present (see the module doc)."""
    problems = []
    if not manifest.content_hash and manifest.format_version >= CONTENT_HASH_REQUIRED_FROM:
        problems.append(f"{Path(directory) / MANIFEST_FILE}: content_hash is empty, but every format "
                        f"{manifest.format_version} build writes it: the manifest was edited after the build; restore "
                        "it or rebuild the shards")
    elif manifest.content_hash and content_hash(manifest) != manifest.content_hash:
        problems.append(f"{Path(directory) / MANIFEST_FILE}: edited after the build: the fields training reads "
                        f"({', '.join(TRAINING_FIELDS)}) no longer match its content_hash; restore it or rebuild the "
                        "shards")
    extra = unlisted_shards(directory, manifest)
    if extra:
        problems.append(f"{Path(directory) / extra[0]}: in the directory but not in manifest.json ({len(extra)} such "
                        "file(s)): a shard was dropped from the manifest; restore it or rebuild the shards")
    return problems


def manifest_file_sha256(directory: str | os.PathLike) -> str:
    """sha256 of the manifest file's bytes: the data identity checkpoints recorded before `content_hash`
    (it changes with the build settings, e.g. `num_proc`); still accepted on resume."""
    return sha256_file(Path(directory) / MANIFEST_FILE)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Parse `<directory>/manifest.json`; a clear error if the directory is not a complete build."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; {directory} is not a complete shard directory "
            "(build it with `python -m data_prep.build_shards`, or re-run that command to finish it)"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    return Manifest.from_dict(raw, where=str(path))


def manifest_hash(directory: str | os.PathLike) -> str:
    """Identity of a dataset build, recorded in checkpoints: `content_hash` of its manifest (the
    same for byte-identical builds made with any `num_proc`)."""
    return content_hash(read_manifest(directory))


#: The first bytes of an Arrow IPC *file* (the framing of shards written before the stream format).
ARROW_FILE_MAGIC = b"ARROW1"
DATASETS_STATE_FILE = "state.json"
DATASETS_INFO_FILE = "dataset_info.json"


def ipc_reader(source: pa.MemoryMappedFile) -> Any:
    """A record-batch reader (`.schema`, `.read_all()`, iteration) of a shard in either framing:
    the IPC stream (current) or the IPC file (older shards). Both read zero-copy from a memory map."""
    head = source.read(len(ARROW_FILE_MAGIC))
    source.seek(0)
    if head == ARROW_FILE_MAGIC:
        return _FileBatches(pa.ipc.open_file(source))
    return pa.ipc.open_stream(source)


class _FileBatches:
    """An IPC file reader seen as a stream reader (schema, batches in order, `read_all`)."""

    def __init__(self, reader: Any) -> None:
        self.schema, self._reader = reader.schema, reader

    def __iter__(self) -> Iterable[pa.RecordBatch]:
        return (self._reader.get_batch(i) for i in range(self._reader.num_record_batches))

    def read_all(self) -> pa.Table:
        return self._reader.read_all()


def write_datasets_files(directory: str | os.PathLike, manifest: "Manifest") -> None:
    """`state.json` and `dataset_info.json`, what `datasets.load_from_disk` reads beside the Arrow
    files: the shards in manifest order, split `train`, no format; the features come from the
    shards' schema (`datasets` infers them). Written before the manifest, so a complete directory has them."""
    directory = Path(directory)
    state = {"_data_files": [{"filename": info.name} for info in manifest.shards], "_fingerprint": manifest.fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": "train"}
    info = {"description": "contrastive-pretrain token shards (pipeline/data/shards.py): input_ids, word_starts, "
                           "length", "citation": "", "homepage": "", "license": "", "features": None}
    write_atomic(directory / DATASETS_INFO_FILE, json.dumps(info, indent=2) + "\n")
    write_atomic(directory / DATASETS_STATE_FILE, json.dumps(state, indent=2) + "\n")


def write_shard(path: str | os.PathLike, input_ids: np.ndarray, word_starts: np.ndarray, lengths: np.ndarray) -> ShardInfo:
    """Write one shard (`[rows, seq_len]` arrays) atomically; return its `ShardInfo`."""
    path = Path(path)
    rows, seq_len = input_ids.shape
    schema = shard_schema(seq_len, input_ids.dtype)
    batch = pa.record_batch(
        [
            pa.FixedSizeListArray.from_arrays(pa.array(input_ids.reshape(-1)), seq_len),
            pa.FixedSizeListArray.from_arrays(pa.array(word_starts.astype(np.uint8, copy=False).reshape(-1)), seq_len),
            pa.array(lengths.astype(np.int32, copy=False)),
        ],
        schema=schema,
    )
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return ShardInfo(name=path.name, rows=rows, sha256=sha256_file(path), bytes=path.stat().st_size,
                     xxh3_64=xxh3_file(path))


@dataclass
class ShardArrays:
    """Zero-copy numpy views of one memory-mapped shard (valid while `mapped` stays open)."""

    input_ids: np.ndarray  # [rows, seq_len], uint8/16/32
    word_starts: np.ndarray  # [rows, seq_len], uint8
    length: np.ndarray  # [rows], int32
    mapped: pa.MemoryMappedFile


def check_bytes(path: Path, info: ShardInfo) -> None:
    """`ShardError` unless the file has the size and hash its manifest entry records (xxh3-64; the
    sha256 for format-1 manifests, which have no xxh3)."""
    size = path.stat().st_size
    if size != info.bytes:
        raise ShardError(f"{path}: {size} bytes, manifest.json says {info.bytes} (truncated or replaced, or the "
                         "manifest was edited)")
    if info.xxh3_64:
        if xxh3_file(path) != info.xxh3_64:
            raise ShardError(f"{path}: its xxh3-64 hash differs from manifest.json: the file is damaged or was changed")
    elif sha256_file(path) != info.sha256:
        raise ShardError(f"{path}: its sha256 differs from manifest.json: the file is damaged or was changed")


def open_shard(path: str | os.PathLike, seq_len: int, id_dtype: np.dtype | str,
               expected: ShardInfo | None = None, check_hash: bool = True) -> ShardArrays:
    """Memory-map a shard and expose its columns as numpy views; checks the schema, and with
    `expected` (its manifest entry) its row count and first its size and (with `check_hash`) its
    hash (`check_bytes`)."""
    path = Path(path)
    if expected is not None and check_hash:
        check_bytes(path, expected)
    elif expected is not None and path.stat().st_size != expected.bytes:
        raise ShardError(f"{path}: {path.stat().st_size} bytes, manifest.json says {expected.bytes}")
    mapped = pa.memory_map(str(path), "r")
    try:
        reader = ipc_reader(mapped)
    except (pa.ArrowInvalid, OSError) as err:
        mapped.close()
        raise ShardError(f"{path}: not an Arrow IPC shard ({err})") from err
    schema_expected = shard_schema(seq_len, id_dtype)
    if not reader.schema.equals(schema_expected):
        mapped.close()
        raise ShardError(f"{path}: {schema_difference(reader.schema, seq_len, id_dtype)}")
    try:
        table = reader.read_all().combine_chunks()  # one batch per shard: no copy
    except (pa.ArrowInvalid, OSError) as err:
        mapped.close()
        raise ShardError(f"{path}: not a readable Arrow IPC shard ({err})") from err
    if expected is not None and table.num_rows != expected.rows:
        mapped.close()
        raise ShardError(f"{path}: {table.num_rows} rows, manifest.json says {expected.rows}")

    def matrix(name: str) -> np.ndarray:
        column = table.column(name).chunk(0) if table.num_rows else None
        if column is None:
            return np.zeros((0, seq_len), dtype=schema_expected.field(name).type.value_type.to_pandas_dtype())
        return column.flatten().to_numpy(zero_copy_only=True).reshape(-1, seq_len)

    length = table.column("length").chunk(0).to_numpy(zero_copy_only=True) if table.num_rows else np.zeros(0, np.int32)
    return ShardArrays(matrix("input_ids"), matrix("word_starts"), length, mapped)


def schema_difference(schema: pa.Schema, seq_len: int, id_dtype: np.dtype | str) -> str:
    """What differs between a shard's schema and the one its manifest implies, in manifest terms."""
    try:
        ids = schema.field("input_ids").type
        size, value = ids.list_size, ids.value_type
    except (KeyError, AttributeError):
        return (f"schema [{_one_line(schema)}] is not a shard schema "
                f"(expected [{_one_line(shard_schema(seq_len, id_dtype))}])")
    if size != seq_len:
        return f"rows of {size} tokens, manifest.json says seq_len={seq_len}"
    if value != pa.from_numpy_dtype(np.dtype(id_dtype)):
        return f"token ids stored as {value}, manifest.json says id_dtype={np.dtype(id_dtype).name}"
    return f"schema [{_one_line(schema)}] differs from the manifest's [{_one_line(shard_schema(seq_len, id_dtype))}]"


def _one_line(schema: pa.Schema) -> str:
    """An Arrow schema's multi-line text on one line (errors are one line)."""
    return "; ".join(str(schema).splitlines())


def read_footer(path: Path) -> tuple[pa.Schema, int]:
    """(schema, rows) from a shard's batch headers (and, for the IPC file framing, its footer),
    without reading its data (the batches map zero-copy)."""
    try:
        with pa.memory_map(str(path), "r") as mapped:
            reader = ipc_reader(mapped)
            return reader.schema, sum(batch.num_rows for batch in reader)
    except (pa.ArrowInvalid, OSError) as err:
        raise ShardError(f"{path}: not a readable Arrow IPC shard ({err})") from err


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """Vocabulary size of a tokenizer directory as `data_prep` counts it (`len(AutoTokenizer)`, which
    for a fast tokenizer is its `tokenizer.json` vocabulary plus added tokens)."""
    if (tokenizer_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))


def special_token_differences(tokenizer_dir: Path, manifest: Manifest) -> list[str]:
    """`special_tokens.<name>` entries of the manifest that differ from the tokenizer's own ids
    (`[PAD]`, `[CLS]`, ... as the tokenizer's `tokenizer_config.json` / `special_tokens_map.json`
    name them): a hand-edited id would make training mask with the wrong token."""
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return []
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    names: dict[str, str] = {}
    for config in ("special_tokens_map.json", "tokenizer_config.json"):
        path = tokenizer_dir / config
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError:
                continue
            for name in SPECIAL_TOKEN_NAMES:
                token = raw.get(f"{name}_token")
                token = token.get("content") if isinstance(token, dict) else token
                if isinstance(token, str):
                    names.setdefault(name, token)
    return [f"manifest.json: special_tokens.{name}={manifest.special_tokens[name]}, but the tokenizer's {token} is id "
            f"{vocab[token]} (the manifest was edited); restore it or rebuild the shards"
            for name, token in names.items() if token in vocab and vocab[token] != manifest.special_tokens.get(name)]


def check_layout(directory: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Every disagreement between a shard directory and its manifest that shows without reading the
    shards' data: missing shards, sizes (truncation), schemas (`seq_len`, id type), row counts,
    totals, and `vocab_size` against the id type and the tokenizer beside the shards (when there is
    one; its hash too). Cheap (footers only): run before any model is built."""
    directory = Path(directory)
    problems: list[str] = []
    try:
        if id_dtype_for(manifest.vocab_size) != np.dtype(manifest.id_dtype):
            problems.append(f"manifest.json: vocab_size {manifest.vocab_size} needs id_dtype "
                            f"{id_dtype_for(manifest.vocab_size).name}, not {manifest.id_dtype} (the manifest was edited)")
    except (TypeError, ValueError) as err:
        problems.append(f"manifest.json: vocab_size {manifest.vocab_size!r} / id_dtype {manifest.id_dtype!r}: {err}")
        return problems
    tokenizer_dir = directory / TOKENIZER_SUBDIR
    if tokenizer_dir.is_dir():
        if hash_directory(tokenizer_dir) != manifest.tokenizer_hash:
            problems.append(f"{tokenizer_dir}: hash differs from the manifest's tokenizer_hash")
        elif tokenizer_vocab_size(tokenizer_dir) != manifest.vocab_size:
            problems.append(f"manifest.json: vocab_size {manifest.vocab_size}, but the tokenizer the shards were built "
                            f"with has {tokenizer_vocab_size(tokenizer_dir)} tokens (the manifest was edited)")
        else:
            problems += special_token_differences(tokenizer_dir, manifest)
    schema = shard_schema(manifest.seq_len, manifest.id_dtype)
    for info, path in iter_shard_paths(directory, manifest):
        if not path.is_file():
            problems.append(f"{path}: listed in manifest.json but missing")
            continue
        if path.stat().st_size != info.bytes:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest.json says {info.bytes} (truncated or "
                            "replaced, or the manifest was edited)")
            continue
        try:
            found, rows = read_footer(path)
            problem = ("" if found.equals(schema) else schema_difference(found, manifest.seq_len, manifest.id_dtype)) \
                or (f"{rows} rows, manifest.json says {info.rows}" if rows != info.rows else "")
            if problem:
                raise ShardError(f"{path}: {problem}")
        except ShardError as err:
            problems.append(_damage_or(path, info, str(err)))
    listed = sum(info.rows for info in manifest.shards)
    if listed != manifest.total_sequences:
        problems.append(f"manifest.json: total_sequences {manifest.total_sequences}, its shards list {listed} rows")
    return problems + check_manifest_fields(directory, manifest)  # after the specific findings: a catch-all


def _damage_or(path: Path, info: ShardInfo, problem: str) -> str:
    """A shard whose header disagrees with its manifest entry is most often damaged (a flipped byte in
    the schema reads as another schema): say so when its hash disagrees too, else `problem`. Only
    read on this failure path, so the cheap layout check stays cheap."""
    try:
        check_bytes(path, info)
    except ShardError as err:
        return str(err)
    return problem


def iter_shard_paths(directory: str | os.PathLike, manifest: Manifest) -> Iterable[tuple[ShardInfo, Path]]:
    """(ShardInfo, absolute path) of every shard listed in the manifest, in order."""
    for info in manifest.shards:
        yield info, Path(directory) / info.name
