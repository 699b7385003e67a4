"""`data_prep.merge`: the final step of the SLURM prep job (no cluster needed)."""
from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.build_shards import build_shards
from data_prep.merge import MergeRefused, main, merge_parts
from data_prep.verify import verify_directory
from pipeline.data.shards import MANIFEST_FILE, read_manifest
from tests.fixtures_data import stdlib_documents, write_corpus


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> list[Path]:
    root = tmp_path_factory.mktemp("merge_parts")
    documents = stdlib_documents()[:6]
    parts = []
    for i in range(2):
        corpus = write_corpus(root / f"c{i}.txt", documents[i::2])
        part = root / f"part_{i}"
        build_shards([corpus], tiny_tokenizer_dir, part, seq_len=32, shard_size_mb=0.01, num_proc=1, progress=False)
        parts.append(part)
    return parts


def test_merge_lists_every_part_shard_in_order_and_verifies(two_parts: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged"
    merged = merge_parts(two_parts, out)
    parts = [read_manifest(p) for p in two_parts]
    assert verify_directory(out) == []
    assert [s.sha256 for s in merged.shards] == [s.sha256 for p in parts for s in p.shards]
    assert [s.name for s in merged.shards] == [f"shard_{i:05d}.arrow" for i in range(len(merged.shards))]
    assert merged.total_sequences == sum(p.total_sequences for p in parts)
    assert merged.stats["documents"] == sum(p.stats["documents"] for p in parts)
    assert [r["dir"] for r in merged.build_args["merged_parts"]] == [str(p.resolve()) for p in two_parts]
    # A re-run over the finished merge changes nothing; other parts into it are refused.
    before = (out / MANIFEST_FILE).read_bytes()
    assert merge_parts(two_parts, out).fingerprint == merged.fingerprint
    assert (out / MANIFEST_FILE).read_bytes() == before
    with pytest.raises(MergeRefused, match="different complete shard directory"):
        merge_parts(two_parts[:1], out)


def test_an_interrupted_merge_is_redone(two_parts: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged"
    out.mkdir()
    (out / "shard_00000.arrow").write_bytes(b"half a shard")  # crash before the manifest
    (out / "shard_00000.arrow.tmp").write_bytes(b"")
    merge_parts(two_parts, out)
    assert verify_directory(out) == []


def test_parts_that_disagree_are_refused_naming_part_and_field(
    two_parts: list[Path], tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "seq64"
    build_shards([write_corpus(tmp_path / "c.txt", stdlib_documents()[:2])], tiny_tokenizer_dir, other, seq_len=64, num_proc=1, progress=False)
    with pytest.raises(ValueError, match=rf"{other}: seq_len 64 differs"):
        merge_parts([two_parts[0], other], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before writing anything


def test_an_unfinished_part_is_an_error_naming_it(two_parts: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    unfinished = tmp_path / "part_x"
    unfinished.mkdir()
    assert main(["--out", str(tmp_path / "out"), str(two_parts[0]), str(unfinished)]) == 2
    assert f"{unfinished}: no manifest.json" in capsys.readouterr().err


def test_a_foreign_non_empty_out_is_refused(two_parts: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(MergeRefused, match="not empty"):
        merge_parts(two_parts, out)


@pytest.fixture(scope="module")
def held_out_parts(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """OUTPUT_DIR of the prep job after its shards stage with `BUILD_ARGS=--holdout-fraction 0.3`: two parts, each
    with its held-out documents in `validation/`."""
    root = tmp_path_factory.mktemp("held_out_prep")
    documents = stdlib_documents()[:12]
    for i in range(2):
        corpus = write_corpus(root / f"c{i}.txt", documents[i::2])
        build_shards([corpus], tiny_tokenizer_dir, root / "parts" / f"part_{i:05d}", seq_len=32, num_proc=1,
                     progress=False, holdout_fraction=0.3)
    return root


def test_parts_that_held_out_different_shares_are_refused(held_out_parts: Path, two_parts: list[Path],
                                                          tmp_path: Path) -> None:
    part = held_out_parts / "parts" / "part_00000"
    with pytest.raises(ValueError, match=rf"{two_parts[0]}: held-out rule none differs from {part}'s "
                                         r"--holdout-fraction 0.3 \(train side\)"):
        merge_parts([part, two_parts[0]], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_prep_jobs_merge_stage_merges_the_held_out_parts_into_shards_validation(held_out_parts: Path) -> None:
    """slurm/prep.sbatch's merge stage, run by bash as SLURM would (no cluster needed): the training parts into
    shards/, then the parts' validation/ dirs into shards/validation/, each verified, disjoint by document."""
    import os
    import subprocess
    import sys

    from data_prep.merge import holdout_of
    from pipeline.data.reader import ShardDataset

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PREP_STAGE="merge", OUTPUT_DIR=str(held_out_parts), NUM_PARTS="2", PYTHON=sys.executable,
               CPT_ROOT=str(repo), PYTHONPATH=str(repo))
    out = subprocess.run(["bash", str(repo / "slurm" / "prep.sbatch")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    shards, held = held_out_parts / "shards", held_out_parts / "shards" / "validation"
    assert f"eval.shards_dir={held}" in out.stdout
    assert verify_directory(shards) == [] and verify_directory(held) == []
    parts = [held_out_parts / "parts" / f"part_{i:05d}" for i in range(2)]
    assert read_manifest(held).total_sequences == sum(read_manifest(p / "validation").total_sequences for p in parts) > 0
    assert read_manifest(shards).total_sequences == len(ShardDataset(shards))
    assert holdout_of(read_manifest(shards))["side"] == "train" and holdout_of(read_manifest(held))["side"] == "validation"
    assert holdout_of(read_manifest(held))["fraction"] == 0.3

    # the shards stage refuses a --holdout-dir, which every array task would write (before building anything)
    (held_out_parts / "inputs.txt").write_text(f"{held_out_parts / 'c0.txt'}\n")
    env.update(PREP_STAGE="shards", BUILD_ARGS="--holdout-fraction 0.3 --holdout-dir /tmp/x", NUM_PARTS="1",
               INPUT_LIST=str(held_out_parts / "inputs.txt"), SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_MIN="0",
               SLURM_ARRAY_TASK_MAX="0")
    out = subprocess.run(["bash", str(repo / "slurm" / "prep.sbatch")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "BUILD_ARGS: --holdout-dir: every array task would write" in out.stderr
    # and slurm/submit.sh refuses it before submitting anything (no sbatch needed to get there)
    out = subprocess.run(["bash", str(repo / "slurm" / "submit.sh"), "prep"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "BUILD_ARGS: --holdout-dir: every array task would write" in out.stderr
    assert not (held_out_parts / "logs").exists()  # refused before the first job's log directory
