"""Real English text that every Python installation already has: the demo's offline corpus.

The demo must run on a fresh machine with no network, yet train on real prose rather than
generated gibberish. Every Python install carries plenty: the docstrings of the standard library,
the long descriptions (READMEs) of installed distributions in `*.dist-info/METADATA`, and the
`.rst`/`.md`/`.txt` documentation some packages ship. This module gathers them *without importing
anything* (docstrings come from `ast`, so no module's import-time side effects run and broken
optional packages cannot crash the demo), cleans them into prose paragraphs and writes one text
file, one paragraph per line, documents separated by blank lines (the unit `data_prep.build_shards
--holdout-fraction` holds out by, which is where the demo's held-out set comes from).

The user can point at their own files or folders instead (`collect_user_corpus`): `.py` files
contribute their docstrings, any other file is read as UTF-8 text.

Trade-off: cleaning is heuristic (drop doctest/code-looking lines, keep paragraphs with enough
words and letters). It keeps most prose and little code, which is what a fill-mask demo needs;
it is not a general-purpose text extractor.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.io import write_atomic

#: Stdlib folders whose docstrings are test scaffolding or generated tables, not prose.
SKIPPED_DIRS = frozenset(
    {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
     "ensurepip", "turtledemo", "pydoc_data", "encodings", "vendor", "_vendor", "node_modules"}
)
DOC_SUFFIXES = (".rst", ".md", ".txt")
#: Files in site-packages named like docs but holding licences, requirements or data lists.
SKIPPED_DOC_NAMES = re.compile(r"(licen[cs]e|copying|notice|requirements|top_level|entry_points|record|"
                               r"sources|dependency_links|installer|authors|vocab|merges)", re.IGNORECASE)
MIN_WORDS = 6
MIN_LETTER_FRACTION = 0.6


@dataclass
class CorpusStats:
    """What went into the corpus file, printed by the demo."""

    path: Path
    paragraphs: int = 0
    documents: int = 0
    bytes: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # source kind -> paragraphs

    def add(self, kind: str, chunk: str, paragraphs: int) -> None:
        self.bytes += len(chunk.encode("utf-8"))
        self.documents += 1
        self.paragraphs += paragraphs
        self.sources[kind] = self.sources.get(kind, 0) + paragraphs

    def summary(self) -> str:
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.sources.items()))
        text = (f"{self.path} ({self.bytes / 1e6:.2f} MB, {self.documents} documents, "
                f"{self.paragraphs} paragraphs; {parts})")
        return text

    def as_json(self) -> dict:
        """The summary's numbers for `demo.json`."""
        return {"bytes": self.bytes, "documents": self.documents, "paragraphs": self.paragraphs,
                "sources": self.sources, "path": str(self.path)}


_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\$ |\.\. |::|[-=~^*#+`]{3,}\s*$|[{}()\[\];]+\s*$)")
_MARKUP = re.compile(r":[a-z]+:`~?([^`<]+)(?:<[^>]*>)?`|``([^`]+)``|`([^`<]+)(?:\s*<[^>]*>)?`_*|\*\*?([^*]+)\*\*?")
_URL = re.compile(r"https?://\S+")


def _strip_markup(text: str) -> str:
    """Keep the words of reST/Markdown roles, literals and links; drop the syntax and URLs."""
    text = _MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), text)
    return _URL.sub("", text)


def clean_paragraphs(text: str) -> list[str]:
    """Split a docstring / document into prose paragraphs, one line each.

    A paragraph is a run of non-blank lines. Code-looking lines (doctest prompts, reST directives,
    underlines, bare brackets) are dropped; a paragraph survives if it has at least `MIN_WORDS`
    words and at least `MIN_LETTER_FRACTION` of its non-space characters are letters.
    """
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not _CODE_LINE.match(ln)]
        if not lines or lines[0].startswith((".. ", "<", "|")):
            continue
        para = _strip_markup(" ".join(lines))
        para = re.sub(r"\s+", " ", para).strip()
        words = para.split()
        chars = [c for c in para if not c.isspace()]
        if len(words) < MIN_WORDS or not chars:
            continue
        if sum(c.isalpha() for c in chars) / len(chars) < MIN_LETTER_FRACTION:
            continue
        out.append(para)
    return out


def python_docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of a Python source file, parsed (never imported)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
    except (SyntaxError, ValueError, RecursionError, OSError):
        return []  # files for other Python versions, templates, unreadable: not prose anyway
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
    return docs


def metadata_description(path: Path) -> str:
    """The long description (README) of a `*.dist-info/METADATA` file: the body after the headers."""
    text = path.read_text(encoding="utf-8", errors="replace")
    _, sep, body = text.partition("\n\n")
    return body if sep else ""


def _walk_files(root: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Files under `root` with one of `suffixes`, in sorted (reproducible) order, skipping `SKIPPED_DIRS`."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(suffixes):
                yield Path(dirpath) / name


def site_package_dirs() -> list[Path]:
    """Every site-packages directory this interpreter imports from, sorted (reproducible).

    `sysconfig`'s purelib alone is not enough: inside a virtual environment created with
    `--system-site-packages` it names the (nearly empty) environment, while the installed
    libraries - and their documentation - live in the system directory on `sys.path`.
    """
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages(),
                  *(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")))]
    return sorted({Path(p).resolve() for p in candidates if p and Path(p).is_dir()})


def default_sources() -> Iterator[tuple[str, str]]:
    """(source kind, document text) from this Python installation, in a fixed order.

    Order: stdlib docstrings, then distribution READMEs, then shipped docs in site-packages — the
    most prose-like first, so a size cap keeps the best text.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for py in _walk_files(stdlib, (".py",)):
        for doc in python_docstrings(py):
            yield "stdlib-docstrings", doc
    site_dirs = site_package_dirs()
    for site_dir in site_dirs:
        for meta in sorted(site_dir.glob("*.dist-info/METADATA")):
            yield "package-readmes", metadata_description(meta)
    for site_dir in site_dirs:
        for doc in _walk_files(site_dir, DOC_SUFFIXES):
            if ".dist-info" in str(doc) or SKIPPED_DOC_NAMES.search(doc.name):
                continue
            yield "package-docs", doc.read_text(encoding="utf-8", errors="replace")


def user_sources(paths: Iterable[str | os.PathLike]) -> Iterator[tuple[str, str]]:
    """(source kind, document text) from files or folders the user named (folders walked, sorted).

    `.py` files contribute their docstrings; every other file is read as UTF-8 text.
    """
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise FileNotFoundError(f"--corpus: {root} does not exist")
        files = [root] if root.is_file() else sorted(
            p for p in _walk_files(root, ("",)) if p.is_file()
        )
        if not files:
            raise ValueError(f"--corpus: {root} contains no files")
        for f in files:
            if f.suffix == ".py":
                for doc in python_docstrings(f):
                    yield "user-docstrings", doc
            else:
                yield "user-text", f.read_text(encoding="utf-8", errors="replace")


def write_corpus(sources: Iterable[tuple[str, str]], out_path: str | os.PathLike,
                 max_bytes: int = 8_000_000) -> CorpusStats:
    """Clean, de-duplicate and write `sources` to `out_path` (atomically), up to `max_bytes` in all.

    Raises ValueError when nothing usable was found (e.g. user files with no prose).
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    documents: list[tuple[str, str, int]] = []  # (kind, chunk, paragraphs): the capped corpus, in order
    seen: set[bytes] = set()
    total = 0
    for kind, text in sources:
        kept = []
        for para in clean_paragraphs(text):
            digest = hashlib.blake2b(para.encode(), digest_size=12).digest()
            if digest not in seen:  # licences and boilerplate repeat across packages
                seen.add(digest)
                kept.append(para)
        if not kept:
            continue
        chunk = "\n".join(kept) + "\n\n"
        size = len(chunk.encode("utf-8"))
        if total + size > max_bytes and total > 0:
            break
        documents.append((kind, chunk, len(kept)))
        total += size
    if not documents:
        raise ValueError(f"no prose paragraphs (>= {MIN_WORDS} words) found for {out}")
    stats = CorpusStats(path=out)
    for kind, chunk, paragraphs in documents:
        stats.add(kind, chunk, paragraphs)
    write_atomic(out, "".join(chunk for _, chunk, _ in documents))  # at most max_bytes, joined once
    return stats


def build_demo_corpus(out_path: str | os.PathLike, user_paths: Iterable[str | os.PathLike] = (),
                      max_bytes: int = 8_000_000) -> CorpusStats:
    """The demo's corpus: the user's files when given, else this Python installation's documentation."""
    user_paths = list(user_paths)
    sources = user_sources(user_paths) if user_paths else default_sources()
    return write_corpus(sources, out_path, max_bytes=max_bytes)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="output text file")
    parser.add_argument("--corpus", nargs="*", default=[], help="files/folders to use instead of installed docs")
    parser.add_argument("--max-mb", type=float, default=8.0, help="cap on the corpus (training + held-out text)")
    args = parser.parse_args(argv)
    print(build_demo_corpus(args.out, args.corpus, int(args.max_mb * 1e6)).summary())


if __name__ == "__main__":
    main()
