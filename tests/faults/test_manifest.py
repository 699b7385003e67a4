"""Class 2, what training uses is what was verified: every manifest field training reads is covered
by the manifest's `content_hash` and the shard list is checked against the directory, at training
start (exit 2, before compute) and by `cpt-verify` alike; the data identity recorded in checkpoints
depends on what a build produced, not on how it ran (`num_proc`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from data_prep.build_shards import build_shards
from data_prep.verify import main as verify_main
from pipeline.data.shards import MANIFEST_FILE, Manifest, content_hash, manifest_file_sha256, manifest_hash, read_manifest
from pipeline.io import hash_directory
from pipeline.train.cli import EXIT_CONFIG_ERROR
from pipeline.train.run_meta import RunMeta
from tests.faults.faults import copy_shards, error_line
from tests.fixtures_data import TINY_SEQ_LEN
from tests.train.runs import latest, losses, run_inprocess, tag_dir


def edit_manifest(directory: Path, edit) -> None:
    path = directory / MANIFEST_FILE
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw, indent=2))


def refused(shards: Path, tmp_path: Path, capsys, expected: str) -> None:
    """Training refuses before compute and cpt-verify fails, both with `expected` in the message."""
    out = tmp_path / "run"
    assert run_inprocess("tiny-mlm", shards, out, "train.total_steps=3") == EXIT_CONFIG_ERROR
    message = error_line(capsys.readouterr().err)
    assert message.startswith(f"data.shards_dir={shards}: ") and expected in message, message
    assert not (out / "checkpoints").exists()
    assert verify_main([str(shards)]) == 1
    assert expected in capsys.readouterr().err


def test_a_hand_edited_mask_id_is_refused(tiny_shards_dir, tmp_path, capsys):
    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")
    mask = read_manifest(shards).special_tokens["mask"]
    edit_manifest(shards, lambda raw: raw["special_tokens"].update(mask=mask + 1))
    refused(shards, tmp_path, capsys, f"manifest.json: special_tokens.mask={mask + 1}, but the tokenizer's [MASK] is "
                                      f"id {mask}")


def test_an_edited_field_without_a_tokenizer_to_compare_is_caught_by_the_content_hash(tiny_shards_dir, tmp_path,
                                                                                      capsys):
    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")
    edit_manifest(shards, lambda raw: raw["special_tokens"].update(cls=raw["special_tokens"]["sep"]))
    (shards / "tokenizer" / "special_tokens_map.json").unlink()
    (shards / "tokenizer" / "tokenizer_config.json").unlink()  # nothing names [CLS] any more
    edit_manifest(shards, lambda raw: raw.update(tokenizer_hash=hash_directory(shards / "tokenizer")))
    refused(shards, tmp_path, capsys, "manifest.json: edited after the build: the fields training reads")


def test_an_edit_that_also_blanks_the_content_hash_is_refused(tiny_shards_dir, tmp_path, capsys):
    """A format-3 manifest always carries its hash: an edit (here the sequence totals) that empties it
    is refused, not read as a manifest from before the hash existed."""
    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")
    edit_manifest(shards, lambda raw: raw.update(total_tokens=raw["total_tokens"] + 1, content_hash=""))
    refused(shards, tmp_path, capsys, "manifest.json: content_hash is empty, but every format 3 build writes it")


def test_a_shard_dropped_from_the_manifest_is_refused(tiny_shards_dir, tmp_path, capsys):
    shards = copy_shards(tiny_shards_dir, tmp_path / "shards")

    def drop_last(raw):  # totals adjusted, and the hash recomputed too: the directory still tells
        gone = raw["shards"].pop()
        raw["total_sequences"] -= gone["rows"]
        raw["content_hash"] = content_hash(Manifest.from_dict(raw))
    edit_manifest(shards, drop_last)
    name = read_manifest(tiny_shards_dir).shards[-1].name  # the file stays, the manifest forgets it
    refused(shards, tmp_path, capsys, f"{shards / name}: in the directory but not in manifest.json")


def test_byte_identical_builds_with_another_num_proc_are_the_same_data(tiny_corpus_file, tiny_tokenizer_dir, tmp_path,
                                                                      capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    for out, procs in ((one, 1), (two, 2)):
        build_shards([tiny_corpus_file], tiny_tokenizer_dir, out, seq_len=TINY_SEQ_LEN, shard_size_mb=0.01,
                     num_proc=procs, progress=False)
    a, b = read_manifest(one), read_manifest(two)
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]  # the same bytes ...
    assert manifest_file_sha256(one) != manifest_file_sha256(two)  # ... recorded with other build_args
    assert manifest_hash(one) == manifest_hash(two) == a.content_hash == content_hash(b)
    run = tmp_path / "run"
    steps = ["train.total_steps=4", "train.checkpoint_every=2", "train.keep_last=5"]
    assert run_inprocess("tiny-mlm", one, run, *steps) == 0
    assert RunMeta.read(latest(run)).manifest_hash == a.content_hash
    reference = losses(run)
    shutil.rmtree(tag_dir(run, 4))  # back to step 2, as if the run had stopped there
    (run / "checkpoints" / "latest").write_text("step_00000002")
    assert run_inprocess("tiny-mlm", two, run, *steps) == 0  # the same data, built with num_proc=2
    assert losses(run) == reference and "data manifest" not in capsys.readouterr().err
