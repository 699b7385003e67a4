"""data_prep.train_tokenizer: both kinds train locally and load offline with AutoTokenizer."""
from __future__ import annotations

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


def test_cli_reports_missing_input_and_no_documents(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "t"), "--no-progress"]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(InputError, match="no non-empty documents"):
        train_tokenizer([empty], tmp_path / "t", vocab_size=100, progress=False)


def test_load_tokenizer_rejects_directory_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer .*cannot be loaded"):
        load_tokenizer(tmp_path)
