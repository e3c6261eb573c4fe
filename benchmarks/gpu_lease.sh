#!/usr/bin/env bash
# `make gpu-check` cut to one short GPU lease (the device tool lends 15 minutes in all,
# at most 10 per command), ordered by value; every step appends to the same report
# (--out) and the report and logs are copied to $OUT after every step, so a command
# killed at its limit keeps what finished:
#   fa4tests   FlashAttention-4 block-sparse backend vs the reference, no recompilation
#   fa4bench   fa4 at 64K / block 128 (densities 0.12, 0.05, 0.25) and the 0.5B preset's shape
#   train      64K training of the 0.5B preset: sparse (fa4) first, then dense (FA4 varlen)
#   tests      the build (nvcc, ~75 s) and the other CUDA test modules (flex, triton, cuda kernels)
#   profile    the GPU latency profile (held-out MAPE) and the simulated comparison
#   flexbench  flex and triton at 64K / block 128 (not in the default plan: Run 5 measured them)
#   train128k  the train step at 128K (not in the default plan): both arms with the loss fused
#              in chunks (--cross-entropy-fusion-impl linear; the 0.5B preset's logits need it at 128K)
# TRAIN_ARMS=sparse runs a train step's sparse arm alone (a lease too short for both: no ratio).
#
# flash-attn-4 comes from `make gpu-prep`'s two bundles (benchmarks/gpu_fa4_install.sh):
#   command 1 (carry .gpu1):                bash benchmarks/gpu_fa4_install.sh stash
#   command 2 (carry .gpu2 .whl gpudata):   set -o pipefail; STEPS="fa4tests fa4bench train" \
#                                               bash benchmarks/gpu_lease.sh 2>&1 | tee $OUT/log    (~6 min)
#   command 3, at once on the warm machine:  STEPS="tests profile" bash benchmarks/gpu_lease.sh    (~5 min)
# The default steps' budgets add up to 12 minutes (Run 5 on an H200: fa4 tests 72 s with the
# install, fa4 bench 108 s, 64K train 130 s, build 72 s; the profile needed more than 96 s).
#   bash benchmarks/gpu_lease.sh --dry-run                      # the plan, printed (runs in CI)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
R=${GPU_CHECK_OUT:-runs/gpu_check}
DEST=${OUT:-runs/gpu_lease_out}
STEPS=${STEPS:-fa4tests fa4bench train tests profile}
DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1
# a one-part step's budget: the whole step's, and that part's own cap raised to it (gpu_check.py
# caps each part, e.g. the profile at 150 s: Run 7's PROFILE_S=330 was cut at 120 s without this)
b() { echo "--budget-s $2 --part-budgets $1=$2"; }
plan() {  # step name, then gpu_check.sh's arguments
    case $1 in
    fa4tests)  echo "--parts deps,tests --test-modules test_fa4_gpu.py,test_route_gpu.py --budget-s ${FA4TESTS_S:-120}" ;;
    fa4bench)  echo "--parts bench --backends fa4 --seq-lens 65536,131072 $(b bench "${FA4BENCH_S:-120}")" ;;
    train)     echo "--parts train --train-seq-lens 65536 --train-backend ${TRAIN_BACKEND:-fa4} --train-arms ${TRAIN_ARMS:-sparse,dense} $(b train "${TRAIN_S:-160}")" ;;
    tests)     echo "--parts build,tests --test-modules test_flex_gpu.py,test_gpu_backends.py --budget-s ${TESTS_S:-170}" ;;
    profile)   echo "--parts profile --train-backend ${TRAIN_BACKEND:-fa4} $(b profile "${PROFILE_S:-150}")" ;;
    flexbench) echo "--parts bench --backends flex,triton --seq-lens 65536 $(b bench "${FLEXBENCH_S:-110}")" ;;
    train128k) echo "--parts train --train-seq-lens 131072 --train-backend ${TRAIN_BACKEND:-fa4} --train-arms ${TRAIN_ARMS:-sparse,dense} $(b train "${TRAIN128K_S:-300}")" ;;
    *)         echo "gpu_lease.sh: error: unknown step '$1' (fa4tests fa4bench train train128k flexbench tests profile)" >&2
               return 1 ;;
    esac
}
for s in $STEPS; do plan "$s" > /dev/null || exit 2; done
if (( DRY )); then
    for s in $STEPS; do echo "$s: bash benchmarks/gpu_check.sh --out $R $(plan "$s")"; done
    exit 0
fi
mkdir -p runs "$R" "$DEST"
save() { cp -f "$R"/*.json "$R"/*.md runs/gpu_check_work/gpu_tests_0.xml runs/gpu_check_work/profile_latency.log \
    "$DEST"/ 2>/dev/null; true; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
if [[ -d .gpu2 ]] && ! python3 -c "import flash_attn.cute" 2>/dev/null; then
    line=$(bash benchmarks/gpu_fa4_install.sh install | tail -1) || exit 1
    eval "$line"
    echo "flash-attn-4 installed: $PYTHONPATH"
fi
# one fa4 call, forward and backward, its whole traceback in the log if it fails (the
# tests part keeps only summaries); its compiled kernels land in FA4's persistent cache
timeout 150 python3 benchmarks/harness/gpu/fa4_smoke.py 2>&1 | tail -40
for s in $STEPS; do
    t0=$(date +%s)
    # shellcheck disable=SC2046
    bash benchmarks/gpu_check.sh --out "$R" $(plan "$s")
    echo "== $s: exit $? in $(( $(date +%s) - t0 )) s"
    save
done
exit 0
