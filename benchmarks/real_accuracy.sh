#!/usr/bin/env bash
# `make real-accuracy` (issue 50; after `make real-model`): SparseBalance's budgets against static
# top-k on a real pretrained model (SmolLM2-135M-Instruct), post hoc, on this CPU; about 55 minutes
# on 2 threads of a quiet machine. Three steps:
#   1. a real corpus in the model's tokens (benchmarks/make_real_corpus.py; 64 documents of 512-4,096
#      tokens; kept for later calls);
#   2. tools/checkpoint/check_real_model.py: transformers' loss of the GGUF on two 1,024-token
#      documents (pretrained_loss) and the driver's first `pretrain_gpt.py --finetune` step on the
#      same batch, dense (finetune_first_loss_dense);
#   3. benchmarks/real_accuracy.py: loss of 8 packed 4,096-token micro-batches (second half of each
#      document) under dense, static top-k (the budgets bracketing SparseBalance's kept pairs),
#      threshold routing and DST's budgets for PP=4 and PP=8, and DST at static top-8's planned step
#      time against static top-8, DST's TAU levels at static threshold routing's against it (equal_step_time); needle retrieval (niah_single) at 2,048 tokens,
#      30 prompts, under dense, static, threshold and DST, with Wilson intervals and paired gaps to dense.
# Ends by printing one JSON object (equal_step_time, sb_minus_static_loss, retrieval, retrieval_ci95,
# retrieval_minus_dense, pretrained_loss, finetune_first_loss_dense, ...); the whole report goes to
# results/real_accuracy.json.
# Environment: PY, REAL_MODEL_DIR (runs/models), REAL_MODEL (its smollm2-135m), REAL_MODEL_GGUF,
# REAL_ACCURACY_DIR (runs/real-accuracy), REAL_ACCURACY_OUT, REAL_ACCURACY_ARGS (more flags for step 3,
# e.g. "--num-microbatches 4 --num-samples 1" for a reduced run).
set -euo pipefail
PY=${PY:-.venv/bin/python}
DIR=${REAL_MODEL_DIR:-runs/models}
MODEL=${REAL_MODEL:-$DIR/smollm2-135m}
GGUF=${REAL_MODEL_GGUF:-$DIR/SmolLM2-135M-Instruct.Q4_1.gguf}
WORK=${REAL_ACCURACY_DIR:-runs/real-accuracy}
OUT=${REAL_ACCURACY_OUT:-results/real_accuracy.json}

die() { echo "real_accuracy.sh: error: $*" >&2; exit 2; }
[[ -f $MODEL/model_flags.txt ]] || die "$MODEL is not a converted model: run make real-model first"
[[ -f $GGUF ]] || die "$GGUF does not exist: run make real-model first (or set REAL_MODEL_GGUF)"
mkdir -p "$WORK" "$(dirname "$OUT")"
if [[ ! -f $WORK/corpus.idx ]]; then
    "$PY" benchmarks/make_real_corpus.py --tokenizer-model "$MODEL/hf" --output-prefix "$WORK/corpus" --num-docs 64 \
        --min-length 512 --max-length 4096 --seed 1 >&2
fi
"$PY" tools/checkpoint/check_real_model.py --load "$MODEL" --gguf "$GGUF" --tokens 1024 > "$WORK/finetune_check.json"
# shellcheck disable=SC2086  # REAL_ACCURACY_ARGS is a list of flags
"$PY" benchmarks/real_accuracy.py --load "$MODEL" --data-path "$WORK/corpus" --seq-length 4096 --num-microbatches 8 \
    --pp 4,8 --tasks niah_single --lengths 2048 --num-samples 30 --finetune-check "$WORK/finetune_check.json" --out "$OUT" \
    ${REAL_ACCURACY_ARGS:-}
