#!/usr/bin/env bash
# Submit one of the pipeline's SLURM jobs with its logs in a predictable place.
#
#   slurm/submit.sh pretrain [SBATCH_FLAG...]   CONFIG, OUTPUT_DIR (+ OVERRIDES, LAUNCHER, ...)
#   slurm/submit.sh prep     [SBATCH_FLAG...]   INPUT_LIST, OUTPUT_DIR (+ NUM_PARTS, TOKENIZER, ...)
#   slurm/submit.sh bench    [SBATCH_FLAG...]   OUTPUT_DIR, NODE_COUNTS (+ BENCH_ARGS)
#   slurm/submit.sh convert  [SBATCH_FLAG...]   CHECKPOINT, HF_DIR (+ CONVERT_ARGS)
#
# The variables are read from the environment and passed to the job (see each slurm/*.sbatch
# header and docs/slurm.md). SBATCH_FLAGs (--nodes, --ntasks-per-node, --gpus-per-node,
# --time, --partition, --account, ...) override the scripts' #SBATCH defaults.
# Job logs: OUTPUT_DIR/logs/<job name>-<job id>.out (array tasks: -<array id>_<task>.out);
# per-rank logs of pretrain/bench: OUTPUT_DIR/logs/<job id>/rank<N>.log.
# Prints one KEY=JOBID line per submitted job (pretrain=123, or tokenizer=/shards=/merge= for prep).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CPT_ROOT=${CPT_ROOT:-$(dirname "$here")}

usage() {
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
need() {
    if [ -z "${!1:-}" ]; then
        echo "error: $1 is not set: $2 (see docs/slurm.md)" >&2
        exit 2
    fi
}
submit() { # KEY SBATCH_ARGS... -> prints KEY=JOBID
    local key=$1 id
    shift
    id=$(sbatch --parsable "$@")
    id=${id%%;*}
    echo "$key=$id"
    last_id=$id
}

[ "$#" -ge 1 ] || usage
kind=$1
shift

case "$kind" in
    pretrain)
        need CONFIG "training preset or YAML path"
        need OUTPUT_DIR "run directory"
        mkdir -p "$OUTPUT_DIR/logs"
        submit pretrain --output="$OUTPUT_DIR/logs/%x-%j.out" "$@" "$here/pretrain.sbatch"
        echo "# checkpoints: $OUTPUT_DIR/checkpoints/  metrics: $OUTPUT_DIR/metrics.jsonl  logs: $OUTPUT_DIR/logs/" >&2
        ;;
    prep)
        need INPUT_LIST "file listing the inputs, one per line"
        need OUTPUT_DIR "data-preparation directory"
        [ -f "$INPUT_LIST" ] || { echo "error: INPUT_LIST=$INPUT_LIST: no such file" >&2; exit 2; }
        n=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$INPUT_LIST" | wc -l)
        [ "$n" -gt 0 ] || { echo "error: INPUT_LIST=$INPUT_LIST lists no inputs" >&2; exit 2; }
        export NUM_PARTS=${NUM_PARTS:-$n}
        if [ "$NUM_PARTS" -lt 1 ] || [ "$NUM_PARTS" -gt "$n" ]; then
            echo "error: NUM_PARTS=$NUM_PARTS: must be between 1 and the $n inputs of INPUT_LIST" >&2
            exit 2
        fi
        mkdir -p "$OUTPUT_DIR/logs"
        dependency=()
        if [ -z "${TOKENIZER:-}" ]; then
            PREP_STAGE=tokenizer submit tokenizer --output="$OUTPUT_DIR/logs/%x-tokenizer-%j.out" "$@" "$here/prep.sbatch"
            dependency=(--dependency="afterok:$last_id")
        fi
        PREP_STAGE=shards submit shards --array="0-$((NUM_PARTS - 1))" "${dependency[@]}" \
            --output="$OUTPUT_DIR/logs/%x-shards-%A_%a.out" "$@" "$here/prep.sbatch"
        PREP_STAGE=merge submit merge --dependency="afterok:$last_id" --output="$OUTPUT_DIR/logs/%x-merge-%j.out" \
            "$@" "$here/prep.sbatch"
        echo "# dataset (after the merge job): $OUTPUT_DIR/shards  logs: $OUTPUT_DIR/logs/" >&2
        ;;
    bench)
        need OUTPUT_DIR "benchmark results directory"
        mkdir -p "$OUTPUT_DIR/logs"
        submit bench --output="$OUTPUT_DIR/logs/%x-%j.out" "$@" "$here/bench.sbatch"
        ;;
    convert)
        need CHECKPOINT "run directory or checkpoint directory"
        need HF_DIR "Hugging Face directory to create"
        log_dir=${LOG_DIR:-$(dirname "$HF_DIR")/logs}
        mkdir -p "$log_dir"
        submit convert --output="$log_dir/%x-%j.out" "$@" "$here/convert.sbatch"
        ;;
    -h | --help) usage ;;
    *)
        echo "error: unknown job kind '$kind' (pretrain, prep, bench, convert)" >&2
        exit 2
        ;;
esac
