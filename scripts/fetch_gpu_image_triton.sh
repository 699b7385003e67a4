#!/usr/bin/env bash
# The GPU image's Triton, unpacked from its PyPI wheel where tests/kernels/test_compile_sm90.py looks
# for it, so that test's "gpu-image" case compiles every kernel for sm_90 with the Triton the GPU
# machines run (older than the one installed here), not only with the installed one. Nothing is
# installed into the environment: the compile process puts the directory first on PYTHONPATH.
# Version and directory come from the test module (one home). Idempotent: a directory that already
# holds the package is left alone; the wheel is unpacked into a sibling temporary directory and
# moved into place, so an interrupted fetch never leaves a half-unpacked package the test would use.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"  # scripts/test.sh passes its virtual environment's
read -r version dest < <(PYTHONPATH=. "$PYTHON" -c \
    'from tests.kernels.test_compile_sm90 import GPU_IMAGE_DIR, GPU_IMAGE_TRITON; print(GPU_IMAGE_TRITON, GPU_IMAGE_DIR)')
if [ -f "$dest/triton/__init__.py" ]; then
    echo "fetch_gpu_image_triton: Triton $version already at $dest"
    exit 0
fi
mkdir -p "$(dirname "$dest")"
tmp=$(mktemp -d "$(dirname "$dest")/.triton-$version.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# `pip install --target` rather than unzipping the wheel by hand: it keeps the executable bit of the
# bundled ptxas / cuobjdump, which the compile test runs.
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: --no-compile \
    --target "$tmp/pkg" "triton==$version"
rm -rf "$dest"
mv "$tmp/pkg" "$dest"
echo "fetch_gpu_image_triton: Triton $version unpacked at $dest"
