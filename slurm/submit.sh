#!/usr/bin/env bash
# Submit the pipeline's SLURM jobs with their logs in a predictable place.
#
#   slurm/submit.sh pretrain [SBATCH_FLAG...]   CONFIG, OUTPUT_DIR (+ OVERRIDES, LAUNCHER, ...)
#   slurm/submit.sh prep     [SBATCH_FLAG...]   INPUT_LIST, OUTPUT_DIR (+ NUM_PARTS, TOKENIZER, ...)
#   slurm/submit.sh bench    [SBATCH_FLAG...]   OUTPUT_DIR, NODE_COUNTS (+ BENCH_ARGS)
#   slurm/submit.sh convert  [SBATCH_FLAG...]   CHECKPOINT, HF_DIR (+ CONVERT_ARGS)
#   slurm/submit.sh chain    [SBATCH_FLAG...]   prep -> pretrain -> convert, each after the previous succeeded:
#                            PREP_DIR + INPUT_LIST (or SHARDS_DIR: no prep), CONFIG, OUTPUT_DIR, HF_DIR;
#                            PREP_FLAGS / PRETRAIN_FLAGS / CONVERT_FLAGS: sbatch flags of one stage
#
# The variables are read from the environment and passed to the job (see each slurm/*.sbatch
# header and docs/slurm.md). SBATCH_FLAGs (--nodes, --ntasks-per-node, --gpus-per-node, --time,
# --partition, --account, --mail-type, --mail-user, ...) override the scripts' #SBATCH defaults;
# for `chain` they go to every job (mail, account, partition), stage resources go in *_FLAGS.
# pretrain first runs `python -m pipeline.train --check` for the job's rank count, so config, data
# and checkpoint errors come back before anything is queued (SKIP_CHECK=1 skips it).
# Dependent jobs use --kill-on-invalid-dep=yes: when a stage fails, the later ones are cancelled
# instead of waiting forever. Job names: cpt-prep-{tokenizer,shards,merge}, cpt-pretrain, cpt-convert.
# Job logs: <dir>/logs/<job name>-<job id>.out (array tasks: -<array id>_<task>.out);
# per-rank logs of pretrain/bench: OUTPUT_DIR/logs/<job id>/rank<N>.log.
# Prints one KEY=JOBID line per submitted job (pretrain=123, tokenizer=/shards=/merge= for prep).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CPT_ROOT=${CPT_ROOT:-$(dirname "$here")}
PYTHON=${PYTHON:-python3}
# shellcheck source=common.sh
source "$here/common.sh"  # functions shared with the jobs (check_build_args)

usage() {
    sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
need() {
    if [ -z "${!1:-}" ]; then
        echo "error: $1 is not set: $2 (see docs/slurm.md)" >&2
        exit 2
    fi
}
submit() { # KEY SBATCH_ARGS... -> prints KEY=JOBID, sets last_id
    local key=$1 id
    shift
    id=$(sbatch --parsable "$@")
    id=${id%%;*}
    echo "$key=$id"
    last_id=$id
}
after() { # JOBID -> the flags of a job that runs only after JOBID succeeded
    printf '%s\n' "--dependency=afterok:$1" "--kill-on-invalid-dep=yes"
}

# Ranks of a pretrain job from its sbatch flags (the script's defaults: 1 node x 1 task per node).
job_world_size() {
    local nodes=1 per_node=1 ntasks=""
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --nodes=*) nodes=${1#*=} ;;
            -N | --nodes) nodes=${2:-1}; shift ;;
            -N*) nodes=${1#-N} ;;
            --ntasks-per-node=*) per_node=${1#*=} ;;
            --ntasks-per-node) per_node=${2:-1}; shift ;;
            --ntasks=*) ntasks=${1#*=} ;;
            -n | --ntasks) ntasks=${2:-}; shift ;;
            -n*) ntasks=${1#-n} ;;
        esac
        shift
    done
    nodes=${nodes%%-*} # a range MIN-MAX: check for MIN nodes
    echo "${ntasks:-$((nodes * per_node))}"
}
job_uses_gpus() {
    local arg
    for arg in "$@"; do
        case "$arg" in --gpus* | -G* | --gres=*gpu* | --gpus-per-*) return 0 ;; esac
    done
    return 1
}

# `python -m pipeline.train --check` as the job will run it (its rank count, GPUs or not), or, with
# `config_only` (the shards do not exist yet: a chain whose prep has not run), the config alone.
check_pretrain() {
    local mode=$1 world gpu=()
    shift
    [ "${SKIP_CHECK:-0}" = 1 ] && return 0
    # shellcheck disable=SC2206  # OVERRIDES is a space-separated list of key=value words
    local cmd=("$PYTHON" -m pipeline.train --config "$CONFIG" "train.output_dir=$OUTPUT_DIR" ${OVERRIDES:-})
    local shown=/dev/stderr # `--check` prints one "ok: ..." line; --print-config the whole config
    if [ "$mode" = config_only ]; then
        echo "# checking the config (the shards do not exist yet; the job checks them) ..." >&2
        cmd+=(--print-config)
        shown=/dev/null
    else
        world=$(job_world_size "$@")
        job_uses_gpus "$@" && gpu=(--gpus)
        echo "# checking config, data and checkpoint for $world rank(s) (SKIP_CHECK=1 skips this) ..." >&2
        cmd+=(--check --world-size "$world" "${gpu[@]}")
    fi
    if ! (cd "$CPT_ROOT" && env -u RANK -u WORLD_SIZE -u LOCAL_RANK "${cmd[@]}" >"$shown"); then
        echo "error: the pre-submission check failed (above); nothing was submitted" >&2
        exit 2
    fi
}

submit_pretrain() { # EXTRA_SBATCH_FLAGS... (dependency) -- then "$@" of the caller via PRETRAIN_ARGS
    mkdir -p "$OUTPUT_DIR/logs"
    submit pretrain --job-name=cpt-pretrain --output="$OUTPUT_DIR/logs/%x-%j.out" "$@" "$here/pretrain.sbatch"
}

submit_prep() { # SBATCH_FLAGS... for every prep job
    need INPUT_LIST "file listing the inputs, one per line"
    need OUTPUT_DIR "data-preparation directory"
    [ -f "$INPUT_LIST" ] || { echo "error: INPUT_LIST=$INPUT_LIST: no such file" >&2; exit 2; }
    local n dependency=()
    n=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$INPUT_LIST" | wc -l)
    [ "$n" -gt 0 ] || { echo "error: INPUT_LIST=$INPUT_LIST lists no inputs" >&2; exit 2; }
    export NUM_PARTS=${NUM_PARTS:-$n}
    if [ "$NUM_PARTS" -lt 1 ] || [ "$NUM_PARTS" -gt "$n" ]; then
        echo "error: NUM_PARTS=$NUM_PARTS: must be between 1 and the $n inputs of INPUT_LIST" >&2
        exit 2
    fi
    check_build_args
    mkdir -p "$OUTPUT_DIR/logs"
    if [ -z "${TOKENIZER:-}" ]; then
        PREP_STAGE=tokenizer submit tokenizer --job-name=cpt-prep-tokenizer --output="$OUTPUT_DIR/logs/%x-%j.out" \
            "$@" "$here/prep.sbatch"
        mapfile -t dependency < <(after "$last_id")
    fi
    PREP_STAGE=shards submit shards --job-name=cpt-prep-shards --array="0-$((NUM_PARTS - 1))" "${dependency[@]}" \
        --output="$OUTPUT_DIR/logs/%x-%A_%a.out" "$@" "$here/prep.sbatch"
    mapfile -t dependency < <(after "$last_id")
    PREP_STAGE=merge submit merge --job-name=cpt-prep-merge "${dependency[@]}" \
        --output="$OUTPUT_DIR/logs/%x-%j.out" "$@" "$here/prep.sbatch"
}

submit_convert() { # SBATCH_FLAGS...
    need CHECKPOINT "run directory or checkpoint directory"
    need HF_DIR "Hugging Face directory to create"
    local log_dir=${LOG_DIR:-$(dirname "$HF_DIR")/logs}
    mkdir -p "$log_dir"
    submit convert --job-name=cpt-convert --output="$log_dir/%x-%j.out" "$@" "$here/convert.sbatch"
}

[ "$#" -ge 1 ] || usage
kind=$1
shift
last_id=

case "$kind" in
    pretrain)
        need CONFIG "training preset or YAML path"
        need OUTPUT_DIR "run directory"
        check_pretrain full "$@"
        submit_pretrain "$@"
        echo "# checkpoints: $OUTPUT_DIR/checkpoints/  metrics: $OUTPUT_DIR/metrics.jsonl  logs: $OUTPUT_DIR/logs/" >&2
        ;;
    prep)
        submit_prep "$@"
        echo "# dataset (after the merge job): $OUTPUT_DIR/shards  logs: $OUTPUT_DIR/logs/" >&2
        ;;
    bench)
        need OUTPUT_DIR "benchmark results directory"
        mkdir -p "$OUTPUT_DIR/logs"
        submit bench --job-name=cpt-bench --output="$OUTPUT_DIR/logs/%x-%j.out" "$@" "$here/bench.sbatch"
        ;;
    convert)
        submit_convert "$@"
        ;;
    chain)
        need CONFIG "training preset or YAML path"
        need OUTPUT_DIR "run directory"
        need HF_DIR "Hugging Face directory to create from the run's final checkpoint"
        # shellcheck disable=SC2206  # *_FLAGS are lists of sbatch flags
        prep_flags=(${PREP_FLAGS:-}) pretrain_flags=(${PRETRAIN_FLAGS:-}) convert_flags=(${CONVERT_FLAGS:-})
        dependency=()
        if [ -z "${SHARDS_DIR:-}" ]; then
            need PREP_DIR "data-preparation directory (or SHARDS_DIR: an existing shard directory, no prep)"
            SHARDS_DIR=$PREP_DIR/shards
            OVERRIDES="${OVERRIDES:-} data.shards_dir=$SHARDS_DIR"
            check_pretrain config_only
            OUTPUT_DIR=$PREP_DIR submit_prep "$@" "${prep_flags[@]}"
            mapfile -t dependency < <(after "$last_id")
        else
            OVERRIDES="${OVERRIDES:-} data.shards_dir=$SHARDS_DIR"
            check_pretrain full "$@" "${pretrain_flags[@]}"
        fi
        OVERRIDES=$OVERRIDES submit_pretrain "${dependency[@]}" "$@" "${pretrain_flags[@]}"
        mapfile -t dependency < <(after "$last_id")
        CHECKPOINT=$OUTPUT_DIR submit_convert "${dependency[@]}" "$@" "${convert_flags[@]}"
        echo "# shards: $SHARDS_DIR  run: $OUTPUT_DIR  Hugging Face model (after the convert job): $HF_DIR" >&2
        ;;
    -h | --help) usage ;;
    *)
        echo "error: unknown job kind '$kind' (pretrain, prep, bench, convert, chain)" >&2
        exit 2
        ;;
esac
