# Shared by every slurm/*.sbatch (sourced, not executed).
#
# SLURM copies a batch script into its spool directory before running it, so a script cannot
# find its siblings through $0; it sources this file from $CPT_ROOT (default: the directory the
# job was submitted from, which slurm/submit.sh sets to the repository root).

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

# LAUNCH_CMD=(launcher ... run_rank.sh LOG_DIR COMMAND...): COMMAND once per task of the
# allocation, each rank logging to LOG_DIR/rank<R>.log through slurm/run_rank.sh.
# LAUNCHER=srun (default) or mpirun (MPICH/Open MPI; inside an allocation they start their
# per-node proxies with srun themselves). No --kill-on-bad-exit: it would kill ranks that are
# still writing their part of a preemption checkpoint, and hide their exit codes.
set_launch_cmd() {
    local log_dir=$1
    shift
    case "${LAUNCHER:-srun}" in
        srun) LAUNCH_CMD=(srun --kill-on-bad-exit=0) ;;
        mpirun) LAUNCH_CMD=("${MPIRUN:-mpirun}" -np "${SLURM_NTASKS:-$SLURM_NNODES}") ;;
        *)
            echo "error: LAUNCHER=${LAUNCHER}: expected srun or mpirun" >&2
            exit 2
            ;;
    esac
    LAUNCH_CMD+=(bash "$CPT_ROOT/slurm/run_rank.sh" "$log_dir" "$@")
}

# The launcher in the background while this shell waits, so it can act on signals:
#   USR1 (--signal=B:USR1@SECS before the time limit, or `scancel --batch --signal=USR1`):
#        passed on to the ranks (srun forwards USR1 to every task; mpirun forwards only TERM),
#        which checkpoint and exit with the requeue code;
#   TERM (scancel, or SLURM preempting/requeueing the job itself): passed on the same way, and
#        remembered in PREEMPT_TERMINATED=1 so the caller does not requeue a cancelled job.
# Sets LAUNCH_RC to the launcher's exit status.
run_ranks_preemptible() {
    PREEMPT_TERMINATED=0
    LAUNCHER_PID=
    trap 'forward_signal USR1' USR1
    trap 'PREEMPT_TERMINATED=1; forward_signal TERM' TERM
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
    trap - USR1 TERM
}

forward_signal() { # SIGNAL: tell the ranks started by the launcher LAUNCHER_PID
    local sig=$1
    [ "${LAUNCHER:-srun}" = mpirun ] && sig=TERM # Hydra/ORTE forward TERM to the ranks, not USR1
    echo "== $(date '+%F %T') received $1: sending $sig to the ranks (launcher pid ${LAUNCHER_PID:-not started})"
    [ -n "${LAUNCHER_PID:-}" ] && kill -s "$sig" "$LAUNCHER_PID" 2>/dev/null
    return 0
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

PYTHON=${PYTHON:-python3}
