#!/usr/bin/env bash
# One rank of a multi-rank job step (started by `srun` or `mpirun` from slurm/pretrain.sbatch or
# slurm/bench.sbatch):
#
#   run_rank.sh LOG_DIR COMMAND [ARG...]
#
# appends the command's stdout+stderr to LOG_DIR/rank<R>.log and writes its exit status to
# LOG_DIR/rank<R>.exit, so the batch script can requeue only when EVERY rank exited with the
# requeue code (srun's own exit status is the largest of the ranks' codes, so a crash (1) on one
# rank and a clean preemption exit (75) on another would otherwise look like 75).
#
# The rank comes from the innermost launcher, in the order pipeline.distributed.discover() uses:
# MPI (PMI_RANK / OMPI_COMM_WORLD_RANK) before SLURM (SLURM_PROCID).
#
# Preemption signals (USR1, TERM) never kill this shell. They are logged and passed on to the
# command (launchers that signal only the task's first process still reach it). With
# PREEMPT_EXIT_CODE set (slurm/pretrain.sbatch sets 75), a signal that came before the command
# started means it is not started at all, and a command killed by that signal before it could
# install its own handler (the first milliseconds of the interpreter) reports PREEMPT_EXIT_CODE:
# in both cases nothing was computed, so the resume point is intact.
set -u
if [ "$#" -lt 2 ]; then
    echo "usage: run_rank.sh LOG_DIR COMMAND [ARG...]" >&2
    exit 2
fi
log_dir=$1
shift
rank=${RANK:-${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}}}
mkdir -p "$log_dir"
log="$log_dir/rank$rank.log"
preempted=""
child=""

on_signal() {
    preempted=${preempted:-$1}
    echo "=== $(date '+%F %T') rank $rank received SIG$1${child:+, passed on to pid $child}" >>"$log"
    [ -n "$child" ] && kill -s "$1" "$child" 2>/dev/null
    return 0
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
trap ':' USR2 INT

echo "=== $(date '+%F %T') job ${SLURM_JOB_ID:-none} restart ${SLURM_RESTART_COUNT:-0} rank $rank host $(hostname) ===" >>"$log"
if [ -n "$preempted" ] && [ -n "${PREEMPT_EXIT_CODE:-}" ]; then
    echo "=== rank $rank: SIG$preempted arrived before the command started; not starting it (nothing to save)" >>"$log"
    rc=$PREEMPT_EXIT_CODE
else
    "$@" >>"$log" 2>&1 &
    child=$!
    echo "=== rank $rank: command pid $child" >>"$log"
    # `wait` returns early (status > 128) when a trapped signal arrives: wait until the command has
    # really exited, then collect its status.
    while kill -0 "$child" 2>/dev/null; do
        wait "$child"
    done
    wait "$child"
    rc=$?
    if [ -n "$preempted" ] && [ -n "${PREEMPT_EXIT_CODE:-}" ] &&
        { [ "$rc" = $((128 + $(kill -l USR1))) ] || [ "$rc" = $((128 + $(kill -l TERM))) ]; }; then
        echo "=== rank $rank: the command died of SIG$(kill -l $((rc - 128))) before its handler was installed" \
            "(nothing computed yet); reporting $PREEMPT_EXIT_CODE (requeue)" >>"$log"
        rc=$PREEMPT_EXIT_CODE
    fi
fi
echo "=== $(date '+%F %T') rank $rank exit $rc ===" >>"$log"
printf '%s\n' "$rc" >"$log_dir/.rank$rank.exit.tmp" && mv -f "$log_dir/.rank$rank.exit.tmp" "$log_dir/rank$rank.exit"
exit "$rc"
