"""Document -> token ids + word starts, for packing; identical to the tokenizer's own output.

Encoding goes through the `tokenizers` (Rust) object directly, without special tokens (the
packer adds `[CLS]`/`[SEP]`), with `encode_special_tokens` on so a literal "[SEP]" in the text is
tokenized as text, never turned into a real separator.

Word starts: for WordPiece, a token starts a word unless it is a `##` continuation (a vocabulary
table lookup); other models use the pre-tokenizer's word ids (`Encoding.word_ids`).

Fast path (BERT-style WordPiece: `BertNormalizer` + `BertPreTokenizer`, no added tokens besides
the special ones). The Rust pipeline spends most of its time normalising (NFD, accent stripping,
per-character classes) and building per-token `Encoding` objects. A document is *plain* when every
non-ASCII character in it is one the Rust normaliser maps to just its lower case (asked once per
character of the Rust normaliser itself, then cached). Plain documents are normalised in Python
(delete ASCII control characters, `str.lower`), split into words exactly like `BertPreTokenizer`
(runs of non-space, non-punctuation characters, and single punctuation characters; which non-ASCII
characters are punctuation is again asked of the Rust pre-tokenizer), and each distinct word is
WordPiece-encoded once by the Rust tokenizer and memoised. Natural text repeats words, so this is
~2x faster; other documents take the full Rust path. Tests compare both paths with the tokenizer.
"""
from __future__ import annotations

import json
import re
import string
from itertools import chain

import numpy as np
from tokenizers import Tokenizer

#: ASCII controls BERT's `clean_text` deletes (all but \t \n \r; NUL included).
_ASCII_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_NON_ASCII = re.compile("[^\x00-\x7f]")
#: Characters whose lower case depends on their neighbours in `str.lower` (final sigma) but not in
#: the Rust normaliser, which lower-cases one character at a time.
_CONTEXT_LOWERCASE = frozenset("\u03a3")
#: Distinct words memoised per process before the memo is cleared (bounds memory on huge corpora).
WORD_MEMO_LIMIT = 2_000_000


def _configured(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = True
    return tokenizer


class DocumentEncoder:
    """`encode(texts) -> (ids, word_starts, lengths)` for a serialized `tokenizers.Tokenizer`."""

    def __init__(self, backend_json: str) -> None:
        self.tokenizer = _configured(Tokenizer.from_str(backend_json))
        config = json.loads(backend_json)
        self.is_start: np.ndarray | None = None
        prefix = getattr(self.tokenizer.model, "continuing_subword_prefix", None)
        if type(self.tokenizer.model).__name__ == "WordPiece" and prefix:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            self.is_start = np.ones(max(vocab.values()) + 1, dtype=np.uint8)
            for token, index in vocab.items():
                if token.startswith(prefix):
                    self.is_start[index] = 0
        normalizer = config.get("normalizer") or {}
        self.fast = (
            self.is_start is not None
            and normalizer.get("type") == "BertNormalizer"
            and (config.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
            and all(token.get("special") for token in config.get("added_tokens", []))
        )
        if self.fast:
            self.word_tokenizer = _configured(Tokenizer.from_str(backend_json))
            self.word_tokenizer.normalizer = None
            self.clean = bool(normalizer.get("clean_text", True))
            self.lower = bool(normalizer.get("lowercase", True))
            self._char_is_plain: dict[str, bool] = {}
            self._punctuation = set(string.punctuation)
            self._word_pattern = self._compile_word_pattern()
            self._word_ids: dict[str, list[int]] = {}

    def _compile_word_pattern(self) -> re.Pattern:
        punctuation = re.escape("".join(sorted(self._punctuation)))
        return re.compile(f"[^\t\n\x0b\x0c\r {punctuation}]+|[{punctuation}]")

    def is_plain(self, text: str) -> bool:
        """True when the Rust normaliser would only lower-case `text` (and drop ASCII controls)."""
        if text.isascii():
            return True
        for char in set(_NON_ASCII.findall(text)):
            plain = self._char_is_plain.get(char)
            if plain is None:
                target = char.lower() if self.lower else char
                plain = len(target) == 1 and char not in _CONTEXT_LOWERCASE and self.tokenizer.normalizer.normalize_str(char) == target
                if plain and len(self.tokenizer.pre_tokenizer.pre_tokenize_str(f"a{target}a")) == 3:
                    self._punctuation.add(target)  # split off on its own, like ASCII punctuation
                    self._word_pattern = self._compile_word_pattern()
                self._char_is_plain[char] = plain
            if not plain:
                return False
        return True

    def _plain_ids(self, texts: list[str]) -> list[list[int]]:
        """Ids of plain documents through the word memo."""
        if self.clean:
            texts = [_ASCII_CONTROLS.sub("", t) for t in texts]
        words = [self._word_pattern.findall(t.lower() if self.lower else t) for t in texts]
        missing = list({w for doc in words for w in doc if w not in self._word_ids})
        if len(self._word_ids) + len(missing) > WORD_MEMO_LIMIT:
            self._word_ids.clear()
            missing = list({w for doc in words for w in doc})
        encoded = self.word_tokenizer.encode_batch_fast(missing, add_special_tokens=False)
        self._word_ids.update(zip(missing, (e.ids for e in encoded)))
        lookup = self._word_ids.__getitem__
        return [list(chain.from_iterable(map(lookup, doc))) for doc in words]

    def _wordpiece_ids(self, texts: list[str]) -> list[list[int]]:
        if not self.fast:
            return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        plain = [self.is_plain(t) for t in texts]
        plain_index = [i for i, p in enumerate(plain) if p]
        other_index = [i for i, p in enumerate(plain) if not p]
        result: list = [None] * len(texts)
        for i, ids in zip(plain_index, self._plain_ids([texts[i] for i in plain_index])):
            result[i] = ids
        full = self.tokenizer.encode_batch_fast([texts[i] for i in other_index], add_special_tokens=False)
        for i, encoding in zip(other_index, full):
            result[i] = encoding.ids
        return result

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokenize documents -> (flat ids int64, flat word-start flags uint8, per-document lengths).

        The first token of every document starts a word.
        """
        if self.is_start is not None:
            per_doc = self._wordpiece_ids(texts)
            words = None
        else:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
            per_doc = [e.ids for e in encodings]
            words = [e.word_ids for e in encodings]
        lengths = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(per_doc), dtype=np.int64, count=total)
        if self.is_start is not None:
            starts = self.is_start[ids]
        else:
            flat_words = np.fromiter((-1 if w is None else w for w in chain.from_iterable(words)), dtype=np.int64, count=total)
            starts = np.ones(total, dtype=np.uint8)
            if total > 1:
                starts[1:] = flat_words[1:] != flat_words[:-1]
        doc_first = np.cumsum(lengths) - lengths
        starts[doc_first[lengths > 0]] = 1
        return ids, starts, lengths
