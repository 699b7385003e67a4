#!/usr/bin/env bash
# The front door: install the package (pinned CPU-friendly torch first) and run the whole pipeline on a
# small default — offline corpus -> tokenizer -> shards -> short pretraining -> Hugging Face -> fill-mask.
#
#   bash scripts/demo.sh                       # default: TACO on this Python's own documentation
#   bash scripts/demo.sh --objective capt      # any objective with a tiny-<objective> preset: mlm, taco, capt, cocolm, infoword
#   bash scripts/demo.sh --corpus ~/notes      # your own text files / folders instead
#   DEMO_SKIP_INSTALL=1 bash scripts/demo.sh   # already installed: just run
#
# Extra pip arguments for torch (e.g. a CPU wheel index) go in TORCH_PIP_ARGS:
#   TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Every phase says what it is doing before it starts, and how long it took.
phase() { echo "== [setup] $*"; PHASE_START=$SECONDS; }
took() { echo "   done in $((SECONDS - PHASE_START))s"; }
if [ "${DEMO_SKIP_INSTALL:-0}" != "1" ]; then
    # torch first and pinned: installing the package alone would let pip pick an unpinned torch.
    if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
        phase "pip install torch==2.13.0 ${TORCH_PIP_ARGS:-} (a large download on a fresh machine: typically one to several minutes)"
        # shellcheck disable=SC2086 - TORCH_PIP_ARGS is a list of words on purpose
        "$PYTHON" -m pip install -q "torch==2.13.0" ${TORCH_PIP_ARGS:-}
        took
    else
        echo "== [setup] torch 2.13.0 already installed"
    fi
    phase "pip install -e . (this package and its dependencies: deepspeed, transformers, datasets, tokenizers, ...)"
    "$PYTHON" -m pip install -q -e .
    took
else
    echo "== [setup] DEMO_SKIP_INSTALL=1: using the installed package"
fi

# Offline by construction: nothing is fetched from a model or dataset hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "== [setup] starting the demo: python -m demo.run $*"
exec "$PYTHON" -m demo.run "$@"
