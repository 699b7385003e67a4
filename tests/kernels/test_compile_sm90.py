"""Every kernel variant compiles for sm_90 (Hopper) without register spills - checked on CPU, with
the installed Triton and with the Triton of the GPU image (3.6), side by side.

The GPU image's Triton is an unpacked wheel in `$CPT_TRITON_GPU_IMAGE` (default
`~/.cache/contrastive-pretrain/triton-3.6.0`), put first on PYTHONPATH of the compile process.
`bash scripts/fetch_gpu_image_triton.sh` puts it there from PyPI (idempotent; `scripts/test.sh`,
and so CI, runs it first); it reads `GPU_IMAGE_TRITON` and `GPU_IMAGE_DIR` from this module.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the Triton version of the GPU image the kernels ship to
GPU_IMAGE_TRITON = "3.6.0"
GPU_IMAGE_DIR = Path(os.environ.get("CPT_TRITON_GPU_IMAGE",
                                    Path.home() / ".cache" / "contrastive-pretrain" / f"triton-{GPU_IMAGE_TRITON}"))
KERNELS = {"_softmax_xent_rows_kernel", "_gathered_forward_kernel", "_gathered_candidate_grad_kernel",
           "_scores_kernel", "_scaled_matmul_kernel", "_row_norms_kernel", "_normalize_backward_kernel"}


def compile_all(triton_dir: str | None) -> tuple[dict, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_dir, str(ROOT)) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.compile_sm90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[0], lines[1:]


@pytest.mark.parametrize("which", ["installed", "gpu-image"])
def test_all_kernel_variants_compile_for_hopper_without_spills(which):
    try:
        import triton.backends.nvidia  # noqa: F401  (holds ptxas)
    except ImportError:
        pytest.skip("this Triton build has no NVIDIA backend")
    triton_dir = None
    if which == "gpu-image":
        if not (GPU_IMAGE_DIR / "triton" / "__init__.py").is_file():
            pytest.skip(f"no Triton {GPU_IMAGE_TRITON} at {GPU_IMAGE_DIR}: bash scripts/fetch_gpu_image_triton.sh")
        triton_dir = str(GPU_IMAGE_DIR)
    version, reports = compile_all(triton_dir)
    if which == "gpu-image":
        assert version["triton"] == GPU_IMAGE_TRITON and version["path"].startswith(str(GPU_IMAGE_DIR)), version
    assert {r["kernel"] for r in reports} == KERNELS
    spilled = [r for r in reports if r["stack_bytes"] > 0]
    assert not spilled, spilled
    assert all(0 < r["registers"] <= 255 for r in reports)
    rows = {r["variant"] for r in reports if r["kernel"] == "_softmax_xent_rows_kernel"}
    # the bf16 row kernel without argmax: COCO-LM's generator loss, MLM with track_accuracy=false
    assert "grad=bf16 bias=True corrective=False write=True argmax=False" in rows
    # the score tiles in the training dtype fit 128 registers (twice the resident warps of 168)
    assert all(r["registers"] <= 128 for r in reports if r["kernel"] == "_scores_kernel" and r["variant"].startswith("bf16"))
