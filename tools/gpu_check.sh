#!/usr/bin/env bash
# `make gpu-check`: the GPU path proven on one CUDA machine (see tools/gpu_check.py).
# Uses the machine's own python3 (torch with CUDA and triton preinstalled): no venv, no
# torch install. Pure-Python needs come from wheels in $WHEELS (no internet needed).
#
#   bash tools/gpu_check.sh                      # every part, report in runs/gpu_check/
#   PY=python3.12 WHEELS=/data/wheels OUT=/data/gc bash tools/gpu_check.sh --parts tests,bench
#
# Without a CUDA device it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
exec "$PY" tools/gpu_check.py --wheels "${WHEELS:-wheels}" --out "${OUT:-runs/gpu_check}" "$@"
