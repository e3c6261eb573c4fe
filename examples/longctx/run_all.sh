#!/usr/bin/env bash
# The whole long-context comparison: data, 3 arms x 2 seeds of training under the
# same wall-clock budget, evaluation, results/longctx_accuracy.json.
#   bash examples/longctx/run_all.sh           (about 3 x 2 x (BUDGET_S + ~15 min eval) on 2 cores)
# Runs are sequential (each uses both cores). A finished run (train_meta.json and
# eval_dense.json present) is not repeated, nor a finished curriculum stage, so the
# script can be resumed. BASE_DIR=<run> starts the arms from that run instead of the
# curriculum's last stage.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/config.sh"
[[ -f $DATA_DIR/train_text_document.idx && -f $DATA_DIR/eval.jsonl ]] || bash "$HERE/make_data.sh"
if [[ $CURRICULUM != none && -z ${BASE_DIR:-} ]]; then
    # Stage 0, the base model: skips the stages already trained.
    "$PYTHON" "$HERE/curriculum.py" --stages "$CURRICULUM" --data-dir "$CURRICULUM_DATA_DIR" \
        --runs-dir "$CURRICULUM_RUNS_DIR"
fi
BASE=$(base_dir)
for SEED in $SEEDS; do
    for ARM in $ARMS; do
        RUN=$RUNS_DIR/$ARM/seed$SEED
        [[ -f $RUN/train_meta.json ]] || bash "$HERE/train_arm.sh" "$ARM" "$SEED"
        [[ -f $RUN/eval_dense.json ]] || bash "$HERE/eval_arm.sh" "$ARM" "$SEED"
    done
done
if [[ -n $BASE && ! -f $BASE/eval_dense.json ]]; then
    bash "$HERE/eval_arm.sh" base   # what the long-context stage starts from
fi
# shellcheck disable=SC2086
"$PYTHON" "$HERE/collect.py" --runs-dir "$RUNS_DIR" ${BASE:+--base-dir "$BASE"} --arms $ARMS --seeds $SEEDS \
    --needle-length "$NEEDLE_LENGTH" --mean-lengths $MEAN_LENGTHS --output "$RESULT_FILE"
