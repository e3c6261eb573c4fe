#!/usr/bin/env bash
# Step 2: train one arm with one seed under the shared wall-clock budget.
#   bash examples/longctx/train_arm.sh ARM SEED      ARM in: dense megatron sparsebalance
#   bash examples/longctx/train_arm.sh stage         one curriculum stage (curriculum.py runs it)
#
# An arm's first launch starts from the base model's weights (--load BASE/ckpt
# --finetune: fresh optimizer, iteration 0), BASE being the curriculum's last stage
# (none with CURRICULUM=none: a fresh init). A stage is dense and is described by
# STAGE_DIR (its run), STAGE_DATA (data prefix), STAGE_INIT (the run it starts from;
# empty: a fresh init), STAGE_BUDGET_S and STAGE_GLOBAL_BATCH, with LR and SEQ_LENGTH.
#
# PP=2 on CPU: torchrun starts one process per pipeline stage (gloo; NPROC, PP and
# DEVICE_FLAGS in config.sh, one process on one GPU with gpu.sh). The LR is
# constant after warm-up, so cutting training at the budget does not interact
# with a decay schedule, and faster arms simply take more steps.
#
# Wall-clock budget: pretrain_gpt.py has no time-limit flag, so the budget is
# enforced with its --exit-signal-handler: BUDGET_S seconds after launch a
# watchdog sends SIGUSR1 to the workers; torchrun runs with USR1 ignored,
# the workers finish the current step, save a checkpoint and exit 0. If they
# have not exited 10 minutes later they are killed (the run then has no final
# checkpoint and the script fails). The budget includes start-up, equally for
# every arm. A run that reaches MAX_ITERS first ends normally.
#
# The sparsebalance arm passes --sparse-balance (SAB packing + DST budgets on top of
# --sparse-attention) with --sb-profile: before the budget starts, a latency profile
# of the same model on this machine is written by tools/profile_latency.py
# ($PROFILE_FLAGS, one thread per process as in training) unless the run directory
# already holds one. The script stops with a clear message if this checkout's
# driver lacks a flag.
#
# Output: $RUNS_DIR/ARM/seedSEED/{ckpt/,train.log,train_meta.json,model_flags.txt}
#         (+ latency_profile.json, profile.log for sparsebalance)
set -euo pipefail
source "$(dirname "$0")/config.sh"
ARM=${1:?usage: train_arm.sh ARM SEED   (or: train_arm.sh stage)}
# INIT: the run whose weights a first launch starts from (none: a fresh init).
if [[ $ARM == stage ]]; then
    for v in STAGE_DIR STAGE_DATA STAGE_BUDGET_S STAGE_GLOBAL_BATCH; do
        [[ -n ${!v:-} ]] || { echo "train_arm.sh: a stage needs $v (curriculum.py sets it)" >&2; exit 2; }
    done
    SEED=$BASE_SEED GLOBAL_BATCH=$STAGE_GLOBAL_BATCH RUN=$STAGE_DIR BUDGET_S=$STAGE_BUDGET_S
    DATA_PREFIX=$STAGE_DATA INIT=${STAGE_INIT:-}
else
    SEED=${2:?usage: train_arm.sh ARM SEED}
    RUN=$RUNS_DIR/$ARM/seed$SEED
    DATA_PREFIX=$DATA_DIR/train_text_document
    INIT=$(base_dir)
fi
FLAGS=$(arm_flags "$ARM" "$RUN")
cd "$SB_ROOT"
for f in $FLAGS; do
    if [[ $f == --* ]] && ! "$PYTHON" pretrain_gpt.py --help 2>/dev/null | grep -q -- "$f\b"; then
        echo "train_arm.sh: pretrain_gpt.py in this checkout has no $f flag (needed by arm $ARM)" >&2
        exit 2
    fi
done
[[ -f $DATA_PREFIX.idx ]] || { echo "train_arm.sh: $DATA_PREFIX.idx is missing: run make_data.sh (or curriculum.py) first" >&2; exit 2; }
# Where the weights come from: this run's own checkpoint (a resumed run), else the
# base model's (first launch of an arm with a base stage), else a fresh init.
LOAD_FLAGS="--load $RUN/ckpt"
RESUMED=0
[[ -f $RUN/ckpt/latest_checkpointed_iteration.txt ]] && RESUMED=1
if [[ -n $INIT && ! -f $RUN/ckpt/latest_checkpointed_iteration.txt ]]; then
    [[ -f $INIT/ckpt/latest_checkpointed_iteration.txt ]] || {
        echo "train_arm.sh: no model in $INIT/ckpt to start $ARM from: train that stage first" >&2; exit 2; }
    LOAD_FLAGS="--load $INIT/ckpt --finetune"
fi

LOSS_FLAGS=""
[[ $ANSWER_ONLY_LOSS == 1 ]] && LOSS_FLAGS="--mask-prompt-loss"
mkdir -p "$RUN/ckpt"
# this project's architecture and schedule (Megatron-LM's defaults differ; docs/usage.md)
SHAPE_FLAGS="--position-embedding-type rope --untie-embeddings-and-output-weights --lr-decay-style cosine --adam-beta2 0.95 --make-vocab-size-divisible-by 1 --hidden-dropout 0 --attention-dropout 0 --transformer-impl local --tokenizer-type ByteTokenizer --num-layers $NUM_LAYERS --hidden-size $HIDDEN --num-attention-heads $HEADS \
--seq-length $SEQ_LENGTH --max-position-embeddings $MAX_POSITIONS --rotary-percent $ROTARY_PERCENT"
# Model flags, also stored for eval_arm.sh (checkpoints do not record their arguments).
MODEL_FLAGS="$SHAPE_FLAGS $FLAGS"
echo "$MODEL_FLAGS" > "$RUN/model_flags.txt"
if [[ $ARM == sparsebalance && ! -f $(arm_profile "$RUN") ]]; then
    # Same model, tokenizer (vocab) and threads per process as the training run below.
    # shellcheck disable=SC2086
    if ! "$PYTHON" tools/profile_latency.py $PROFILE_DEVICE_FLAGS --output "$(arm_profile "$RUN")" $PROFILE_FLAGS \
            $SHAPE_FLAGS --sparse-attention --sb-block-size "$SB_BLOCK" --sb-topk "$SB_TOPK" \
            --tokenizer-type ByteTokenizer > "$RUN/profile.log" 2>&1; then
        echo "train_arm.sh: latency profiling for $ARM failed; see $RUN/profile.log" >&2
        exit 1
    fi
fi
start=$(date +%s.%N)
# shellcheck disable=SC2086
bash -c 'trap "" USR1; exec "$@"' _ \
    "$TORCHRUN" --standalone --nproc-per-node "$NPROC" pretrain_gpt.py $DEVICE_FLAGS \
        --pipeline-model-parallel-size "$PP" $MODEL_FLAGS \
        --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" \
        --lr "$LR" --lr-decay-style constant --lr-warmup-iters "$WARMUP" --train-iters "$MAX_ITERS" \
        --weight-decay 0.01 --clip-grad 1.0 --seed "$SEED" \
        --data-path "$DATA_PREFIX" --split 100,0,0 --tokenizer-type ByteTokenizer $LOSS_FLAGS \
        --save "$RUN/ckpt" $LOAD_FLAGS --save-interval "$SAVE_INTERVAL" --exit-signal-handler \
        --log-interval 10 --no-progress-bar --eval-interval 0 > "$RUN/train.log" 2>&1 &
TR=$!
# Watchdog: at the budget, USR1 to the workers (torchrun's children, each in its own
# session, so a process-group signal would not reach them), every 5 s until the driver
# prints its summary: they start with USR1 ignored, so one that lands before a worker
# has installed its handler is lost (a short budget on a loaded machine); SIGKILL if
# still alive 10 min on.
(
    sleep "$BUDGET_S"
    for _ in $(seq 120); do
        # Once the driver has printed its summary every rank has stopped and saved; a
        # USR1 now would land during interpreter teardown, where Python has put the
        # default action (terminate) back, and fail a finished run.
        if ! grep -q '^SUMMARY_JSON ' "$RUN/train.log" 2>/dev/null; then
            kill -USR1 $(pgrep -P "$TR") 2>/dev/null || true
        fi
        sleep 5
    done
    kill -KILL $(pgrep -P "$TR") "$TR" 2>/dev/null || true
) &
WD=$!
set +e
wait "$TR"
rc=$?
set -e
kill $(pgrep -P "$WD") "$WD" 2>/dev/null || true  # the watchdog and its sleep
end=$(date +%s.%N)
if [[ $rc -ne 0 ]]; then
    echo "train_arm.sh: training of $ARM seed $SEED failed (exit $rc); see $RUN/train.log" >&2
    exit 1
fi
"$PYTHON" - "$RUN" "$ARM" "$SEED" "$start" "$end" "$BUDGET_S" "$FLAGS" "$LOAD_FLAGS" "$RESUMED" <<'PY'
import json, os, sys
run, arm, seed, start, end, budget, flags, load, resumed = sys.argv[1:]
path = os.path.join(run, "train_meta.json")
# A resumed run adds this launch to the earlier ones: wall_clock_s is the total.
segments = []
if resumed == "1" and os.path.isfile(path):
    old = json.load(open(path))
    segments = old.get("segments") or [{"wall_clock_s": old["wall_clock_s"], "iterations": old.get("iterations")}]
segments.append({"wall_clock_s": round(float(end) - float(start), 1)})
meta = {"arm": arm, "seed": int(seed), "wall_clock_s": round(sum(x["wall_clock_s"] for x in segments), 1),
        "segments": segments,
        "budget_s": float(budget), "arm_flags": flags.split(),
        "init_from": load.split()[1] if "--finetune" in load.split() else None,
        "omp_num_threads": int(os.environ.get("OMP_NUM_THREADS", "0"))}
# The driver's end-of-run summary line (steps, tokens, losses) if it printed one.
summary = [l for l in open(os.path.join(run, "train.log")) if l.startswith("SUMMARY_JSON ")]
if summary:
    s = json.loads(summary[-1].split(" ", 1)[1])
    meta.update({k: s.get(k) for k in ("last_iteration", "tokens", "tokens_per_s", "median_step_s",
                                       "first_loss", "last_loss", "preempted")})
    segments[-1]["iterations"] = s.get("iterations")
    # the run's own iteration counter (--finetune starts it at 0): steps of all launches
    meta["iterations"] = s.get("last_iteration")
from sparsebalance.io import atomic_write_text  # the working directory is $SB_ROOT
atomic_write_text(path, json.dumps(meta, indent=1))
PY
echo "trained $ARM seed $SEED in $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.0f", b - a}') s -> $RUN"
