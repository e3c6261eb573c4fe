#!/bin/bash
# Llama-3 style pretraining as Megatron-LM's examples/llama scripts write it: RoPE
# (theta 500000), GQA, SwiGLU, RMSNorm, untied output layer, Transformer Engine with FP8,
# sample-based schedule, distributed optimizer with overlap, Hugging Face tokenizer
# directory. Sizes shrunk to a CPU test (2 layers, 2 iterations = 4 samples).
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NVTE_FWD_LAYERNORM_SM_MARGIN=16

DISTRIBUTED_ARGS=(
    --nproc_per_node 1
    --nnodes 1
    --node_rank 0
    --master_addr localhost
    --master_port 6000
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length 128
    --max-position-embeddings 128
    --position-embedding-type rope
    --rotary-base 500000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --normalization RMSNorm
    --norm-epsilon 1e-05
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --transformer-impl transformer_engine
    --attention-backend fused
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 2
    --train-samples 4
    --lr-decay-samples 4
    --lr-warmup-samples 1
    --lr 0.00015
    --min-lr 0.00001
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

FP8_ARGS=(
    --fp8-format hybrid
    --fp8-amax-history-len 1024
    --fp8-amax-compute-algo max
    --fp8-param-gather
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --sequence-parallel
)

DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model $TOKENIZER_DIR
    --data-path $DATA_PATH
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
    --num-workers 1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 1
    --eval-interval 100
    --save-interval 1000
    --log-throughput
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${FP8_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} ${EVAL_AND_LOGGING_ARGS[@]}
