#!/usr/bin/env bash
# `make gpu-check` cut to one short GPU lease (the device tool lends 15 minutes in all,
# at most 10 per command): the parts that answer issue 32's targets, in an order where
# the CUDA build (one nvcc file, ~90 s of CPU) runs niced in the background while the GPU
# benches flex and triton. Each step appends to the same report (--out); the report and
# logs are copied to $OUT after every step, so a command killed at its limit keeps them.
#
#   bash tools/gpu_lease.sh                    # bench, tests, train: ~8.5 minutes
#   STEPS=profile bash tools/gpu_lease.sh      # a second call on the warm machine: ~4 minutes
#   BENCH_S=150 TESTS_S=190 TRAIN_S=220 PROFILE_S=230 STEPS="bench tests" bash tools/gpu_lease.sh
#
# The first lease (H200, 2026-11-27, docs/gpu.md) ran the whole chain this way with the
# build at full parallelism beside the bench: its compiles slowed flex's and starved
# triton's. The bench here skips cuda (0.01-0.02 efficiency there); its tests still run.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
R=${GPU_CHECK_OUT:-runs/gpu_check}
DEST=${OUT:-runs/gpu_lease_out}
STEPS=${STEPS:-bench tests train}
mkdir -p runs "$R" "$DEST"
save() { cp -f "$R"/*.json "$R"/*.md "$DEST"/ 2>/dev/null; cp -f runs/gpu_build.log "$DEST"/ 2>/dev/null; true; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
check() { bash tools/gpu_check.sh --out "$R" "$@"; save; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
build=""
if has tests && ! python3 -c "import sparsebalance._C_cuda" 2>/dev/null; then
    arch=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
    ( t0=$(date +%s); TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=2 nice -n 19 python3 setup.py -q build_ext --inplace \
        > runs/gpu_build.log 2>&1; echo "build exit $? in $(( $(date +%s) - t0 )) s" >> runs/gpu_build.log ) &
    build=$!
fi
has bench && check --parts deps,bench --seq-lens 65536 --backends flex,triton --budget-s "${BENCH_S:-150}"
[[ -n $build ]] && { wait "$build"; tail -1 runs/gpu_build.log; }
has tests && check --parts build,tests --part-budgets tests=190 --budget-s "${TESTS_S:-210}"
has train && check --parts train --train-seq-lens 65536 --budget-s "${TRAIN_S:-220}"
has profile && check --parts profile --part-budgets profile=230 --budget-s "${PROFILE_S:-230}"
exit 0
