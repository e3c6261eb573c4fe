#!/usr/bin/env bash
# `make gpu-check`: the GPU evidence chain on one CUDA machine (see benchmarks/gpu_check.py).
# Uses the machine's own python3 (torch with CUDA and triton preinstalled): no venv, no
# torch install, no internet. Pure-Python needs come as wheels in $WHEELS (default .whl/,
# made by `make gpu-prep` on a connected machine); they are installed offline into
# /tmp/site (never torch, triton or nvidia-*: the machine's own stay) and put on PYTHONPATH.
#
#   bash benchmarks/gpu_check.sh                          # every part, report in results/gpu_check/
#   bash benchmarks/gpu_check.sh --parts bench --budget-s 560
#   bash benchmarks/gpu_check.sh --dry-run --parts deps,bench   # the chain on the CPU, tiny sizes
#
# Without a CUDA device (and without --dry-run) it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
mapfile -t wheels < <(ls "$WHEELS"/*.whl 2>/dev/null | grep -viE '/(torch|triton|nvidia[-_])[^/]*$' || true)
# Only on a CUDA machine (a CPU machine runs the dry run from its venv); once per set of
# wheels (a stamp in $SITE), so a chain run in pieces installs once.
if [[ ${#wheels[@]} -gt 0 ]] && "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    stamp="$SITE/.sparsebalance-wheels"
    want=$(basename -a "${wheels[@]}" | sort | tr '\n' ' ')
    if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}"
        echo "$want" > "$stamp"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
args=(--wheels "$WHEELS")
# GPU_CHECK_OUT, not OUT: the device tool sets OUT to a folder it empties before each command.
[[ -n ${GPU_CHECK_OUT:-} ]] && args+=(--out "$GPU_CHECK_OUT")
exec "$PY" benchmarks/gpu_check.py "${args[@]}" "$@"
