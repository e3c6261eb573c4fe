# Shared settings of the long-context recipe (sourced by the other scripts).
# Every value can be overridden from the environment, e.g. BUDGET_S=600 bash run_all.sh.
# Sizes are chosen for the 2-core CPU machine: a 4-layer byte-level GPT (hidden 128),
# PP=2 (one process per stage, one thread each), packed micro-batches of 4K tokens;
# a shared dense base model (a curriculum on short documents), then each arm at 1K-4K
# for BUDGET_S.

SB_ROOT=${SB_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PYTHON=${PYTHON:-$SB_ROOT/.venv/bin/python}
TORCHRUN=${TORCHRUN:-$SB_ROOT/.venv/bin/torchrun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # per process: 2 PP ranks on 2 cores
# Process layout and device of every training launch (train_arm.sh) and of the latency
# profile: on the CPU, 2 processes = 2 pipeline stages over gloo; gpu.sh sets one
# process on one GPU (NPROC=1 PP=1, DEVICE_FLAGS and PROFILE_DEVICE_FLAGS empty).
NPROC=${NPROC:-2}
PP=${PP:-2}
DEVICE_FLAGS=${DEVICE_FLAGS---cpu --distributed-backend gloo}
PROFILE_DEVICE_FLAGS=${PROFILE_DEVICE_FLAGS---cpu}

DATA_DIR=${DATA_DIR:-$SB_ROOT/data/longctx}    # train.jsonl, eval.jsonl, train_text_document.{bin,idx}
RUNS_DIR=${RUNS_DIR:-$SB_ROOT/runs/longctx}    # one directory per arm and seed

# Data (benchmarks/make_longctx_data.py).
NUM_TRAIN_DOCS=${NUM_TRAIN_DOCS:-6000}
TRAIN_LENGTHS=${TRAIN_LENGTHS:-1024,2048,4096}
FILLER_SHARE=${FILLER_SHARE:-0.1}
LENGTHS_NAME=${LENGTHS_NAME:-prolong}
EVAL_LENGTHS=${EVAL_LENGTHS:-1024,4096,8192}
EVAL_SAMPLES=${EVAL_SAMPLES:-30}
DATA_SEED=${DATA_SEED:-1}
EVAL_SPARSE=${EVAL_SPARSE:-0}                  # 1: also score sparse arms with sparse attention

# Results (examples/longctx/collect.py): needle_4k at NEEDLE_LENGTH, mean over MEAN_LENGTHS.
NEEDLE_LENGTH=${NEEDLE_LENGTH:-4096}
MEAN_LENGTHS=${MEAN_LENGTHS:-"4096 8192"}
RESULT_FILE=${RESULT_FILE:-$SB_ROOT/results/longctx_accuracy.json}

# Model and training (pretrain_gpt.py). SEQ_LENGTH bounds every document.
SEQ_LENGTH=${SEQ_LENGTH:-4096}
# RoPE positions the model is built for: evaluation at 8K needs >= 8192 (no parameters
# depend on it, so training at SEQ_LENGTH 4096 and scoring at 8K is one model).
MAX_POSITIONS=${MAX_POSITIONS:-8192}
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
ROTARY_PERCENT=${ROTARY_PERCENT:-1.0}              # head dims RoPE rotates; the rest match on content only
GLOBAL_BATCH=${GLOBAL_BATCH:-4}                # micro-batches per step (PP=2 needs >= 2)
LR=${LR:-3e-3}
WARMUP=${WARMUP:-20}
MAX_ITERS=${MAX_ITERS:-1000000}                # never reached: the wall-clock budget ends training
BUDGET_S=${BUDGET_S:-360}                      # equal wall-clock budget per run (seconds)
SAVE_INTERVAL=${SAVE_INTERVAL:-200}
# 1: --mask-prompt-loss (loss on answer tokens only; prompts are context). Filler
# documents are all target. 0: plain language-model loss on every token.
ANSWER_ONLY_LOSS=${ANSWER_ONLY_LOSS:-1}
SEEDS=${SEEDS:-"1 2"}

# Sparse attention of the two sparse arms: block 64, top-8 keeps (8 + 2) x 64 = 640 keys
# per query, so 1K-8K documents are sparse (density ~0.1-0.6) while the filler
# documents below ~640 tokens stay dense: the heterogeneity SAB/DST exploit.
SB_BLOCK=${SB_BLOCK:-64}
SB_TOPK=${SB_TOPK:-8}

ARMS=${ARMS:-"dense megatron sparsebalance"}

# Stage 0, the shared base model (as the paper starts from a pretrained LLM): dense
# attention, trained once as a curriculum of stages (curriculum.py; each stage its own
# data mix, learning rate and wall-clock budget, starting from the previous stage's
# weights). Every arm and seed then starts from the last stage's weights (--finetune:
# fresh optimizer and iteration count) and trains at long context under the equal
# budget BUDGET_S. The default stage file is the lineage measured on a 2-core CPU
# (docs/longctx_findings.md): short-document copying first, then needles, then longer
# documents.
# CURRICULUM=none skips stage 0: the arms train from scratch.
CURRICULUM=${CURRICULUM:-$SB_ROOT/examples/longctx/stages.json}
CURRICULUM_DATA_DIR=${CURRICULUM_DATA_DIR:-$DATA_DIR/curriculum}
CURRICULUM_RUNS_DIR=${CURRICULUM_RUNS_DIR:-$RUNS_DIR/curriculum}
BASE_SEED=${BASE_SEED:-1}

base_dir() {  # the base model's run directory (the curriculum's last stage; empty: none)
    if [[ -n ${BASE_DIR:-} ]]; then echo "$BASE_DIR"; return; fi
    [[ $CURRICULUM == none ]] ||
        "$PYTHON" "$SB_ROOT/examples/longctx/curriculum.py" --stages "$CURRICULUM" \
            --runs-dir "$CURRICULUM_RUNS_DIR" --final-dir
}

# SAB and DST plan from predicted latency: the sparsebalance arm trains with a latency
# profile of this machine and model, written by train_arm.sh into the run directory
# (tools/profile_latency.py, outside the wall-clock budget: profiling is a one-off,
# offline step per machine and model, as in the paper).
PROFILE_FLAGS=${PROFILE_FLAGS:---quick}        # tools/profile_latency.py's own flags

arm_profile() {  # the latency profile of run directory $1
    echo "$1/latency_profile.json"
}

arm_flags() {  # pretrain_gpt.py flags of one arm; $2 = its run directory (sparsebalance)
    case $1 in
        dense|stage|base) ;;
        megatron) echo --sparse-attention --sb-block-size "$SB_BLOCK" --sb-topk "$SB_TOPK" ;;
        sparsebalance) echo --sparse-attention --sb-block-size "$SB_BLOCK" --sb-topk "$SB_TOPK" --sparse-balance \
            --sb-profile "$(arm_profile "${2:?arm_flags sparsebalance needs the run directory}")" ;;
        *) echo "unknown arm $1 (dense, megatron, sparsebalance)" >&2; return 2 ;;
    esac
}
