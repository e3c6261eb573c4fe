# Shared settings of the long-context recipe (sourced by the other scripts).
# Every value can be overridden from the environment, e.g. BUDGET_S=600 bash run_all.sh.
# Sizes are chosen for the 2-core CPU machine: a 4-layer byte-level GPT, PP=2 (one
# process per stage, one thread each), packed micro-batches of 8K tokens.

SB_ROOT=${SB_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PYTHON=${PYTHON:-$SB_ROOT/.venv/bin/python}
TORCHRUN=${TORCHRUN:-$SB_ROOT/.venv/bin/torchrun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # per process: 2 PP ranks on 2 cores

DATA_DIR=${DATA_DIR:-$SB_ROOT/data/longctx}    # train.jsonl, eval.jsonl, train_text_document.{bin,idx}
RUNS_DIR=${RUNS_DIR:-$SB_ROOT/runs/longctx}    # one directory per arm and seed

# Data (tools/make_longctx_data.py).
NUM_TRAIN_DOCS=${NUM_TRAIN_DOCS:-20000}
TRAIN_LENGTHS=${TRAIN_LENGTHS:-1024,2048,4096,8192}
FILLER_SHARE=${FILLER_SHARE:-0.25}
LENGTHS_NAME=${LENGTHS_NAME:-prolong}
EVAL_LENGTHS=${EVAL_LENGTHS:-1024,4096,8192}
EVAL_SAMPLES=${EVAL_SAMPLES:-40}
DATA_SEED=${DATA_SEED:-0}
EVAL_SPARSE=${EVAL_SPARSE:-0}                  # 1: also score sparse arms with sparse attention

# Results (examples/longctx/collect.py): needle_4k at NEEDLE_LENGTH, mean over MEAN_LENGTHS.
NEEDLE_LENGTH=${NEEDLE_LENGTH:-4096}
MEAN_LENGTHS=${MEAN_LENGTHS:-"4096 8192"}
RESULT_FILE=${RESULT_FILE:-$SB_ROOT/results/longctx_accuracy.json}

# Model and training (pretrain_gpt.py). SEQ_LENGTH bounds every document.
SEQ_LENGTH=${SEQ_LENGTH:-8192}
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN=${HIDDEN:-256}
HEADS=${HEADS:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-4}                # micro-batches per step (PP=2 needs >= 2)
LR=${LR:-1e-3}
WARMUP=${WARMUP:-50}
MAX_ITERS=${MAX_ITERS:-1000000}                # never reached: the wall-clock budget ends training
BUDGET_S=${BUDGET_S:-3600}                     # equal wall-clock budget per run (seconds)
SAVE_INTERVAL=${SAVE_INTERVAL:-200}
SEEDS=${SEEDS:-"1 2"}

# Sparse attention of the two sparse arms: block 64, top-8 keeps (8 + 2) x 64 = 640 keys
# per query, so 1K-8K documents are sparse (density ~0.1-0.6) while the filler
# documents below ~640 tokens stay dense: the heterogeneity SAB/DST exploit.
SB_BLOCK=${SB_BLOCK:-64}
SB_TOPK=${SB_TOPK:-8}

ARMS=${ARMS:-"dense megatron sparsebalance"}

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
        dense) ;;
        megatron) echo --sparse-attention --sb-block-size "$SB_BLOCK" --sb-topk "$SB_TOPK" ;;
        sparsebalance) echo --sparse-attention --sb-block-size "$SB_BLOCK" --sb-topk "$SB_TOPK" --sparse-balance \
            --sb-profile "$(arm_profile "${2:?arm_flags sparsebalance needs the run directory}")" ;;
        *) echo "unknown arm $1 (dense, megatron, sparsebalance)" >&2; return 2 ;;
    esac
}
