"""Shard integrity at training time: the xxh3-64 hash recorded per shard is checked on every rank when
the shards are first opened (or the sha256 for format-1 manifests), and a truncated shard or an
edited manifest is a clear error before any model is built; `data_prep.verify` agrees."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_prep.build_shards import main as build_main
from data_prep.merge import main as merge_main
from data_prep.verify import verify_directory
from pipeline.data.reader import ShardDataset
from pipeline.data.shards import FORMAT_VERSION, ShardError, read_manifest
from pipeline.io import xxh3_file
from tests.train.runs import latest, losses, run_inprocess


def _copy(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "shards"))


def _flip_a_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _edit_manifest(directory: Path, edit) -> None:
    raw = json.loads((directory / "manifest.json").read_text())
    edit(raw)
    (directory / "manifest.json").write_text(json.dumps(raw))


def test_every_shard_has_its_xxh3_hash_in_the_manifest(tiny_shards_dir):
    manifest = read_manifest(tiny_shards_dir)
    assert manifest.format_version == FORMAT_VERSION == 3
    assert all(s.xxh3_64 == xxh3_file(tiny_shards_dir / s.name) and len(s.xxh3_64) == 16 for s in manifest.shards)


# The two others read a row sample of the shards while the model is built (before the hash check).
@pytest.mark.parametrize("preset, extra", [("tiny-mlm", ()), ("tiny-mlm-nce", ()),
                                           ("tiny-mlm", ("model.mlm_bias_init=unigram",))])
def test_a_flipped_byte_stops_training_before_any_compute(tiny_shards_dir, tmp_path, capsys, preset, extra):
    shards = _copy(tiny_shards_dir, tmp_path)
    victim = shards / read_manifest(shards).shards[1].name
    _flip_a_byte(victim)
    with pytest.raises(ShardError, match=f"{victim}: its xxh3-64 hash differs from manifest.json"):
        ShardDataset(shards).open()
    ShardDataset(shards, verify=False).open()  # data.verify_shards=false: no full read (sizes and rows still checked)

    out = tmp_path / "run"
    assert run_inprocess(preset, shards, out, "train.total_steps=3", *extra) == 2
    err = capsys.readouterr().err
    assert f"data.shards_dir={shards}: {victim}: its xxh3-64 hash differs" in err and "nothing was computed" in err
    assert "data.verify_shards=false skips this check" in err
    assert latest(out) is None and losses(out) == {}


def _truncate(directory: Path) -> str:
    victim = directory / read_manifest(directory).shards[2].name
    victim.write_bytes(victim.read_bytes()[:-100])
    return f"{victim}: {victim.stat().st_size} bytes, manifest.json says {victim.stat().st_size + 100}"


def _more_rows(directory: Path) -> str:
    def edit(raw):
        raw["shards"][0]["rows"] += 1
        raw["total_sequences"] += 1
    _edit_manifest(directory, edit)
    rows = read_manifest(directory).shards[0].rows
    return f"{directory / 'shard_00000.arrow'}: {rows - 1} rows, manifest.json says {rows}"


def _longer_rows(directory: Path) -> str:
    _edit_manifest(directory, lambda raw: raw.update(seq_len=128))
    return f"{directory / 'shard_00000.arrow'}: rows of 64 tokens, manifest.json says seq_len=128"


def _bigger_vocabulary(directory: Path) -> str:
    _edit_manifest(directory, lambda raw: raw.update(vocab_size=900))
    return "manifest.json: vocab_size 900, but the tokenizer the shards were built with has 800 tokens"


def _fewer_sequences(directory: Path) -> str:
    _edit_manifest(directory, lambda raw: raw.update(total_sequences=raw["total_sequences"] - 5))
    return "manifest.json: total_sequences"


@pytest.mark.parametrize("damage", [_truncate, _more_rows, _longer_rows, _bigger_vocabulary, _fewer_sequences])
def test_truncated_shards_and_edited_manifests_are_refused_before_compute(damage, tiny_shards_dir, tmp_path, capsys):
    from pipeline.train.cli import main

    shards = _copy(tiny_shards_dir, tmp_path)
    expected = damage(shards)
    out = tmp_path / "run"
    assert main(["--config", "tiny-mlm", f"data.shards_dir={shards}", f"train.output_dir={out}", "--check"]) == 2
    err = capsys.readouterr().err
    assert f"error: data.shards_dir={shards}: " in err and expected in err, err
    assert f"python -m data_prep.verify {shards}" in err
    assert any(expected in problem for problem in verify_directory(shards))
    assert not out.exists()


def test_format_1_manifests_still_train_checked_by_sha256(tiny_shards_dir, tmp_path, caplog):
    shards = _copy(tiny_shards_dir, tmp_path)

    def to_format_1(raw):
        raw["format_version"] = 1
        del raw["content_hash"]  # format-1 builds predate it
        for shard in raw["shards"]:
            del shard["xxh3_64"]
    _edit_manifest(shards, to_format_1)
    assert verify_directory(shards) == []
    assert run_inprocess("tiny-mlm", shards, tmp_path / "run", "train.total_steps=3") == 0
    assert "manifest format 1 has no xxh3 shard hashes; checking each shard's sha256 instead" in caplog.text

    victim = shards / read_manifest(shards).shards[0].name
    _flip_a_byte(victim)
    with pytest.raises(ShardError, match=f"{victim}: its sha256 differs from manifest.json"):
        ShardDataset(shards).open()


def test_merging_format_1_parts_records_xxh3_hashes(tiny_shards_dir, tmp_path):
    part = _copy(tiny_shards_dir, tmp_path)
    _edit_manifest(part, lambda raw: [raw.update(format_version=1), raw.pop("content_hash")]
                   + [s.pop("xxh3_64") for s in raw["shards"]])
    assert merge_main(["--out", str(tmp_path / "merged"), str(part)]) == 0
    merged = read_manifest(tmp_path / "merged")
    assert merged.format_version == FORMAT_VERSION and all(s.xxh3_64 == xxh3_file(tmp_path / "merged" / s.name) for s in merged.shards)


def test_out_naming_a_regular_file_is_a_clear_error(tiny_corpus_file, tiny_tokenizer_dir, tiny_shards_dir, tmp_path,
                                                     capsys):
    afile = tmp_path / "shards.arrow"
    afile.write_text("not a directory")
    assert build_main(["--input", str(tiny_corpus_file), "--tokenizer", str(tiny_tokenizer_dir), "--out", str(afile),
                       "--no-progress"]) == 2
    assert f"error: --out {afile}: exists and is not a directory" in capsys.readouterr().err
    assert merge_main(["--out", str(afile), str(tiny_shards_dir)]) == 2
    assert f"error: --out {afile}: exists and is not a directory" in capsys.readouterr().err
    assert afile.read_text() == "not a directory"
