#!/usr/bin/env bash
# The README's test command: installs everything the tests need on a fresh machine into a virtual
# environment (.venv in the repository, created on the first run; CPT_VENV / PYTHON: scripts/venv.sh):
# CPU torch pinned first so nothing pulls CUDA wheels, the package with its test tools; Debian's SLURM +
# munge (system packages, root or sudo) only when the selected tests include tests marked slurm, said
# before it installs, declined with CPT_NO_SYSTEM_PACKAGES=1 (scripts/install_test_deps.sh); the GPU
# image's Triton, unpacked aside for the sm_90 compile test; then runs pytest with that environment's Python.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not slurm" tests/data`, which installs
# nothing system-wide; a random order: `bash scripts/test.sh -p randomly tests`, docs/development.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
cpt_python
cpt_install_torch
phase 'pip install -e ".[dev]" (the package, its dependencies and the test tools)'
"$PYTHON" -m pip install -q -e ".[dev]"
took
if [ "$#" -eq 0 ]; then set -- tests; fi
PYTHON="$PYTHON" bash scripts/install_test_deps.sh "$@"  # SLURM + munge only if the selection has slurm tests
PYTHON="$PYTHON" bash scripts/fetch_gpu_image_triton.sh  # the GPU image's Triton for tests/kernels/test_compile_sm90.py
exec "$PYTHON" -m pytest -q "$@"
