#!/usr/bin/env bash
# `make demo`: pipeline-parallel (PP=2, real megatron-core 1F1B over gloo) training of a
# tiny GPT on CPU, on the embedded synthetic corpus (document lengths resampled from
# ../shared/data/lengths/prolong.json). Two processes, one thread each; < 5 min on 2 cores.
#
#   bash examples/cpu_demo.sh            # from the repo root (the Makefile does this)
#   ITERS=10 bash examples/cpu_demo.sh   # shorter
#
# Outputs: data/corpus.{bin,idx} (kept between runs), runs/cpu_demo/logs/<attempt>/<rank>/
# (torchrun's per-rank stdout/stderr), runs/cpu_demo/tensorboard, runs/cpu_demo/checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ITERS=${ITERS:-40}
OUT=runs/cpu_demo
export OMP_NUM_THREADS=1
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS (per rank, 2 ranks)"

if [[ ! -f data/corpus.bin || ! -f data/corpus.idx ]]; then
    "$PY" tools/make_corpus.py --output-prefix data/corpus --lengths prolong \
        --num-docs 4000 --max-length 1024 --seed 0
fi

rm -rf "$OUT/logs" "$OUT/checkpoints"
mkdir -p "$OUT/logs"
start=$(date +%s)
# --tee 1: rank stdout also on this terminal; everything per rank in $OUT/logs.
"$PY" -m torch.distributed.run --nproc-per-node 2 --log-dir "$OUT/logs" --redirects 3 --tee 1 \
    pretrain_gpt.py \
    --data-path data/corpus --split 98,2,0 \
    --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 \
    --seq-length 1024 --global-batch-size 4 \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 4 --lr-decay-style cosine --clip-grad 1.0 \
    --train-iters "$ITERS" --log-interval 5 --eval-interval 20 --eval-iters 2 \
    --tensorboard-dir "$OUT/tensorboard" --save "$OUT/checkpoints" --no-progress-bar \
    | sed -u -e 's/^\[default[0-9]\]:\s*//' | grep --line-buffered -v '^SUMMARY_JSON'
echo "demo wall time: $(( $(date +%s) - start )) s (training incl. startup); per-rank logs in $OUT/logs"
