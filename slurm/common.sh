# Shared by every slurm/*.sbatch (sourced, not executed).
#
# SLURM copies a batch script into its spool directory before running it, so a script cannot
# find its siblings through $0; it sources this file from $CPT_ROOT (default: the directory the
# job was submitted from, which slurm/submit.sh sets to the repository root).

# BUILD_ARGS reach every array task of the prep job's shards stage (slurm/submit.sh checks them before
# submitting, prep.sbatch again in the task): a --holdout-dir would have every part write its held-out
# documents into that one directory; each part holds out into parts/part_<i>/validation/ instead, and the
# merge stage merges those into OUTPUT_DIR/shards/validation/.
check_build_args() {
    case " ${BUILD_ARGS:-} " in
        *" --holdout-dir"*)
            echo "error: BUILD_ARGS: --holdout-dir: every array task would write its held-out part into that one" \
                 "directory; leave it out (with --holdout-fraction the merge job writes OUTPUT_DIR/shards/validation)" >&2
            exit 2 ;;
    esac
}

# Fail with a message that names the variable (before any compute).
require_var() {
    local name=$1 what=$2
    if [ -z "${!name:-}" ]; then
        echo "error: $name is not set: $what" >&2
        echo "       (see docs/slurm.md; e.g. $name=... sbatch --export=ALL slurm/$(job_kind).sbatch)" >&2
        exit 2
    fi
}

job_kind() { printf '%s' "${CPT_JOB_KIND:-<kind>}"; }

# The address other nodes reach NODE at: SLURM's NodeAddr (node names need not resolve).
node_addr() {
    local node=$1 addr
    addr=$(scontrol show node -o "$node" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
    printf '%s\n' "${addr:-$node}"
}

# Rendezvous for torch.distributed, computed once per job and exported to every rank:
# the first node of the allocation and a port derived from the job id and restart count (a
# requeued job gets a fresh port, so a socket of the previous run in TIME_WAIT cannot collide).
export_rendezvous() {
    local first
    # Ranks come from SLURM or MPI inside the job; stale torch variables exported from the
    # submitting shell would override them (pipeline.distributed reads RANK first).
    unset RANK WORLD_SIZE LOCAL_RANK
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_ADDR=${MASTER_ADDR:-$(node_addr "$first")}
    export MASTER_PORT=${MASTER_PORT:-$((20000 + (SLURM_JOB_ID * 8 + ${SLURM_RESTART_COUNT:-0}) % 40000))}
}

# Threads per rank: the CPUs SLURM gave each task (1 unless --cpus-per-task), not every core.
export_threads() {
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    export MKL_NUM_THREADS=${MKL_NUM_THREADS:-$OMP_NUM_THREADS}
    export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
    # Nothing is downloaded at run time: tokenizers and data are local.
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}

# "GPU" when the allocation has GPUs on this node, "CPU" otherwise (the ranks then use gloo;
# pipeline.distributed picks nccl/gloo itself from torch.cuda.is_available()).
device_kind() {
    if [ "${SLURM_GPUS_ON_NODE:-0}" != "0" ] || { [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != "NoDevFiles" ]; }; then
        echo GPU
    else
        echo CPU
    fi
}

# The mpirun for LAUNCHER=mpirun: $MPIRUN, else the one beside the interpreter (the PyPI package
# `mpich` installs it into the environment's bin/, which need not be on PATH when the environment
# is used through its interpreter), else the first on PATH; an error saying what to install if none.
find_mpirun() {
    local beside
    if [ -n "${MPIRUN:-}" ]; then
        printf '%s\n' "$MPIRUN"
        return
    fi
    beside="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null)/mpirun"
    if [ -x "$beside" ]; then
        printf '%s\n' "$beside"
    elif command -v mpirun >/dev/null 2>&1; then
        command -v mpirun
    else
        echo "error: LAUNCHER=mpirun: no mpirun beside PYTHON=$PYTHON (${beside%/mpirun}/) nor on PATH;" \
            "install MPICH into that environment ($PYTHON -m pip install mpich) or set MPIRUN=/path/to/mpirun" >&2
        return 2
    fi
}

# Container flags for srun on pyxis/enroot sites: CONTAINER_IMAGE, CONTAINER_MOUNTS (the repository
# checkout, CPT_ROOT, and the data/output paths must be mounted at the same paths) and
# CONTAINER_ARGS (any other --container-* flags, space-separated). Sets CONTAINER_FLAGS (an array).
set_container_flags() {
    CONTAINER_FLAGS=()
    [ -n "${CONTAINER_IMAGE:-}" ] && CONTAINER_FLAGS+=("--container-image=$CONTAINER_IMAGE")
    [ -n "${CONTAINER_MOUNTS:-}" ] && CONTAINER_FLAGS+=("--container-mounts=$CONTAINER_MOUNTS")
    # shellcheck disable=SC2206  # CONTAINER_ARGS is a list of flags
    [ -n "${CONTAINER_ARGS:-}" ] && CONTAINER_FLAGS+=(${CONTAINER_ARGS})
    return 0
}

# LAUNCH_CMD=(launcher ... run_rank.sh LOG_DIR COMMAND...): COMMAND once per task of the
# allocation, each rank logging to LOG_DIR/rank<R>.log through slurm/run_rank.sh.
# LAUNCHER=srun (default) or mpirun (MPICH/Open MPI; inside an allocation they start their
# per-node proxies with srun themselves). No --kill-on-bad-exit: it would kill ranks that are
# still writing their part of a preemption checkpoint, and hide their exit codes. Instead
# `srun --wait=EXIT_WAIT` (default 120 s) ends the remaining ranks that long after the first one
# exited: all ranks of a healthy run leave within seconds of each other (they pass the same
# final barrier), so only ranks stuck on a dead peer are ended (train.dist_timeout_s bounds the
# wait of the others).
set_launch_cmd() {
    local log_dir=$1 mpirun
    shift
    set_container_flags
    case "${LAUNCHER:-srun}" in
        srun) LAUNCH_CMD=(srun --kill-on-bad-exit=0 --wait="${EXIT_WAIT:-120}" "${CONTAINER_FLAGS[@]}") ;;
        mpirun)
            if [ "${#CONTAINER_FLAGS[@]}" -gt 0 ]; then
                echo "error: CONTAINER_IMAGE/CONTAINER_MOUNTS/CONTAINER_ARGS are srun (pyxis) flags; use LAUNCHER=srun" >&2
                exit 2
            fi
            mpirun=$(find_mpirun) || exit 2
            LAUNCH_CMD=("$mpirun" -np "${SLURM_NTASKS:-$SLURM_NNODES}")
            ;;
        *)
            echo "error: LAUNCHER=${LAUNCHER}: expected srun or mpirun" >&2
            exit 2
            ;;
    esac
    LAUNCH_CMD+=(bash "$CPT_ROOT/slurm/run_rank.sh" "$log_dir" "$@")
}

# Preemption signals are recorded from a batch script's first line on (`trap_preemption`) and, while
# the ranks run, passed on to them (`run_ranks_preemptible`): a signal at any moment is never fatal
# to the script. PREEMPTED = the first signal received (USR1 or TERM), PREEMPT_TERMINATED=1 after TERM.
trap_preemption() {
    trap 'PREEMPTED=${PREEMPTED:-USR1}' USR1
    trap 'PREEMPTED=${PREEMPTED:-TERM}; PREEMPT_TERMINATED=1' TERM
}

# The launcher in the background while this shell waits, so it can act on signals:
#   USR1 (--signal=B:USR1@SECS before the time limit, or `scancel --batch --signal=USR1`):
#        passed on to the ranks (srun forwards USR1 to every task; mpirun forwards only TERM),
#        which checkpoint and exit with the requeue code;
#   TERM (scancel, or SLURM preempting/requeueing the job itself): passed on the same way, and
#        remembered in PREEMPT_TERMINATED=1 so the caller does not requeue a cancelled job.
# Sets LAUNCH_RC to the launcher's exit status. Afterwards signals are recorded only (trap_preemption).
run_ranks_preemptible() {
    LAUNCHER_PID=
    trap 'PREEMPTED=${PREEMPTED:-USR1}; forward_signal USR1' USR1
    trap 'PREEMPTED=${PREEMPTED:-TERM}; PREEMPT_TERMINATED=1; forward_signal TERM' TERM
    set_launch_cmd "$@"
    "${LAUNCH_CMD[@]}" &
    LAUNCHER_PID=$!
    # `wait` returns early (status > 128) when a trapped signal arrives; wait again until the
    # launcher has really exited, then collect its status.
    while kill -0 "$LAUNCHER_PID" 2>/dev/null; do
        wait "$LAUNCHER_PID"
    done
    wait "$LAUNCHER_PID"
    LAUNCH_RC=$?
    LAUNCHER_PID=
    trap_preemption
}

forward_signal() { # SIGNAL: tell the ranks started by the launcher LAUNCHER_PID
    local sig=$1
    [ "${LAUNCHER:-srun}" = mpirun ] && sig=TERM # Hydra/ORTE forward TERM to the ranks, not USR1
    echo "== $(date '+%F %T') received $1: sending $sig to the ranks (launcher pid ${LAUNCHER_PID:-not started})"
    [ -n "${LAUNCHER_PID:-}" ] && kill -s "$sig" "$LAUNCHER_PID" 2>/dev/null
    return 0
}

# What an exit status of pipeline.train (or of a rank killed by a signal) means.
explain_exit() {
    local code=$1 sig
    case "$code" in
        0) echo "success" ;;
        1) echo "Python error: see the traceback in the rank log" ;;
        2) echo "bad config, data or checkpoint: nothing was computed" ;;
        3) echo "stopped by the non-finite / divergence guard: nothing exploded was saved; the message names the last good checkpoint" ;;
        4) echo "output not writable (disk full, read-only, not a directory): the previous checkpoint is still latest" ;;
        5) echo "another rank died or hung: the message names it" ;;
        75) echo "checkpointed for requeue after SIGTERM/SIGUSR1" ;;
        none) echo "no exit status: the rank's shell was killed, or never started" ;;
        *)
            if [ "$code" -gt 128 ] 2>/dev/null; then
                sig=$(kill -l $((code - 128)) 2>/dev/null || echo "signal $((code - 128))")
                case "$sig" in
                    KILL) echo "killed by SIGKILL: out of memory (OOM killer), or ended by srun after another rank exited" ;;
                    TERM) echo "killed by SIGTERM (scancel, or srun ending the ranks after another one exited)" ;;
                    USR1) echo "killed by SIGUSR1 before its preemption handler was installed" ;;
                    ABRT) echo "aborted (SIGABRT): e.g. NCCL's watchdog after a collective timed out" ;;
                    SEGV | BUS | ILL) echo "crashed (SIG$sig)" ;;
                    *) echo "killed by SIG$sig" ;;
                esac
            else
                echo "failed"
            fi
            ;;
    esac
}

# The first error line of the latest run in a rank log: `error: ...` (pipeline's own messages) or
# the first exception line of a traceback (`SomethingError: ...`, at the start of a line, after
# the `[rankN]: ` prefix torch.distributed puts on uncaught tracebacks).
first_error_line() {
    awk '/^=== .* rank [0-9]+ host /{found = ""}
         found == "" && /^(\[rank[0-9]+\]: )?(error: |([A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*(Error|Exception|Interrupt)(: |$))/{found = $0}
         END {print found}' "$1" 2>/dev/null | cut -c1-400
}

# One line per rank that did not exit 0: its exit status, what that means, and its first error line.
report_ranks() {
    local log_dir=$1 n=$2 r code line
    for ((r = 0; r < n; r++)); do
        code=$(cat "$log_dir/rank$r.exit" 2>/dev/null || echo none)
        [ "$code" = 0 ] && continue
        line=$(first_error_line "$log_dir/rank$r.log")
        echo "   rank $r: exit $code ($(explain_exit "$code"))${line:+: $line}"
    done
}

# "rank0=75 rank1=1 ..." from LOG_DIR/rank<R>.exit (ranks that wrote none are left out).
rank_exit_codes() {
    local f
    for f in "$1"/rank*.exit; do
        [ -f "$f" ] && printf '%s=%s ' "$(basename "${f%.exit}")" "$(cat "$f")"
    done
    echo
}

# "yes" if every one of N ranks wrote exit status CODE in LOG_DIR, else "no".
all_ranks_exited_with() {
    local log_dir=$1 n=$2 code=$3 r
    for ((r = 0; r < n; r++)); do
        [ "$(cat "$log_dir/rank$r.exit" 2>/dev/null)" = "$code" ] || { echo no; return; }
    done
    echo yes
}

# "yes" if every one of N ranks exited with CODE or was killed by a signal (or left no status),
# and at least one with CODE: after a preemption, ranks that were still starting (or waiting for a
# peer that died of the signal before its handler was installed) may be ended by srun; nothing
# they did can have damaged `latest`, which only ever names a complete checkpoint.
all_ranks_stopped_with() {
    local log_dir=$1 n=$2 code=$3 r status seen=no
    for ((r = 0; r < n; r++)); do
        status=$(cat "$log_dir/rank$r.exit" 2>/dev/null || echo none)
        if [ "$status" = "$code" ]; then
            seen=yes
        elif [ "$status" != none ] && ! [ "$status" -gt 128 ] 2>/dev/null; then
            echo no
            return
        fi
    done
    echo "$seen"
}

PYTHON=${PYTHON:-python3}
