#!/usr/bin/env bash
# The front door: install the package (pinned CPU-friendly torch first) and run the whole pipeline on a
# small default — offline corpus -> tokenizer -> shards -> short pretraining -> Hugging Face -> fill-mask.
#
#   bash scripts/demo.sh                       # default: TACO on this Python's own documentation
#   bash scripts/demo.sh --objective capt      # any objective with a tiny-<objective> preset: mlm, taco, capt, cocolm, infoword, mlm-nce
#   bash scripts/demo.sh --corpus ~/notes      # your own text files / folders instead
#   DEMO_SKIP_INSTALL=1 bash scripts/demo.sh   # already installed: just run
#
# It installs into, and runs with, a virtual environment: .venv in the repository (created on the first
# run; CPT_VENV=DIR for another place, PYTHON=... for an interpreter of your own; scripts/venv.sh).
# Extra pip arguments for torch (e.g. a CPU wheel index) go in TORCH_PIP_ARGS:
#   TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh

if [ "${DEMO_SKIP_INSTALL:-0}" != "1" ]; then
    cpt_python
    cpt_install_torch
    phase "pip install -e . (this package and its dependencies: deepspeed, transformers, datasets, tokenizers, ...)"
    "$PYTHON" -m pip install -q -e .
    took
else
    # already installed: the virtual environment when there is one, else python3 (or PYTHON)
    if [ -z "${PYTHON:-}" ] && [ -x "${CPT_VENV:-$PWD/.venv}/bin/python" ]; then PYTHON="${CPT_VENV:-$PWD/.venv}/bin/python"; fi
    PYTHON="${PYTHON:-python3}"
    echo "== [setup] DEMO_SKIP_INSTALL=1: using the installed package ($PYTHON)"
fi

# Offline by construction: nothing is fetched from a model or dataset hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "== [setup] starting the demo: python -m demo.run $*"
exec "$PYTHON" -m demo.run "$@"
