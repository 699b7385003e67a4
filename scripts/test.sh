#!/usr/bin/env bash
# The README's test command: installs everything the tests need on a fresh machine (CPU torch pinned
# first so nothing pulls CUDA wheels; Debian's SLURM + munge for the cluster tests; the GPU image's Triton,
# unpacked aside for the sm_90 compile test), then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slurm" tests/data`).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
bash scripts/install_test_deps.sh
bash scripts/fetch_gpu_image_triton.sh  # the GPU image's Triton for tests/kernels/test_compile_sm90.py
if [ "$#" -eq 0 ]; then set -- tests; fi
exec python3 -m pytest -q "$@"
