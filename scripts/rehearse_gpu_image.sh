#!/usr/bin/env bash
# The GPU suite's CPU rehearsal and the CPU tests of the code it runs, under the GPU image's torch and
# Triton (../shared/gpu/README.md: torch 2.11, Triton 3.6; this checkout develops on newer ones), so that a
# lease never meets an API difference first. Not CI and not the project's environment: a virtual
# environment of its own (CPT_GPU_IMAGE_VENV, default ~/.cache/contrastive-pretrain/venv-torch-<version>;
# reused), into which PyPI's torch wheel pulls its CUDA libraries (about 4.5 GB, once). The Triton it gets
# is checked against tests/kernels/test_compile_sm90.py's GPU_IMAGE_TRITON (one home of that version).
#
#   bash scripts/rehearse_gpu_image.sh [OUT]      # OUT: the dry run's files (default /tmp/gpu-image-rehearsal)
#
# NumPy is held below 2.4 there: the Triton 3.6 interpreter (TRITON_INTERPRET=1, how every kernel runs on
# a CPU) converts one-element arrays with int(), which NumPy 2.4 refuses ("only 0-dimensional arrays can be
# converted to Python scalars"; every kernel fails). The GPU image compiles its kernels, so this concerns
# the rehearsal only. Extra arguments after OUT go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_IMAGE_TORCH="${GPU_IMAGE_TORCH:-2.11.0}"
VENV="${CPT_GPU_IMAGE_VENV:-$HOME/.cache/contrastive-pretrain/venv-torch-$GPU_IMAGE_TORCH}"
OUT="${1:-/tmp/gpu-image-rehearsal}"
shift || true
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\nnumpy<2.4\n' "$GPU_IMAGE_TORCH" > "$constraints"
if [ ! -x "$VENV/bin/python" ]; then
    echo "== [setup] a virtual environment for the GPU image's versions: $VENV"
    python3 -m venv "$VENV"
fi
echo "== [setup] torch $GPU_IMAGE_TORCH (with its Triton) and the package's dependencies"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$GPU_IMAGE_TORCH" -c "$constraints"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]" -c "$constraints"
want=$(PYTHONPATH=. "$VENV/bin/python" -c 'from tests.kernels.test_compile_sm90 import GPU_IMAGE_TRITON; print(GPU_IMAGE_TRITON)')
have=$("$VENV/bin/python" -c 'import triton; print(triton.__version__)')
"$VENV/bin/python" -c 'import torch, triton, numpy; print(f"rehearse_gpu_image: torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")'
if [ "$have" != "$want" ]; then
    echo "rehearse_gpu_image: torch $GPU_IMAGE_TORCH brought Triton $have, the image has $want (tests/kernels/test_compile_sm90.py): set GPU_IMAGE_TORCH to the image's torch" >&2
    exit 2
fi
echo "== [1/2] python -m benchmarks.gpu_suite --dry-run --out $OUT"
PYTHONPATH=$PWD "$VENV/bin/python" -m benchmarks.gpu_suite --dry-run --out "$OUT"
echo "== [2/2] the CPU tests of the code the suite runs (kernels, model, objectives, training)"
PYTHONPATH=$PWD "$VENV/bin/python" -m pytest -q -p no:randomly tests/kernels tests/model tests/objectives tests/train \
    -m "not slurm" "$@"
