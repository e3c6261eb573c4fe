#!/usr/bin/env bash
# Step 1 of the long-context recipe: training mix + held-out eval set, then tokenize.
#   bash examples/longctx/make_data.sh            (about a minute for 20K documents)
# Writes $DATA_DIR/{train.jsonl,eval.jsonl,manifest.json,train_text_document.bin/.idx,
#   train_text_document_loss_start.npy (where each document's answer starts)}: the arms'
# mix. The base model's curriculum builds each stage's own mix (curriculum.py).
set -euo pipefail
source "$(dirname "$0")/config.sh"
cd "$SB_ROOT"
"$PYTHON" benchmarks/make_longctx_data.py --output-dir "$DATA_DIR" \
    --num-train-docs "$NUM_TRAIN_DOCS" --train-lengths "$TRAIN_LENGTHS" --max-tokens "$SEQ_LENGTH" \
    --filler-share "$FILLER_SHARE" --lengths "$LENGTHS_NAME" \
    --eval-lengths "$EVAL_LENGTHS" --eval-samples "$EVAL_SAMPLES" --seed "$DATA_SEED"
"$PYTHON" tools/preprocess_data.py --input "$DATA_DIR/train.jsonl" \
    --output-prefix "$DATA_DIR/train" --loss-start-key loss_start
