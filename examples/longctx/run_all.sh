#!/usr/bin/env bash
# The whole long-context comparison: data, 3 arms x 2 seeds of training under the
# same wall-clock budget, evaluation, results/longctx_accuracy.json.
#   bash examples/longctx/run_all.sh           (about 3 x 2 x (BUDGET_S + ~15 min eval) on 2 cores)
# Runs are sequential (each uses both cores). A finished run (train_meta.json and
# eval_dense.json present) is not repeated, so the script can be resumed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/config.sh"
[[ -f $DATA_DIR/train_text_document.idx && -f $DATA_DIR/eval.jsonl ]] &&
    { (( BASE_BUDGET_S == 0 )) || [[ -f $DATA_DIR/base/train_text_document.idx ]]; } &&
    { (( BASE_BUDGET_S == 0 || WARMUP_BUDGET_S == 0 )) || [[ -f $DATA_DIR/warmup/train_text_document.idx ]]; } ||
    bash "$HERE/make_data.sh"
if (( BASE_BUDGET_S > 0 )); then
    if (( WARMUP_BUDGET_S > 0 )) && [[ ! -f $WARMUP_DIR/train_meta.json ]]; then
        bash "$HERE/train_arm.sh" warmup
    fi
    [[ -f $BASE_DIR/train_meta.json ]] || bash "$HERE/train_arm.sh" base
fi
for SEED in $SEEDS; do
    for ARM in $ARMS; do
        RUN=$RUNS_DIR/$ARM/seed$SEED
        [[ -f $RUN/train_meta.json ]] || bash "$HERE/train_arm.sh" "$ARM" "$SEED"
        [[ -f $RUN/eval_dense.json ]] || bash "$HERE/eval_arm.sh" "$ARM" "$SEED"
    done
done
if (( BASE_BUDGET_S > 0 )) && [[ ! -f $BASE_DIR/eval_dense.json ]]; then
    bash "$HERE/eval_arm.sh" base   # what the long-context stage starts from
fi
# shellcheck disable=SC2086
"$PYTHON" "$HERE/collect.py" --runs-dir "$RUNS_DIR" --arms $ARMS --seeds $SEEDS \
    --needle-length "$NEEDLE_LENGTH" --mean-lengths $MEAN_LENGTHS --output "$RESULT_FILE"
