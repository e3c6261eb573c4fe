#!/usr/bin/env bash
# Step 1 of the long-context recipe: training mix + held-out eval set, then tokenize.
#   bash examples/longctx/make_data.sh            (about a minute for 20K documents)
# Writes $DATA_DIR/{train.jsonl,eval.jsonl,manifest.json,train_text_document.bin/.idx,
#   train_text_document_loss_start.npy (where each document's answer starts)},
# and with BASE_BUDGET_S > 0 the same for the base stage's mix in $DATA_DIR/base/
# (WARMUP_BUDGET_S > 0: the copy warm-up's in $DATA_DIR/warmup/).
set -euo pipefail
source "$(dirname "$0")/config.sh"
cd "$SB_ROOT"
"$PYTHON" tools/make_longctx_data.py --output-dir "$DATA_DIR" \
    --num-train-docs "$NUM_TRAIN_DOCS" --train-lengths "$TRAIN_LENGTHS" --max-tokens "$SEQ_LENGTH" \
    --filler-share "$FILLER_SHARE" --lengths "$LENGTHS_NAME" \
    --eval-lengths "$EVAL_LENGTHS" --eval-samples "$EVAL_SAMPLES" --seed "$DATA_SEED"
"$PYTHON" tools/preprocess_data.py --input "$DATA_DIR/train.jsonl" \
    --output-prefix "$DATA_DIR/train_text_document" --loss-start-key loss_start
if (( BASE_BUDGET_S > 0 )); then
    # The base stage's short-context mix: BASE_TASKS, its own seed (no shared documents).
    "$PYTHON" tools/make_longctx_data.py --output-dir "$DATA_DIR/base" \
        --num-train-docs "$BASE_TRAIN_DOCS" --train-lengths "$BASE_LENGTHS" --max-tokens "$BASE_SEQ_LENGTH" \
        --train-tasks "$BASE_TASKS" --copy-chars "$BASE_COPY_CHARS" \
        --filler-share "$BASE_FILLER_SHARE" --lengths "$LENGTHS_NAME" --eval-samples 0 \
        --seed "$BASE_DATA_SEED"
    "$PYTHON" tools/preprocess_data.py --input "$DATA_DIR/base/train.jsonl" \
        --output-prefix "$DATA_DIR/base/train_text_document" --loss-start-key loss_start
fi
if (( WARMUP_BUDGET_S > 0 )); then
    # The copy warm-up's mix: short repeat documents only.
    "$PYTHON" tools/make_longctx_data.py --output-dir "$DATA_DIR/warmup" \
        --num-train-docs "$WARMUP_TRAIN_DOCS" --train-lengths "$WARMUP_LENGTHS" --max-tokens "$WARMUP_SEQ_LENGTH" \
        --train-tasks "$WARMUP_TASKS" --copy-chars "$WARMUP_COPY_CHARS" --filler-share 0 --lengths "$LENGTHS_NAME" \
        --eval-samples 0 --seed "$BASE_DATA_SEED"
    "$PYTHON" tools/preprocess_data.py --input "$DATA_DIR/warmup/train.jsonl" \
        --output-prefix "$DATA_DIR/warmup/train_text_document" --loss-start-key loss_start
fi
