#!/usr/bin/env bash
# `make gpu-prep`: on a machine with PyPI access, everything `make gpu-check` needs on a GPU
# machine that has no internet (python3 3.12 with torch + triton already, see docs/gpu.md):
#   .whl/      wheels of what that image lacks, for CPython 3.12 on x86-64 Linux, no deps
#              (megatron-core; its other needs are in the image). gpu_check.sh installs them
#              offline into /tmp/site.
#   gpudata/   the document-length files the train part resamples (copied from
#              data/lengths, or LENGTHS=DIR of your own). Both folders are git-ignored; carry them.
#   .gpu1/, .gpu2/  flash-attn-4 and its needs (requirements-gpu.txt) in two bundles of at
#              most 60 MiB each, for two back-to-back device commands: the CuTeDSL libs
#              wheel (~92 MB) is cut in two, .gpu1/ holds its first part, .gpu2/ the rest
#              and the other wheels; benchmarks/gpu_fa4_install.sh assembles and installs them.
# Prints the files and their total size (they travel with the repo: keep it far under 64 MiB).
#   bash benchmarks/gpu_prep.sh            # = make gpu-prep
#   PIP="python3 -m pip" WHEELS=/data/whl bash benchmarks/gpu_prep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
WHEELS=${WHEELS:-.whl}
DATA=${DATA:-gpudata}
PKGS=(megatron-core==0.16.1)
FA4_PKGS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
          nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
          apache-tvm-ffi==0.1.15.post2
          torch-c-dlpack-ext==0.1.5)
PART_MB=${PART_MB:-50}
LENGTHS=${LENGTHS:-data/lengths}

mkdir -p "$WHEELS" "$DATA"
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64; do
    platforms+=(--platform "$p")
done
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$WHEELS" "${PKGS[@]}"
fa4=$(mktemp -d)
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform any -d "$fa4" "${FA4_PKGS[@]}"
rm -rf .gpu1 .gpu2
mkdir -p .gpu1 .gpu2
big=$(ls "$fa4"/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b "${PART_MB}M" -d -a 1 "$big" "$fa4/part"
mv "$fa4/part0" .gpu1/libs.part0
cat "$fa4"/part[1-9] > .gpu2/libs.part1
basename "$big" > .gpu2/libs.name
sha256sum "$big" | cut -d' ' -f1 > .gpu2/libs.sha256
find "$fa4" -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .gpu2/ \;
rm -rf "$fa4"
if [[ -d $LENGTHS ]]; then
    cp -f "$LENGTHS"/*.json "$DATA"/
else
    echo "gpu_prep.sh: warning: $LENGTHS not found; the train part will need --lengths" >&2
fi
ls -l "$WHEELS" "$DATA" .gpu1 .gpu2
du -ch .gpu1 | tail -1
du -ch "$WHEELS" "$DATA" .gpu2 | tail -1
