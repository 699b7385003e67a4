"""Shard directories open with the usual `datasets` and pyarrow calls, and older (IPC file framed)
shards stay readable by the pipeline's reader."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.data.reader import ShardDataset
from pipeline.data.shards import (
    MANIFEST_FILE,
    check_layout,
    read_manifest,
    shard_schema,
)
from pipeline.io import sha256_file, xxh3_file


def rows_of(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    dataset = ShardDataset(directory)
    return dataset.take(np.arange(len(dataset)))


def test_a_shard_directory_opens_with_load_from_disk(tiny_shards_dir):
    import datasets

    ids, starts = rows_of(tiny_shards_dir)
    loaded = datasets.load_from_disk(str(tiny_shards_dir))
    assert loaded.column_names == ["input_ids", "word_starts", "length"] and len(loaded) == len(ids)
    table = loaded.with_format("numpy")
    assert np.array_equal(np.stack(table["input_ids"]), ids)  # every row, in the pipeline's order
    assert np.array_equal(np.stack(table["word_starts"]), starts)
    assert loaded.features["input_ids"].length == read_manifest(tiny_shards_dir).seq_len


def test_one_shard_opens_with_dataset_from_file_and_pyarrow(tiny_shards_dir):
    import datasets

    manifest = read_manifest(tiny_shards_dir)
    first = tiny_shards_dir / manifest.shards[0].name
    ids, _ = rows_of(tiny_shards_dir)
    one = datasets.Dataset.from_file(str(first))
    assert len(one) == manifest.shards[0].rows
    assert one[3]["input_ids"] == ids[3].tolist()
    with pa.memory_map(str(first)) as source:
        table = pa.ipc.open_stream(source).read_all()
    assert table.schema.equals(shard_schema(manifest.seq_len, manifest.id_dtype))
    assert table.column("input_ids").to_pylist()[3] == ids[3].tolist()


def rewrite_as_ipc_file(directory: Path) -> None:
    """Turn a shard directory into what the writer produced before the stream framing: Arrow IPC
    *file* shards, no datasets files, the manifest's sizes and hashes of those files."""
    manifest = read_manifest(directory)
    infos = []
    for info in manifest.shards:
        path = directory / info.name
        table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()  # in memory: the file is rewritten
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        assert path.read_bytes()[:6] == b"ARROW1"
        infos.append(dataclasses.replace(info, bytes=path.stat().st_size, sha256=sha256_file(path),
                                         xxh3_64=xxh3_file(path)))
    (directory / "state.json").unlink()
    (directory / "dataset_info.json").unlink()
    (directory / MANIFEST_FILE).write_text(dataclasses.replace(manifest, shards=infos).to_json())


def test_older_ipc_file_shards_read_the_same(tiny_shards_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_shards_dir, old)
    rewrite_as_ipc_file(old)
    assert check_layout(old, read_manifest(old)) == []
    new_ids, new_starts = rows_of(tiny_shards_dir)
    old_ids, old_starts = rows_of(old)  # verify=True: sizes, xxh3 and schema of the file-framed shards
    assert np.array_equal(old_ids, new_ids) and np.array_equal(old_starts, new_starts)


def test_merged_directory_opens_with_load_from_disk(tiny_shards_dir, tmp_path):
    import datasets

    from data_prep.merge import merge_parts

    second = tmp_path / "part1"
    shutil.copytree(tiny_shards_dir, second)
    merged = merge_parts([tiny_shards_dir, second], tmp_path / "merged")
    state = json.loads((tmp_path / "merged" / "state.json").read_text())
    assert [f["filename"] for f in state["_data_files"]] == [s.name for s in merged.shards]
    assert len(datasets.load_from_disk(str(tmp_path / "merged"))) == 2 * len(ShardDataset(tiny_shards_dir))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_shard_is_a_clear_error(tiny_shards_dir, tmp_path, damage):
    from pipeline.data.shards import ShardError, read_footer

    bad = tmp_path / "bad.arrow"
    data = (tiny_shards_dir / read_manifest(tiny_shards_dir).shards[0].name).read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00" * 64)
    with pytest.raises(ShardError, match=str(bad)):
        read_footer(bad)
