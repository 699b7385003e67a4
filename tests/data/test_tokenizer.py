"""data_prep.train_tokenizer: both kinds train locally and load offline with AutoTokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from data_prep.readers import InputError
from data_prep.tokenizer_io import load_tokenizer
from data_prep.train_tokenizer import main, train_tokenizer


def test_wordpiece_fixture_loads_offline_with_bert_specials(tiny_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), local_files_only=True)
    assert len(tok) == 800
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == [0, 1, 2, 3, 4]
    encoded = tok("Return the Sorted LIST.")["input_ids"]
    assert encoded[0] == tok.cls_token_id and encoded[-1] == tok.sep_token_id
    assert tok.decode(encoded, skip_special_tokens=True) == "return the sorted list."  # uncased
    assert tok("[MASK] x", add_special_tokens=False)["input_ids"][0] == tok.mask_token_id


def test_bpe_kind_round_trips_text_and_has_roberta_specials(tmp_path: Path, tiny_corpus_file: Path) -> None:
    out = train_tokenizer([tiny_corpus_file], tmp_path / "bpe", kind="bpe", vocab_size=600, progress=False)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(tok) == 600
    text = "Return the Sorted LIST, 42 times: é!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.cls_token_id == tok.convert_tokens_to_ids("<s>")
    assert ids[-1] == tok.sep_token_id == tok.convert_tokens_to_ids("</s>")
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless, cased
    loaded = load_tokenizer(out)
    assert set(loaded.special_tokens) == {"pad", "cls", "sep", "mask", "unk"}
    # A class name transformers 4.x resolves too (5.x writes its own "TokenizersBackend").
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_cli_reports_missing_input_and_no_documents(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "t"), "--no-progress"]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(InputError, match="no non-empty documents"):
        train_tokenizer([empty], tmp_path / "t", vocab_size=100, progress=False)


def test_load_tokenizer_rejects_directory_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer .*: no tokenizer files in this directory"):
        load_tokenizer(tmp_path)


TRICKY_DOCUMENTS = [
    "Plain ASCII, with punctuation: don't stop-words (3.14)!",
    "Tabs\tand\r\nline breaks\x0bvertical\x0cfeed, NUL\x00inside and a DEL\x7fcharacter, bell\x07.",
    "Dashes – and — quotes ’ ” degrees 25 °C, pounds £5, primes 5′ 3″.",
    "Accents: Café, naïve, Ångström, ÉCOLE, résumé; İstanbul; Straße.",
    "Greek: ΟΔΥΣΣΕΥΣ ends in a final sigma, ΣΟΦΙΑ starts with one; αβγ.",
    "CJK 中文字符 mixed with Latin, and Japanese かな.",
    "Invisible: zero\u200bwidth, no\u00a0break space, soft\u00adhyphen, combining e\u0301 mark.",
    "Emoji 😀 and symbols ♭ ♯ ∑ ∫ → ← ✓.",
    "A literal [SEP] and [MASK] in the text are text, not special tokens.",
    "",
]


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_document_encoder_matches_the_tokenizer_exactly(tmp_path: Path, tiny_corpus_file: Path, kind: str) -> None:
    from data_prep.encode import DocumentEncoder

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(tiny_corpus_file.read_text() + "\n\n" + "\n\n".join(TRICKY_DOCUMENTS * 3))
    out = train_tokenizer([corpus], tmp_path / kind, kind=kind, vocab_size=700, progress=False)
    loaded = load_tokenizer(out)
    encoder = DocumentEncoder(loaded.backend_json)
    assert encoder.fast == (kind == "wordpiece")  # the fast path is BERT WordPiece only
    texts = TRICKY_DOCUMENTS + [t.upper() for t in TRICKY_DOCUMENTS] + [" ".join(TRICKY_DOCUMENTS)]
    ids, starts, lengths = encoder.encode(texts)
    reference = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    offset = 0
    for text, length in zip(texts, lengths):
        encoded = reference(text, add_special_tokens=False)
        expected_ids = encoded["input_ids"]
        if "[SEP]" in text:  # the reference splits literal special tokens out; the encoder must not
            assert loaded.special_tokens["sep"] not in ids[offset : offset + length].tolist()
        else:
            assert ids[offset : offset + length].tolist() == expected_ids, text
            words = encoded.word_ids()
            expected_starts = [1] + [int(b != a) for a, b in zip(words, words[1:])] if words else []
            assert starts[offset : offset + length].tolist() == expected_starts, text
        offset += length
    if kind == "wordpiece":  # most of these documents are not "plain": they must take the full path
        assert not encoder.is_plain(TRICKY_DOCUMENTS[3]) and not encoder.is_plain(TRICKY_DOCUMENTS[4])
        assert encoder.is_plain(TRICKY_DOCUMENTS[1]) and encoder.is_plain(TRICKY_DOCUMENTS[2])


def test_the_fixture_tokenizers_ids_do_not_depend_on_the_trainers_order(tiny_tokenizer_dir, tmp_path):
    """The session's tokenizer is renumbered in a fixed order (`tests.fixtures_data.canonical_wordpiece_ids`): the
    same ids from any permutation the trainer may produce, and the same tokens for any text."""
    import json
    import random
    import shutil

    from transformers import AutoTokenizer

    from tests.fixtures_data import canonical_wordpiece_ids

    shuffled = tmp_path / "shuffled"
    shutil.copytree(tiny_tokenizer_dir, shuffled)
    spec = json.loads((shuffled / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    others = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 5]
    random.Random(3).shuffle(others)  # what another session's trainer could have numbered
    spec["model"]["vocab"] = {**{t: i for t, i in vocab.items() if i < 5}, **{t: 5 + i for i, t in enumerate(others)}}
    (shuffled / "tokenizer.json").write_text(json.dumps(spec))
    text = "Return a new deque object initialized left-to-right with data from iterable."
    assert AutoTokenizer.from_pretrained(str(shuffled))(text)["input_ids"] != \
        AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))(text)["input_ids"]
    canonical_wordpiece_ids(shuffled)
    assert json.loads((shuffled / "tokenizer.json").read_text())["model"]["vocab"] == vocab
    ours, theirs = (AutoTokenizer.from_pretrained(str(d)) for d in (shuffled, tiny_tokenizer_dir))
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    ordered = sorted(vocab, key=vocab.get)[5:]
    lengths = [len(t.removeprefix("##")) for t in ordered]
    assert lengths == sorted(lengths) and ordered[:3] == sorted(ordered[:3])  # single characters first, by text
