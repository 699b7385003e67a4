# Sourced by scripts/demo.sh and scripts/test.sh (and so by .ci/run): the virtual environment the
# README's two commands install into and run with, never the machine's own python3 (a Debian or Ubuntu
# system Python refuses `pip install` outright, PEP 668; any other one would mix our pins with whatever
# was installed by hand). One home for choosing the interpreter and for the pinned torch install.
#
#   CPT_VENV=DIR      the virtual environment (default: .venv in the repository, git-ignored); created
#                     with `python3 -m venv` when missing, reused afterwards
#   CPT_BASE_PYTHON   the interpreter that creates it (default: python3; needs Python >= 3.10)
#   PYTHON=...        an interpreter of your own instead (an environment you manage): used as it is,
#                     no virtual environment is created
#   TORCH_PIP_ARGS    extra pip arguments for torch, e.g. "--index-url https://download.pytorch.org/whl/cpu"
#
# After `cpt_python`, $PYTHON is the interpreter to use (and the environment's bin/ leads PATH).

TORCH_VERSION=2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Every phase says what it is doing before it starts, and how long it took.
phase() { echo "== [setup] $*"; PHASE_START=$SECONDS; }
took() { echo "   done in $((SECONDS - PHASE_START))s"; }

# Sets PYTHON: the user's own interpreter when PYTHON is set, else the virtual environment CPT_VENV
# (created when missing; a half-created one, without pip, is created again).
cpt_python() {
    if [ -n "${PYTHON:-}" ]; then
        echo "== [setup] PYTHON=$PYTHON: using that interpreter as it is (no virtual environment created)"
        return 0
    fi
    local dir="${CPT_VENV:-$PWD/.venv}" base="${CPT_BASE_PYTHON:-python3}"
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
        echo "== [setup] using the virtual environment $dir"
    else
        if [ -e "$dir" ] && [ ! -f "$dir/pyvenv.cfg" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
            echo "error: CPT_VENV=$dir exists and is not a virtual environment; choose another CPT_VENV" >&2
            exit 1
        fi
        phase "creating the virtual environment $dir ($base -m venv; set CPT_VENV to put it elsewhere)"
        if ! "$base" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
            echo "error: $base is not Python >= 3.10; set CPT_BASE_PYTHON to one that is" >&2
            exit 1
        fi
        if ! "$base" -m venv --clear "$dir"; then
            echo "error: '$base -m venv $dir' failed; on Debian/Ubuntu install the venv module first" \
                 "(apt-get install python3-venv), or set PYTHON to an interpreter of your own" >&2
            exit 1
        fi
        took
    fi
    PYTHON="$dir/bin/python"
    # as `source $dir/bin/activate` would: what the run starts by name (python3, cpt-*, the mpich wheel's
    # mpirun, a job script's PYTHON default) is the environment's too, not the machine's
    export VIRTUAL_ENV="$dir" PATH="$dir/bin:$PATH"
}

# torch first and pinned: installing the package alone would let pip pick an unpinned torch.
cpt_install_torch() {
    if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
        echo "== [setup] torch $TORCH_VERSION already installed"
        return 0
    fi
    phase "pip install torch==$TORCH_VERSION ${TORCH_PIP_ARGS:-} (a large download on a fresh machine: typically one to several minutes)"
    # shellcheck disable=SC2086 - TORCH_PIP_ARGS is a list of words on purpose
    "$PYTHON" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
    took
}
