#!/usr/bin/env bash
# Step 3: score one trained run on the held-out eval set.
#   bash examples/longctx/eval_arm.sh ARM SEED
#   bash examples/longctx/eval_arm.sh base        (the shared base model, for reference)
# Every arm is scored with DENSE attention (the same yardstick for all: it
# measures what the weights learned). With EVAL_SPARSE=1 the two sparse arms are
# also scored with the sparse attention they were trained with (eval_sparse.json;
# not used by collect.py).
# Output: $RUNS_DIR/ARM/seedSEED/eval_dense.json (+ eval_sparse.json)
set -euo pipefail
source "$(dirname "$0")/config.sh"
ARM=${1:?usage: eval_arm.sh ARM SEED   (or: eval_arm.sh base)}
if [[ $ARM == base ]]; then
    RUN=$(base_dir)
    [[ -n $RUN ]] || { echo "eval_arm.sh: no base model (CURRICULUM=none)" >&2; exit 2; }
else
    SEED=${2:?usage: eval_arm.sh ARM SEED}
    RUN=$RUNS_DIR/$ARM/seed$SEED
fi
arm_flags "$ARM" "$RUN" >/dev/null
cd "$SB_ROOT"
export OMP_NUM_THREADS=${EVAL_THREADS:-2}   # evaluation is one process: use both cores
MODEL_FLAGS=$(cat "$RUN/model_flags.txt")   # written by train_arm.sh
"$PYTHON" benchmarks/eval_longctx.py --load "$RUN/ckpt" --train-args "$MODEL_FLAGS" \
    --data "$DATA_DIR/eval.jsonl" --mode greedy --quiet --output "$RUN/eval_dense.json"
if [[ $ARM != dense && $EVAL_SPARSE == 1 ]]; then
    "$PYTHON" benchmarks/eval_longctx.py --load "$RUN/ckpt" --train-args "$MODEL_FLAGS" \
        --data "$DATA_DIR/eval.jsonl" --mode greedy --quiet --sparse-attention \
        --output "$RUN/eval_sparse.json"
fi
