#!/bin/bash
# Qwen2.5 continued pretraining as community Megatron-LM scripts write it (one long
# command line): QKV bias, RoPE theta 1e6, GQA, RMSNorm 1e-6, bf16 with Transformer
# Engine, full recompute, a blended dataset, fusion switches and tensorboard logging.
# Sizes shrunk to a CPU test (2 layers, 2 iterations).
set -e
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nproc_per_node 1 --nnodes 1 --node_rank 0 --master_addr localhost --master_port 29500 \
    pretrain_gpt.py \
    --use-mcore-models --transformer-impl transformer_engine \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 176 \
    --group-query-attention --num-query-groups 2 \
    --max-position-embeddings 256 --seq-length 128 \
    --position-embedding-type rope --use-rotary-position-embeddings --rotary-base 1000000 \
    --rotary-percent 1.0 --rotary-seq-len-interpolation-factor 1 \
    --swiglu --normalization RMSNorm --norm-epsilon 1e-6 \
    --disable-bias-linear --add-qkv-bias --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.008 \
    --micro-batch-size 1 --global-batch-size 2 \
    --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 2 \
    --train-iters 2 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --bf16 --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 \
    --sequence-parallel --use-distributed-optimizer \
    --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-gradient-accumulation-fusion \
    --cross-entropy-loss-fusion --calculate-per-token-loss \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model $TOKENIZER_DIR \
    --data-path 0.7 $DATA_PATH 0.3 $DATA_PATH2 --split 99,1,0 --dataloader-type cyclic \
    --eod-mask-loss --reset-position-ids --reset-attention-mask --num-workers 8 --data-cache-path $CACHE_DIR \
    --log-interval 1 --eval-interval 10000 --eval-iters 10 --save-interval 100000 \
    --tensorboard-dir $TENSORBOARD_LOGS_PATH --tensorboard-queue-size 1 \
    --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard \
    --log-throughput --timing-log-level 0 \
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --no-load-optim --no-load-rng \
    --ckpt-format torch_dist --exit-duration-in-mins 230 --manual-gc --manual-gc-interval 50 \
    --distributed-timeout-minutes 60 --distributed-backend nccl \
    2>&1 | tee train.log
