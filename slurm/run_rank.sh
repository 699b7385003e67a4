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

# SLURM delivers --signal / scancel --signal to every process of the step, the command included.
# This shell only has to survive the signal and report the command's exit status: with a trap
# set, bash runs it after the foreground command has exited.
trap ':' USR1 USR2 TERM INT

echo "=== $(date '+%F %T') job ${SLURM_JOB_ID:-none} restart ${SLURM_RESTART_COUNT:-0} rank $rank host $(hostname) ===" >>"$log"
"$@" >>"$log" 2>&1
rc=$?
echo "=== $(date '+%F %T') rank $rank exit $rc ===" >>"$log"
printf '%s\n' "$rc" >"$log_dir/.rank$rank.exit.tmp" && mv -f "$log_dir/.rank$rank.exit.tmp" "$log_dir/rank$rank.exit"
exit "$rc"
