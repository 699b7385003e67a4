"""The kernel benchmark's --small mode runs end to end (kernels in the Triton interpreter on CPU)
and writes a well-formed report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_small_mode_writes_report(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    ops = "linear_cross_entropy,token_contrastive_loss,sequence_contrastive_loss"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench_kernels", "--small", "--device", "cpu", "--impls", "torch,triton",
         "--ops", ops, "--warmup", "1", "--repeats", "1", "--out", str(tmp_path), "--name", "smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    rows = report["rows"]
    assert [(r["op"], r["impl"]) for r in rows] == [(op, impl) for op in ops.split(",") for impl in ("torch", "triton")]
    for row in rows:
        assert "error" not in row, row
        assert row["ms"] > 0 and row["peak_mib"] is None  # no CUDA: time only
        assert row["speedup_vs_eager"] == pytest.approx(rows[[r["op"] for r in rows].index(row["op"])]["ms"] / row["ms"])
    assert {t["op"] for t in report["targets"]} == set(ops.split(","))
    assert all(t["passed"] is None for t in report["targets"])  # targets are judged on a GPU only
    assert report["hardware"]["device"] == "cpu"
    table = (tmp_path / "smoke.md").read_text()
    assert "| label | op | impl |" in table and "token_contrastive_loss/triton" in table
    assert (tmp_path / "smoke.png").stat().st_size > 1000
    assert "speedup_vs_eager" in proc.stdout


def test_full_shapes_are_refused_on_cpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench_kernels", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "use --small" in proc.stderr


def test_shared_negative_case_counts_every_token_of_the_other_sequences() -> None:
    """`sampled_softmax_shared`: InfoWord's `num_negatives: all` layout, checked against a direct count."""
    import torch

    from benchmarks.kernels.bench_kernels import SHAPES, build_case

    shape = {**SHAPES["small"], "batch": 3}
    args, grads, _ = build_case("sampled_softmax_shared", shape, torch.device("cpu"), torch.float32, seed=3)
    hidden, weight, bias, targets, negative_ids, counts, groups = args
    assert grads == [0, 1, 2] and hidden.shape[0] == targets.shape[0] == groups.shape[0]
    assert torch.equal(negative_ids, negative_ids.unique())  # distinct, sorted
    assert sorted(groups.unique().tolist()) == [0, 1, 2]
    # rebuild the batch's tokens from the same generator stream and count them per other group
    gen = torch.Generator().manual_seed(3)
    rows = targets.shape[0]
    torch.randn(rows, shape["hidden"], generator=gen), torch.randn(shape["vocab"], shape["hidden"], generator=gen)
    torch.randn(shape["vocab"], generator=gen), torch.randint(0, shape["vocab"], (rows,), generator=gen)
    tokens = torch.randint(0, shape["vocab"], (rows,), generator=gen)
    for g in range(3):
        others = tokens[groups != g]
        expected = torch.stack([(others == u).sum() for u in negative_ids])
        assert torch.equal(counts[g], expected)
    assert counts.sum() == 2 * rows  # each token is a negative for the two other sequences
