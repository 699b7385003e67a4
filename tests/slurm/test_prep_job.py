"""`slurm/submit.sh prep`: tokenizer job -> shard job array (one task per input part) -> merge + verify."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from data_prep.verify import verify_directory
from pipeline.data.reader import ShardDataset
from pipeline.data.shards import read_manifest
from tests.fixtures_data import stdlib_documents, write_corpus
from tests.slurm.cluster import SlurmCluster
from tests.slurm.conftest import REPO_ROOT

pytestmark = pytest.mark.slurm


def _submit(cluster: SlurmCluster, kind: str, env: dict[str, str], *flags: str) -> dict[str, str]:
    out = subprocess.run(
        ["bash", str(REPO_ROOT / "slurm" / "submit.sh"), kind, *flags],
        env=dict(cluster.env, **env), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.split())


def test_prep_array_job_builds_parts_merges_and_verifies(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    documents = stdlib_documents()
    inputs = [write_corpus(tmp_path / f"corpus_{i}.txt", documents[i::3]) for i in range(3)]
    input_list = tmp_path / "inputs.txt"
    input_list.write_text("# three parts of the corpus\n" + "\n".join(map(str, inputs)) + "\n\n")
    prep_dir = tmp_path / "prep"
    env = {
        "INPUT_LIST": str(input_list), "OUTPUT_DIR": str(prep_dir), "NUM_PARTS": "2", "SEQ_LEN": "64",
        "TOKENIZER_ARGS": "--vocab-size 800", "BUILD_ARGS": "--shard-size-mb 0.02",
    }
    jobs = _submit(slurm_cluster, "prep", env)
    assert set(jobs) == {"tokenizer", "shards", "merge"}
    merge = slurm_cluster.wait_job(jobs["merge"], timeout_s=180)
    logs = "\n".join(p.read_text() for p in sorted((prep_dir / "logs").glob("*.out")))
    assert (merge.state, merge.exit_code) == ("COMPLETED", 0), logs
    # Both array tasks ran (and succeeded: the merge depends on afterok of the whole array).
    assert len(list((prep_dir / "logs").glob("*-shards-*_*.out"))) == 2

    shards = prep_dir / "shards"
    assert verify_directory(shards) == []
    assert f"OK {shards}" in logs
    merged = read_manifest(shards)
    parts = [read_manifest(prep_dir / "parts" / f"part_{i:05d}") for i in range(2)]
    # Contiguous slices: part 0 holds input 0, part 1 inputs 1 and 2.
    assert [[Path(s["path"]).name for s in p.sources] for p in parts] == [["corpus_0.txt"], ["corpus_1.txt", "corpus_2.txt"]]
    assert merged.total_sequences == sum(p.total_sequences for p in parts) == len(ShardDataset(shards))
    assert merged.total_tokens == sum(p.total_tokens for p in parts)
    assert [s.sha256 for s in merged.shards] == [s.sha256 for p in parts for s in p.shards]
    assert len(merged.shards) > 2  # several shards per part: the renaming is exercised
    assert merged.tokenizer_hash == parts[0].tokenizer_hash == parts[1].tokenizer_hash
