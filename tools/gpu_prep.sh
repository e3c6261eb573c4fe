#!/usr/bin/env bash
# `make gpu-prep`: on a machine with PyPI access, everything `make gpu-check` needs on a GPU
# machine that has no internet (python3 3.12 with torch + triton already, see docs/gpu.md):
#   .whl/      wheels of what that image lacks, for CPython 3.12 on x86-64 Linux, no deps
#              (megatron-core; its other needs are in the image). gpu_check.sh installs them
#              offline into /tmp/site.
#   gpudata/   the document-length files the train part resamples (copied from
#              ../shared/data/lengths). Both folders are git-ignored; carry them.
# Prints the files and their total size (they travel with the repo: keep it far under 64 MiB).
#   bash tools/gpu_prep.sh            # = make gpu-prep
#   PIP="python3 -m pip" WHEELS=/data/whl bash tools/gpu_prep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
WHEELS=${WHEELS:-.whl}
DATA=${DATA:-gpudata}
PKGS=(megatron-core==0.16.1)
LENGTHS=${LENGTHS:-../shared/data/lengths}

mkdir -p "$WHEELS" "$DATA"
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64; do
    platforms+=(--platform "$p")
done
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$WHEELS" "${PKGS[@]}"
if [[ -d $LENGTHS ]]; then
    cp -f "$LENGTHS"/*.json "$DATA"/
else
    echo "gpu_prep.sh: warning: $LENGTHS not found; the train part will need --lengths" >&2
fi
ls -l "$WHEELS" "$DATA"
du -ch "$WHEELS" "$DATA" | tail -1
