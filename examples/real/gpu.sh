#!/usr/bin/env bash
# Continue-pretraining a real pretrained model with SparseBalance on ONE GPU, then its accuracy
# (issue 50): held-out loss per packed micro-batch and RULER-style retrieval under dense, static
# top-k, threshold routing and DST's budgets (benchmarks/real_accuracy.py), before and after.
#   bash examples/real/gpu.sh              SmolLM2-135M-Instruct (make real-model), 8K tokens
#   MODEL=qwen2.5 HF_DIR=/models/Qwen2.5-0.5B bash examples/real/gpu.sh    Qwen2.5 from HF, 32K
#   bash examples/real/gpu.sh --dry-run    the steps, their commands and time budgets (CI runs it)
#
# Sized for one GPU lease: the steps' budgets add up to 8 minutes of device time (each step is
# cut at its budget by `timeout`; the training run saves at its last iteration, so lower ITERS
# if the GPU is slower than an H100). Steps: convert (Qwen only), corpus (the model's own
# tokens, benchmarks/make_real_corpus.py), base (the pretrained model's accuracy), train
# (pretrain_gpt.py --finetune --sparse-balance, PP=1, bf16, block 128), eval (the fine-tuned
# model's accuracy). Outputs: $RUN/base.json, $RUN/ft.json. Environment overrides: MODEL,
# HF_DIR, CKPT, RUN, SEQ, ITERS, BLOCK, TOPK, PYTHON.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DRY=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu.sh: error: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
    esac
done

MODEL=${MODEL:-smollm2}
PYTHON=${PYTHON:-python}
BLOCK=${BLOCK:-128}
case $MODEL in
    smollm2)
        CKPT=${CKPT:-$ROOT/runs/models/smollm2-135m}   # make real-model
        SEQ=${SEQ:-8192} ITERS=${ITERS:-40} TOPK=${TOPK:-14} TRAIN_S=240 ;;
    qwen2.5)
        [[ -n ${HF_DIR:-} ]] || { echo "gpu.sh: error: MODEL=qwen2.5 needs HF_DIR (a Qwen2.5 HF directory)" >&2; exit 2; }
        CKPT=${CKPT:-$ROOT/runs/models/qwen2.5}
        SEQ=${SEQ:-32768} ITERS=${ITERS:-12} TOPK=${TOPK:-62} TRAIN_S=210 ;;
    *) echo "gpu.sh: error: unknown MODEL $MODEL (smollm2 or qwen2.5)" >&2; exit 2 ;;
esac
RUN=${RUN:-$ROOT/runs/real-gpu-$MODEL}
EVAL=(--seq-length "$SEQ" --num-microbatches 8 --block-size "$BLOCK" --topk "$TOPK" --lengths 4096,8192
      --num-samples 5)

steps=()
declare -A cmd budget
add() { steps+=("$1"); budget[$1]=$2; shift 2; cmd[${steps[-1]}]="$*"; }
[[ $MODEL == qwen2.5 ]] && add convert 30 "$PYTHON" tools/checkpoint/convert.py hf-to-megatron --hf-dir "${HF_DIR:-}" \
    --output "$CKPT" --no-progress-bar
add corpus 40 "$PYTHON" benchmarks/make_real_corpus.py --tokenizer-model "$CKPT/hf" --output-prefix "$RUN/corpus" \
    --num-docs 400 --min-length 1024 --max-length "$SEQ"
add base 100 "$PYTHON" benchmarks/real_accuracy.py --load "$CKPT" --data-path "$RUN/corpus" "${EVAL[@]}" --out "$RUN/base.json"
add train "$TRAIN_S" "$PYTHON" pretrain_gpt.py '$(cat' "$CKPT/model_flags.txt)" --load "$CKPT" \
    --finetune --sparse-balance --sb-cost-model h100-analytic --sb-block-size "$BLOCK" --sb-topk "$TOPK" --bf16 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$CKPT/hf" --data-path "$RUN/corpus" --split 90,10,0 \
    --seq-length "$SEQ" --global-batch-size 8 --train-iters "$ITERS" --lr 1e-5 --lr-warmup-iters 4 \
    --lr-decay-style constant --save "$RUN/ft" --save-interval "$ITERS" --log-interval 1 --eval-interval 0
add eval 100 "$PYTHON" benchmarks/real_accuracy.py --load "$RUN/ft" --data-path "$RUN/corpus" "${EVAL[@]}" --out "$RUN/ft.json"

total=0
for s in "${steps[@]}"; do total=$(( total + budget[$s] )); done
if [[ $DRY == 1 ]]; then
    for s in "${steps[@]}"; do echo "$s: timeout ${budget[$s]} ${cmd[$s]}"; done
    echo "total: $total s"
    exit 0
fi
(( total <= 480 )) || { echo "gpu.sh: error: the steps' budgets add up to $total s, over 8 minutes" >&2; exit 2; }
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "gpu.sh: error: no CUDA GPU visible to $PYTHON" >&2; exit 2; }
cd "$ROOT"
mkdir -p "$RUN"
for s in "${steps[@]}"; do
    echo "== $s (at most ${budget[$s]} s)" >&2
    if [[ $s == eval ]]; then  # the fine-tuned checkpoint evaluates with the base model's flags and tokenizer
        cp "$CKPT/model_flags.txt" "$RUN/ft/" && cp -r "$CKPT/hf" "$RUN/ft/"
    fi
    timeout "${budget[$s]}" bash -c "${cmd[$s]}"
done
