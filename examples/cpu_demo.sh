#!/usr/bin/env bash
# `make demo`: SparseBalance against the Megatron baseline, trained for real on this CPU.
#
# 1. a corpus whose document lengths are resampled from data/lengths/
#    (WLB-LLM reconstruction: whole documents of very different lengths, 8K context);
# 2. a latency profile of this machine's sparse layer (tools/profile_latency.py --quick),
#    reused while the model flags and thread count stay the same;
# 3. pretrain_gpt.py under torchrun, PP=2 (megatron-core's 1F1B over gloo, one thread per
#    rank), for two arms in interleaved rounds so that machine drift cancels:
#      megatron       static top-k, whole documents in dataset order (Megatron's sampler)
#      sparsebalance  --sparse-balance: SAB packing + critical-path DST (attention slack 0)
# 4. one side-by-side table (tokens/s, speedup with a 95% interval, retained attention vs
#    static top-k, micro-batch imbalance, bubble per stage, planning time), a Gantt PNG and
#    a Chrome trace (chrome://tracing, ui.perfetto.dev) of one step of each arm, its time
#    axis in ms per 1,000 real tokens (the arms pack different token counts per step, so
#    a shorter bar is a higher throughput, as in the table);
# 5. a machine-load check before and after the runs (other processes' CPU time from /proc,
#    the load average): one WARNING line in the output and the report when other
#    processes competed, since the ratios are then less reliable.
#
#   bash examples/cpu_demo.sh                 # from the repo root (the Makefile does this)
#   ROUNDS=5 ITERS=23 bash examples/cpu_demo.sh   # longer, tighter interval
#   DENSE=1 bash examples/cpu_demo.sh         # add full attention as a third arm
#   LENGTHS=my_lengths.json make demo         # the corpus' lengths from your own length file
#                                             # (tools/dataset_lengths.py --data-path YOUR_PREFIX)
#   DATA=my_prefix make demo                  # train on your indexed dataset itself
#                                             # (tools/preprocess_data.py's <prefix>.bin/.idx)
#
# Outputs under runs/demo/: report/report.md (every number, the commands, the figures),
# report/real_gantt.png, report/real_trace.json, runs/<arm>-<round>/ (per-run logs,
# summary JSON, per-step timelines), corpus and profile (kept between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-12}
ARMS=megatron,sparsebalance
if [[ -n "${DENSE:-}" ]]; then ARMS=$ARMS,dense; fi
CORPUS=()
if [[ -n "${LENGTHS:-}" ]]; then CORPUS=(--corpus-lengths "$LENGTHS"); fi
if [[ -n "${DATA:-}" ]]; then CORPUS+=(--data-path "$DATA"); fi
OUT=runs/demo
mkdir -p "$OUT"
rm -rf "$OUT/runs" "$OUT/report"
start=$(date +%s)
# The tool runs every rank with OMP_NUM_THREADS=1 (--threads) whatever this shell has.
"$PY" benchmarks/compare.py --mode real --arms "$ARMS" --rounds "$ROUNDS" --iters "$ITERS" \
    --threads 1 --workdir "$OUT" --report "$OUT/report" "${CORPUS[@]}"
echo "demo wall time: $(( $(date +%s) - start )) s; full report: $OUT/report/report.md"
