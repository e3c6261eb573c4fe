#!/usr/bin/env bash
# One short GPU lease (the device tool's 15 minutes: ~9 minutes of commands) spent on the
# parts of `make gpu-check` that answer issue 32's targets, in an order that hides the
# CUDA build: the extension compiles on the CPUs while the GPU runs the flex and triton
# bench rows, then tests, then the 64K training comparison. Each step appends to the
# same report (--out), which is copied to $OUT after every step (a kill keeps it).
#   bash tools/gpu_lease.sh                     # on the GPU machine, .whl/ and gpudata/ carried
#   BENCH_S=160 TESTS_S=170 TRAIN_S=210 bash tools/gpu_lease.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
R=${GPU_CHECK_OUT:-runs/gpu_check}
DEST=${OUT:-runs/gpu_lease_out}
mkdir -p runs "$R" "$DEST"
save() { cp -f "$R"/*.json "$R"/*.md runs/gpu_build.log "$DEST"/ 2>/dev/null || true; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
arch=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
( t0=$(date +%s); TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$(nproc) python3 setup.py -q build_ext --inplace \
    > runs/gpu_build.log 2>&1; echo "build exit $? in $(( $(date +%s) - t0 )) s" >> runs/gpu_build.log ) &
build=$!
bash tools/gpu_check.sh --out "$R" --parts deps,bench --seq-lens 65536 \
    --backends flex,triton,cuda --budget-s "${BENCH_S:-160}"; save
wait $build; tail -2 runs/gpu_build.log
bash tools/gpu_check.sh --out "$R" --parts build,tests --budget-s "${TESTS_S:-170}"; save
bash tools/gpu_check.sh --out "$R" --parts train --train-seq-lens 65536 --budget-s "${TRAIN_S:-210}"; save
