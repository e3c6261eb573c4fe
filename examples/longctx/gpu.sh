#!/usr/bin/env bash
# The 3-arm RULER-style retrieval comparison (dense, megatron, sparsebalance) on ONE GPU
# in about 25 minutes, writing results/longctx_accuracy.json in run_all.sh's shape.
#   bash examples/longctx/gpu.sh                 one GPU (sizes for an H100)
#   bash examples/longctx/gpu.sh --tiny          the same path on the CPU, tiny sizes (minutes;
#                                                numbers mean nothing) -> runs/longctx-gpu-tiny/
#   bash examples/longctx/gpu.sh --print-config  the resolved settings and launch line; runs nothing
#
# This is a configuration of run_all.sh (data, base curriculum, arms under an equal
# wall-clock budget, dense-attention evaluation, collect.py): one process on one GPU
# (NPROC=1, PP=1, NCCL), an 8-layer x 512 byte-level GPT (8 heads), 8K-token packed
# micro-batches, a 4-stage base curriculum of 100 s each (stages_gpu.json), then each
# arm for BUDGET_S=150 s, one seed; block 128 / top-14 keeps (14 + 2) x 128 = 2048 keys
# per query, a quarter of the 8K context. Time (estimated from the CPU runs'
# overheads, not yet measured on a GPU): data ~3 min, base ~9 min, arms ~9 min,
# profile + evaluation ~4 min. Every setting can be overridden from the environment,
# e.g. SEEDS="1 2" BUDGET_S=300 bash examples/longctx/gpu.sh. Resumable like run_all.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TINY=0 PRINT=0
for arg in "$@"; do
    case $arg in
        --tiny) TINY=1 ;;
        --print-config) PRINT=1 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu.sh: error: unknown argument $arg (expected --tiny or --print-config)" >&2; exit 2 ;;
    esac
done

if [[ $TINY == 1 ]]; then
    # smoke.sh's sizes, CPU layout (config.sh's defaults: 2 processes, PP=2, gloo).
    export DATA_DIR=${DATA_DIR:-$ROOT/runs/longctx-gpu-tiny/data}
    export RUNS_DIR=${RUNS_DIR:-$ROOT/runs/longctx-gpu-tiny}
    export RESULT_FILE=${RESULT_FILE:-$RUNS_DIR/longctx_accuracy.json}
    export NUM_TRAIN_DOCS=${NUM_TRAIN_DOCS:-200} TRAIN_LENGTHS=${TRAIN_LENGTHS:-1024}
    export SEQ_LENGTH=${SEQ_LENGTH:-1024} MAX_POSITIONS=${MAX_POSITIONS:-1024}
    export EVAL_LENGTHS=${EVAL_LENGTHS:-1024} EVAL_SAMPLES=${EVAL_SAMPLES:-2}
    export NEEDLE_LENGTH=${NEEDLE_LENGTH:-1024} MEAN_LENGTHS=${MEAN_LENGTHS:-1024}
    export NUM_LAYERS=${NUM_LAYERS:-2} HIDDEN=${HIDDEN:-64} HEADS=${HEADS:-4}
    export GLOBAL_BATCH=${GLOBAL_BATCH:-2} WARMUP=${WARMUP:-2} SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
    export CURRICULUM=${CURRICULUM:-$HERE/stages_smoke.json}
    export BUDGET_S=${BUDGET_S:-30} SEEDS=${SEEDS:-1} SB_BLOCK=${SB_BLOCK:-64} SB_TOPK=${SB_TOPK:-2}
else
    export NPROC=${NPROC:-1} PP=${PP:-1}
    export DEVICE_FLAGS=${DEVICE_FLAGS-} PROFILE_DEVICE_FLAGS=${PROFILE_DEVICE_FLAGS-}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} EVAL_THREADS=${EVAL_THREADS:-8}
    export DATA_DIR=${DATA_DIR:-$ROOT/data/longctx-gpu}
    export RUNS_DIR=${RUNS_DIR:-$ROOT/runs/longctx-gpu}
    export RESULT_FILE=${RESULT_FILE:-$ROOT/results/longctx_accuracy.json}
    export NUM_TRAIN_DOCS=${NUM_TRAIN_DOCS:-6000} TRAIN_LENGTHS=${TRAIN_LENGTHS:-2048,4096,8192}
    export SEQ_LENGTH=${SEQ_LENGTH:-8192} MAX_POSITIONS=${MAX_POSITIONS:-8192}
    export EVAL_LENGTHS=${EVAL_LENGTHS:-4096,8192} EVAL_SAMPLES=${EVAL_SAMPLES:-30}
    export NEEDLE_LENGTH=${NEEDLE_LENGTH:-4096} MEAN_LENGTHS=${MEAN_LENGTHS:-"4096 8192"}
    export NUM_LAYERS=${NUM_LAYERS:-8} HIDDEN=${HIDDEN:-512} HEADS=${HEADS:-8}
    export GLOBAL_BATCH=${GLOBAL_BATCH:-8} LR=${LR:-5e-4} WARMUP=${WARMUP:-20}
    export SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
    export CURRICULUM=${CURRICULUM:-$HERE/stages_gpu.json}
    export BUDGET_S=${BUDGET_S:-150} SEEDS=${SEEDS:-1} SB_BLOCK=${SB_BLOCK:-128} SB_TOPK=${SB_TOPK:-14}
fi
source "$HERE/config.sh"

if [[ $PRINT == 1 ]]; then
    for v in NPROC PP DEVICE_FLAGS PROFILE_DEVICE_FLAGS OMP_NUM_THREADS DATA_DIR RUNS_DIR RESULT_FILE \
             NUM_TRAIN_DOCS TRAIN_LENGTHS SEQ_LENGTH MAX_POSITIONS EVAL_LENGTHS EVAL_SAMPLES NEEDLE_LENGTH \
             MEAN_LENGTHS NUM_LAYERS HIDDEN HEADS GLOBAL_BATCH LR WARMUP BUDGET_S SEEDS SB_BLOCK SB_TOPK \
             CURRICULUM ARMS; do
        echo "$v=${!v}"
    done
    echo "LAUNCH=torchrun --standalone --nproc-per-node $NPROC pretrain_gpt.py $DEVICE_FLAGS" \
         "--pipeline-model-parallel-size $PP"
    exit 0
fi
if [[ $TINY == 0 ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu.sh: error: no CUDA GPU visible to $PYTHON (torch.cuda.is_available() is False);" \
         "--tiny runs the CPU version" >&2
    exit 2
fi
[[ $TINY == 1 && $RUNS_DIR == */longctx-gpu-tiny ]] && rm -rf "$RUNS_DIR"  # fresh, never a user-chosen dir
bash "$HERE/run_all.sh"
