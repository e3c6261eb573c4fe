#!/usr/bin/env bash
# flash-attn-4 on a GPU machine without internet, from the two bundles of `make gpu-prep`
# (each at most 60 MiB, so each fits one device command):
#   command 1, carrying .gpu1:   bash benchmarks/gpu_fa4_install.sh stash      (keeps part 0 in $STASH)
#   command 2, carrying .gpu2:   bash benchmarks/gpu_fa4_install.sh install    (assembles, checks, installs)
# Installs into $SITE (default /tmp/site, the folder gpu_check.sh puts on PYTHONPATH) and
# prints the PYTHONPATH to export: CuTeDSL's packages live under nvidia_cutlass_dsl/dsl_packages
# (a .pth file that `pip --target` does not run). One line and exit 1 on a missing or damaged part.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${STASH:-/tmp/sb_fa4_stash}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
die() { echo "gpu_fa4_install.sh: error: $*" >&2; exit 1; }
case "${1:-}" in
stash)
    [[ -f .gpu1/libs.part0 ]] || die ".gpu1/libs.part0 missing: run make gpu-prep and carry .gpu1"
    mkdir -p "$STASH"
    cp -f .gpu1/libs.part0 "$STASH/"
    echo "stashed $(du -h "$STASH/libs.part0" | cut -f1) in $STASH" ;;
install)
    [[ -f $STASH/libs.part0 ]] || die "$STASH/libs.part0 missing: run the stash command first, on this machine"
    [[ -f .gpu2/libs.part1 && -f .gpu2/libs.name ]] || die ".gpu2 incomplete: run make gpu-prep and carry .gpu2"
    whl="$STASH/$(cat .gpu2/libs.name)"
    cat "$STASH/libs.part0" .gpu2/libs.part1 > "$whl"
    [[ $(sha256sum "$whl" | cut -d' ' -f1) == $(cat .gpu2/libs.sha256) ]] || die "assembled $whl has the wrong sha256"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$whl" .gpu2/*.whl
    echo "export PYTHONPATH=$SITE/nvidia_cutlass_dsl/dsl_packages:$SITE\${PYTHONPATH:+:\$PYTHONPATH}" ;;
*)
    die "usage: gpu_fa4_install.sh stash|install" ;;
esac
