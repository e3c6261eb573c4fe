#!/usr/bin/env bash
# A seconds-to-minutes smoke run of the whole recipe (NOT the comparison): tiny data,
# a 2-layer model, 1K contexts, a two-stage base curriculum of 30 s each
# (stages_smoke.json), a 60 s budget per arm, one seed, 2 eval samples per cell. Its numbers mean nothing; it checks that every step runs end to end.
#   bash examples/longctx/smoke.sh
# Everything goes to runs/longctx-smoke/ (results/ is never touched).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export DATA_DIR=${DATA_DIR:-$ROOT/runs/longctx-smoke/data}
export RUNS_DIR=${RUNS_DIR:-$ROOT/runs/longctx-smoke}
export RESULT_FILE=$RUNS_DIR/longctx_accuracy.json
export NUM_TRAIN_DOCS=${NUM_TRAIN_DOCS:-300} TRAIN_LENGTHS=1024 SEQ_LENGTH=1024
export EVAL_LENGTHS=1024 EVAL_SAMPLES=${EVAL_SAMPLES:-2} NEEDLE_LENGTH=1024 MEAN_LENGTHS=1024
export NUM_LAYERS=2 HIDDEN=64 HEADS=4 GLOBAL_BATCH=2 WARMUP=2 SAVE_INTERVAL=1000 MAX_POSITIONS=1024
export CURRICULUM=${CURRICULUM:-$HERE/stages_smoke.json}
export BUDGET_S=${BUDGET_S:-60} SEEDS=${SEEDS:-1} SB_BLOCK=64 SB_TOPK=2
export ARMS=${ARMS:-"dense megatron sparsebalance"}
[[ $RUNS_DIR == */longctx-smoke ]] && rm -rf "$RUNS_DIR"  # fresh, but never a user-chosen dir
bash "$HERE/run_all.sh"
