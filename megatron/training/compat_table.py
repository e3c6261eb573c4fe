"""The data of :mod:`megatron.training.compat`: which Megatron-LM flags this driver treats
how, grouped by reason (one line each shown to the user), and what a fork's flag is
replaced by here. Logic lives in ``compat.py``; flag names and nargs in the JSON files.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

INFERENCE = "read only by Megatron-LM's inference engine, which a training run never builds"
NOOP_FAMILIES: List[Tuple[str, str]] = [("--inference-", INFERENCE), ("--no-inference-", INFERENCE)]
"""Accepted by name prefix: settings of a part of Megatron-LM that training does not use."""
NOOP = {
    "always megatron-core models": "--use-mcore-models",
    "data is read in-process by the packed sampler (no worker processes, no index cache)":
        "--num-workers --num-dataset-builder-threads --no-mmap-bin-files "
        "--dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --object-storage-cache-path "
        "--dataloader-type --mid-level-dataset-surplus",
    "packed THD micro-batches always restart positions and attention at each document":
        "--reset-position-ids --reset-attention-mask --no-create-attention-mask-in-dataloader",
    "the loss is always per token (sum over the global batch's target tokens / their number)":
        "--calculate-per-token-loss",
    "a document's last token never has a target (the packer ends every document there)": "--eod-mask-loss",
    "the same attention (the scaling only guards fp16 softmax; this driver's softmax is fp32)":
        "--apply-query-key-layer-scaling",
    "throughput is always in the log line (tokens/s)": "--log-throughput",
    "stage forward/backward times are always logged to tensorboard": "--log-timers-to-tensorboard",
    "tensorboard buffering only changes when events reach disk": "--tensorboard-queue-size",
    "peak memory is always logged (and to tensorboard)":
        "--log-memory-to-tensorboard --log-device-memory-used --log-memory-interval",
    "no RNG state exists to save or load: training draws no random numbers":
        "--no-save-rng --no-load-rng --data-parallel-random-init --te-rng-tracker --inference-rng-tracker",
    "gradients are always reduced in fp32": "--accumulate-allreduce-grads-in-fp32",
    "attention softmax is always computed in fp32": "--attention-softmax-in-fp32",
    "fusion switches: results are the same fused or not (the CPU path never fuses)":
        "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
        "--no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion --disable-jit-fuser "
        "--no-async-tensor-model-parallel-allreduce --disable-async-tensor-model-parallel-allreduce "
        "--use-fused-weighted-squared-relu --no-gradient-reduce-div-fusion --moe-permute-fusion "
        "--fused-residual-rmsnorm",
    "communication / memory tuning that does not change results":
        "--ddp-bucket-size --ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw --ddp-average-in-collective "
        "--no-align-grad-reduce --no-align-param-gather --overlap-p2p-communication-warmup-flush "
        "--no-overlap-p2p-communication --no-scatter-gather-tensors-in-pipeline --use-cpu-initialization "
        "--manual-gc --manual-gc-interval --no-manual-gc-eval --disable-manual-gc-eval --empty-unused-memory-level "
        "--nccl-communicator-config-path --use-tp-pp-dp-mapping --disable-gloo-process-groups "
        "--distributed-timeout-seconds-after-init --local-rank --high-priority-stream-groups "
        "--tp-comm-bootstrap-backend --use-sharp --sharp-enabled-group --create-all-gather-group "
        "--no-pin-cpu-grads --no-pin-cpu-params "
        "--overlap-param-gather-with-optimizer-step --disable-align-grad-reduce --mlp-chunks-for-training "
        "--no-use-layer-wise-param-layout --use-layer-wise-param-layout",
    "checkpoints are always torch_dist, written synchronously and loaded by every rank":
        "--use-dist-ckpt --dist-ckpt-format --async-save --use-persistent-ckpt-worker --ckpt-fully-parallel-save "
        "--no-ckpt-fully-parallel-save --disable-ckpt-fully-parallel-save --ckpt-fully-parallel-load "
        "--ckpt-assume-constant-structure --dist-ckpt-strictness --auto-detect-ckpt-format "
        "--dist-ckpt-workers --dist-ckpt-save-pre-mcore-014 --async-strategy --async-ckpt-cpu-priority "
        "--async-ckpt-io-priority --async-ckpt-use-cpu-shm --ckpt-fully-parallel-load-exchange-algo "
        "--ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-load-process-group "
        "--ckpt-fully-parallel-save-process-group --ckpt-pg-tensors-cache-create --ckpt-pg-tensors-cache-path "
        "--ckpt-drop-redundant-extra-state --disable-ckpt-load-validate-sharding-integrity "
        "--no-ckpt-load-validate-sharding-integrity",
    "context parallelism always all-gathers keys/values (same results as p2p, a2a and hierarchical a2a+p2p; "
    "Megatron-LM's rules for them are checked)": "--cp-comm-type --hierarchical-context-parallel-sizes",
    "the output layer's weight gradient is computed in each micro-batch's backward, not deferred to the "
    "pipeline flush (the same sum; megatron-core's rules for the flags are checked)":
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit",
    "the distributed optimizer shards its state over all data-parallel ranks here, one instance (the same "
    "gradients and updates, less state per rank; a warning line says so)": "--num-distributed-optimizer-instances",
    "the tokenizers package runs no remote code and loads the fast tokenizer":
        "--trust-remote-code --tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens --legacy-tokenizer",
    "text is tokenized by tools/preprocess_data.py before training; a run reads only the vocabulary size":
        "--tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens --use-gigatoken "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
    "checkpoints hold no tokenizer files here (what these flags ask for)":
        "--disable-save-tokenizer-assets --no-save-tokenizer-assets",
    "documents are delimited by the dataset index, not by an EOD token: no EOD id is read":
        "--null-tokenizer-eod-id",
    "every checkpoint is hashed at save and checked at load (its manifest.json)": "--verify-integrity",
    "packed THD micro-batches always have variable lengths here (no separate varlen dataset or check)":
        "--use-varlen-dataset --varlen-sbhd-validation",
    "packed documents never attend across their boundaries here (Megatron-LM's inter-document masking)":
        "--dataloader-inter-document-masking",
    "the tokenizer is never read from a checkpoint here": "--disable-use-tokenizer-model-from-checkpoint-args "
                                                          "--no-use-tokenizer-model-from-checkpoint-args",
    "memory tuning of the embedding's output (same results)": "--disable-clone-scatter-output-in-embedding "
                                                               "--no-clone-scatter-output-in-embedding",
    "no data-loader worker processes exist to stop": "--exit-signal-handler-for-dataloader",
    "every rank keeps its own data order here (the packing is a function of --seed and the step)":
        "--no-data-sharding --use-same-sampling-seed-across-dp-ranks",
    "the CPU/GPU synchronisation interval only paces the host (same results)": "--train-sync-interval",
    INFERENCE: "--decode-only-cuda-graphs --enable-chunked-prefill --flash-decode --mlp-chunks-for-prefill "
               "--use-legacy-static-engine --num-speculative-tokens --nccl-all-reduce-for-prefill "
               "--disable-chunked-prefill --max-tokens-to-oom",
    "read only by multi-latent attention's YaRN in Megatron-LM (branch dev); GPT YaRN reads "
    "--yarn-original-max-position-embeddings (with --position-embedding-type yarn another value is refused)":
        "--original-max-position-embeddings",
    "no telemetry service is contacted": "--no-one-logger --one-logger-project --one-logger-run-name "
                                         "--one-logger-async --app-tag-run-name --app-tag-run-version "
                                         "--disable-msc --otel-enabled --otel-service-name --otel-span-groups",
}
IGNORED = {
    "logging extra not produced by this driver (it logs loss, lr, grad norm, stage times, "
    "memory and validation loss)":
        "--log-progress "
        "--log-world-size-to-tensorboard --no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard "
        "--tensorboard-log-interval --timing-log-level --timing-log-option "
        "--no-barrier-with-level-1-timing --logging-level --log-energy --log-max-attention-logit "
        "--log-straggler --straggler-ctrlr-port --straggler-minmax-count --disable-straggler-on-startup "
        "--config-logger-dir --gpu-sniff-test-interval --save-params-interval --save-activations-interval "
        "--flight-recorder-dump-path --flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size "
        "--disable-flight-recorder-dump-on-timeout --no-flight-recorder-dump-on-timeout "
        "--disable-flight-recorder-extra-dump-on-exec --no-flight-recorder-extra-dump-on-exec "
        "--disable-flight-recorder-include-only-active --no-flight-recorder-include-only-active",
    "TP communication is not overlapped with the GEMMs here (Transformer Engine userbuffers are not set up): "
    "the same results without the overlap's speed-up; --tp-comm-overlap needs --sequence-parallel, as in "
    "Megatron-LM":
        "--tp-comm-overlap --tp-comm-overlap-cfg --no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad "
        "--no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag "
        "--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag "
        "--disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs --use-nccl-ub",
    "deprecated in Megatron-LM main, which ignores it too: the global batch stays --global-batch-size (a "
    "batch that grows is --step-batch-size-schedule there)": "--rampup-batch-size",
    "not wired (--profile with --use-pytorch-profiler records a trace; memory snapshots, Chakra "
    "traces and NVTX ranges are not produced)":
        "--record-memory-history --memory-snapshot-path --pytorch-profiler-collect-chakra --nvtx-ranges",
}
HARDWARE = {
    "needs Transformer Engine with FP4 support on a Blackwell GPU":
        "--fp4-format --fp4-recipe --fp4-param-gather --fp4-quantizer-factory",
    "needs CUDA graphs on a GPU, not driven by this driver":
        "--enable-cuda-graph --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl --cuda-graph-scope "
        "--cuda-graph-modules",
    "needs Transformer Engine's kernels on a CUDA GPU (--transformer-impl transformer_engine), which this "
    "driver's layers do not call": "--use-transformer-engine-op-fuser --flash-attention-version "
                                   "--use-grouped-gemm-for-dense-mlp",
}
MOE = "mixture of experts is not supported: this driver trains dense GPT models"
MODELOPT = ("NVIDIA ModelOpt (quantization, distillation, export; Megatron-LM's pretrain_gpt.py adds these flags "
            "when it is installed) is not supported: train without it, quantize or distil afterwards")
OFFLOAD = "activation offloading is not supported (use --recompute-granularity)"
DYNAMIC_CP = ("dynamic (hybrid) context parallelism is not in this driver: train with a fixed "
               "--context-parallel-size; its planning is simulated as the sparsebalance+dcp arm of "
               "benchmarks/compare.py --mode sim")
REFUSED = {
    "not wired into this driver's FP8 path (--fp8-format with its recipe flags, --fp8-param-gather and "
    "--first-last-layers-bf16 are, in Transformer Engine's layers on a GPU)":
        "--fp8-quantizer-factory --keep-fp8-transpose-cache --te-precision-config-file "
        "--reuse-grad-buf-for-mxfp8-param-ag --fp8-output-proj",
    "architecture option not implemented: this driver's GPT layers take --normalization, --swiglu, "
    "--squared-relu, --apply-layernorm-1p, --qk-layernorm, --attention-output-gate, --add-qkv-bias, "
    "--disable-bias-linear, --position-embedding-type and the --rotary-* flags":
        "--activation-func-clamp-value --apply-residual-connection-post-layernorm "
        "--glu-linear-offset --openai-gelu --quick-geglu "
        "--use-te-activation-func --qk-l2-norm --softmax-type --window-size "
        "--window-attn-skip-freq --no-rope-freq --mrope-section "
        "--relative-attention-max-distance --relative-attention-num-buckets --fp32-residual-connection "
        "--csa-compress-ratios --o-groups --o-lora-rank "
        "--embedding-init-method-std --init-method-xavier-uniform --spec --onnx-safe",
    "encoder-decoder and retrieval models are not supported: this driver trains decoder-only GPT models":
        "--encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length "
        "--block-data-path --evidence-data-path --titles-data-path --embedding-path --indexer-batch-size "
        "--indexer-log-interval --output-bert-embeddings --short-seq-prob --mask-prob --query-in-block-prob "
        "--use-one-sent-docs --vocab-extra-ids --mask-factor --mask-type",
    "vision models are not supported": "--classes-fraction --data-per-class-fraction --num-classes "
                                       "--num-channels --patch-dim --sample-rate --iter-per-epoch",
    "optimizer option not implemented: Adam or SGD on fp32 main parameters, megatron-core's "
    "(distributed) optimizer, one learning rate (--decoupled-lr for the embedding and output layer)":
        "--head-lr-mult --exp-avg-dtype --exp-avg-sq-dtype --main-grads-dtype "
        "--main-params-dtype --use-precision-aware-optimizer --grad-reduce-in-bf16 --no-weight-decay-cond-type "
        "--ddp-reduce-scatter-with-fp32-accumulation "
        "--ddp-param-name-patterns-for-fp32-local-accumulation "
        "--optimizer-cuda-graph "
        "--load-main-params-from-ckpt --freeze-all-layers --qk-clip --qk-clip-alpha --qk-clip-threshold "
        "--disable-bf16-reduced-precision-matmul --fp16-lm-cross-entropy --output-logit-dtype",
    "optimizer CPU offload is not supported": "--optimizer-offload-fraction --use-torch-optimizer-for-cpu-offload "
                                              "--overlap-cpu-optimizer-d2h-h2d --disable-grad-buffers-cpu-backup "
                                              "--disable-param-buffers-cpu-backup",
    "pipeline / context-parallel communication options not implemented (p2p and all-gathers over the "
    "default backend)": "--pipeline-model-parallel-comm-backend --use-ring-exchange-p2p "
                        "--symmetric-ar-type --disable-symmetric-registration "
                        "--suggested-communication-unit-size",
    "weight-gradient deferral of the layers (megatron-core's --delay-wgrad-compute, for overlapping MoE "
    "communication) is not supported": "--delay-wgrad-compute",
    "activation memory options not implemented: use --recompute-granularity (full or selective)":
        "--distribute-saved-activations --recompute-modules --offload-modules --min-offloaded-tensor-size",
    "data given by config files is not supported: give --data-path (a prefix or a blend) and --split":
        "--data-args-path --per-split-data-args-path --per-dataset-sequences-path --varlen-mock-dataset-config-json",
    "checkpoint conversion is tools/checkpoint/convert.py's job here": "--ckpt-convert-format --ckpt-convert-save "
                                                                      "--ckpt-convert-update-legacy-dist-opt-format",
    "--load resumes the newest intact checkpoint here (no other iteration can be picked)":
        "--ckpt-step --override-ckpt-iteration",
    "use --load DIR --finetune (it takes the model weights only)": "--pretrained-checkpoint",
    "local / persistent checkpoint tiers are not supported (one --save directory, --keep-last, "
    "--save-retain-interval)":
        "--persistent-save-interval --replication --replication-factor --replication-jump",
    "parallel sizes are never read from a checkpoint here: pass --tensor-model-parallel-size and "
    "--pipeline-model-parallel-size (--use-checkpoint-args reads the model flags)":
        "--use-mp-args-from-checkpoint-args",
    "Megatron-LM's large-grad / spiky-loss result checks are not supported (--rerun-mode validate_results "
    "re-runs a non-finite loss; --check-for-nan-in-loss-and-grad and "
    "--check-weight-hash-across-dp-replicas-interval are supported)":
        "--check-for-large-grads --check-for-spiky-loss "
        "--result-rejected-tracker-filename",
    "debugging / initialisation switches not implemented here": "--fake-process-group "
                                                                "--dump-param-to-param-group-map "
                                                                "--run-workload-inspector-server --enable-experimental "
                                                                "--init-model-with-meta-device --lazy-mpu-init "
                                                                "--no-initialization --save-dgrads-interval "
                                                                "--save-wgrads-interval --enable-msc",
    "ADLR autoresume is not supported (use --exit-signal-handler with --save/--load)":
        "--adlr-autoresume --adlr-autoresume-interval",
    "NVIDIA Kitchen / batch-invariant kernels are not supported": "--kitchen-attention-backend --use-kitchen-attention "
                                                                  "--kitchen-config-file --kitchen-recipe-number "
                                                                  "--batch-invariant-mode --batch-invariant-backend",
    "the tokenizers here are ByteTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, the SentencePiece ones and "
    "NullTokenizer (--tokenizer-type); no tiktoken, metadata file or extra special tokens":
        "--tiktoken-num-special-tokens --tiktoken-pattern --tokenizer-metadata --tokenizer-sentencepiece-legacy "
        "--tokenizer-special-tokens --allow-ambiguous-pad-tokens --tiktoken-special-tokens",
    "training-loop variants not implemented: every iteration from 1 to --train-iters trains":
        "--skip-train --iterations-to-skip --phase-transition-iterations",
    "validation runs --eval-iters batches of the validation split (--full-validation is not supported)":
        "--full-validation",
    "use --exit-signal-handler (SIGTERM and SIGUSR1 both save and exit)": "--exit-signal",
    "deprecated in Megatron-LM: use --micro-batch-size": "--batch-size",
    "deprecated in Megatron-LM: use --lr-warmup-iters or --lr-warmup-samples": "--warmup",
    "deprecated in Megatron-LM: use --tensor-model-parallel-size": "--model-parallel-size",
    "YAML configs are not read: pass the flags": "--yaml-cfg",
    "FSDP is not supported (use --use-distributed-optimizer)": "--disable-strict-fsdp-dtensor-load "
                                                              "--no-strict-fsdp-dtensor-load "
                                                              "--enable-full-sharding-in-hsdp",
    "mixture of experts is not supported: this driver trains dense GPT models":
        "--ep-overlap-early-attn-memory-release --save-tokens-per-expert-interval",
}
"""Megatron-LM flags refused by name, grouped by reason (families by prefix follow)."""
FAMILIES: List[Tuple[str, str]] = [
    # (name prefix, reason): the first matching prefix wins
    ("--moe-", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--num-experts", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--expert-", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--overlap-moe-", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--mtp-", "multi-token prediction is not supported"),
    ("--cache-mla-latents", "this multi-latent attention option is not implemented (--multi-latent-attention is)"),
    ("--mla-", "this multi-latent attention option is not implemented (--multi-latent-attention is)"),
    ("--mamba-", "Mamba / hybrid models are not supported"),
    ("--hybrid-layer-pattern", "Mamba / hybrid models are not supported"),
    ("--gdp-", "Gated Delta Product layers are not supported: this driver trains dense GPT models"),
    ("--hybrid-attention-ratio", "Mamba / hybrid models are not supported"),
    ("--hybrid-mlp-ratio", "Mamba / hybrid models are not supported"),
    ("--hybrid-override-pattern", "Mamba / hybrid models are not supported"),
    ("--is-hybrid-model", "Mamba / hybrid models are not supported"),
    ("--disable-mamba-", "Mamba / hybrid models are not supported"),
    ("--linear-", "linear-attention variants are not supported (block top-k sparse attention is)"),
    ("--experimental-attention-variant", "experimental attention variants are not supported "
                                         "(use --sparse-attention)"),
    ("--dsa-", "DeepSeek sparse attention is not supported (use --sparse-attention)"),
    ("--disable-dsa-", "DeepSeek sparse attention is not supported (use --sparse-attention)"),
    ("--no-dsa-", "DeepSeek sparse attention is not supported (use --sparse-attention)"),
    ("--rl-", "reinforcement learning is not supported"),
    ("--no-rl-", "reinforcement learning is not supported"),
    ("--grpo-", "reinforcement learning is not supported"),
    ("--langrl-", "reinforcement learning is not supported"),
    ("--no-langrl-", "reinforcement learning is not supported"),
    ("--perform-rl-step", "reinforcement learning is not supported"),
    ("--refit-method", "reinforcement learning is not supported"),
    ("--dino-", "vision models are not supported"),
    ("--img-", "vision models are not supported"),
    ("--vision-", "vision models are not supported"),
    ("--swin-", "vision models are not supported"),
    ("--ict-", "biencoder / retrieval models are not supported"),
    ("--biencoder-", "biencoder / retrieval models are not supported"),
    ("--retriever-", "biencoder / retrieval models are not supported"),
    ("--bert-", "BERT models are not supported"),
    ("--fim-", "fill-in-the-middle is --fim-data with --fim-rate, --fim-spm-rate and the sentinel tokens: "
               "sample splitting and fragment rates are not supported"),
    ("--sft", "supervised fine-tuning datasets are not supported (use --mask-prompt-loss)"),
    ("--inprocess-", "in-process restart is not supported (use --save/--load with --exit-signal-handler)"),
    ("--enable-ft-package", "the fault-tolerance package is not supported (see --step-timeout-minutes)"),
    ("--calc-ft-timeouts", "the fault-tolerance package is not supported (see --step-timeout-minutes)"),
    ("--ft-", "the fault-tolerance package is not supported (see --step-timeout-minutes)"),
    ("--fault-injector-", "Megatron-LM's fault injector is not supported (benchmarks/fault_trials.py kills ranks "
                          "to test recovery)"),
    ("--use-megatron-fsdp", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--use-torch-fsdp2", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--fsdp-", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--megatron-fsdp-", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--torch-fsdp2-", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--data-parallel-sharding-strategy", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--outer-dp-sharding-strategy", "FSDP is not supported (use --use-distributed-optimizer)"),
    ("--muon-", "only the Adam and SGD optimizers are supported"),
    ("--lion-", "only the Adam and SGD optimizers are supported"),
    ("--optimizer-cpu-offload", "optimizer CPU offload is not supported"),
    ("--offload-optimizer-states", "optimizer CPU offload is not supported"),
    ("--optimizer-state-offload-", "optimizer CPU offload is not supported"),
    ("--chunked-optimizer-state-offload", "optimizer CPU offload is not supported"),
    ("--activation-offload-fraction", OFFLOAD),
    ("--cpu-offloading", OFFLOAD),
    ("--delay-offload-until-cuda-graph", OFFLOAD),
    ("--fine-grained-offloading-", OFFLOAD),
    ("--fine-grained-activation-offloading", OFFLOAD),
    ("--delta-offload-bytes-across-pp-ranks", OFFLOAD),
    ("--mhc-", "hyper-connections are not supported: this driver trains dense GPT models"),
    ("--enable-mhc-connections", "hyper-connections are not supported: this driver trains dense GPT models"),
    ("--gtp-", "GTP weight sharding is not supported (use --use-distributed-optimizer)"),
    ("--tensor-parallel-num-weight-shards", "GTP weight sharding is not supported (use --use-distributed-optimizer)"),
    ("--overlap-dispatch-backward-with-experts-wgrad", MOE),
    ("--use-grouped-gemm-for-shared-expert", MOE),
    ("--high-priority-a2a-comm-stream", MOE),
    ("--hybrid-context-parallel", DYNAMIC_CP),
    ("--dynamic-context-parallel", DYNAMIC_CP),
    ("--min-dynamic-context-parallel-size", DYNAMIC_CP),
    ("--max-seqlen-per-dp-cp-rank", DYNAMIC_CP),
    ("--sequence-packing-scheduler", "Megatron-LM's packing schedulers are not wired: packing here is "
                                     "--sb-batching (megatron, sab, ...)"),
    ("--validation-set-names", "several validation sets are not supported (--split makes one)"),
    ("--multiple-validation-sets", "several validation sets are not supported (--split makes one)"),
    ("--exit-signal-handler-for-training", "use --exit-signal-handler (save and exit 0 on SIGTERM/SIGUSR1)"),
    ("--chat-template", "chat templates are not applied: tokenize with tools/preprocess_data.py"),
    ("--eval-micro-batch-size", "evaluation packs its micro-batches as training does (--micro-batch-size x "
                                "--seq-length tokens): only 1 is accepted"),
    ("--non-persistent-", "non-persistent (local) checkpoints are not supported"),
    ("--decrease-batch-size-if-needed", "the global batch size is never changed here"),
    ("--logits-", "logit distillation is not supported"),
    ("--heterogeneous-", "heterogeneous layer configurations are not supported"),
    ("--train-data-path", "separate split files are not supported: give --data-path and --split"),
    ("--valid-data-path", "separate split files are not supported: give --data-path and --split"),
    ("--test-data-path", "separate split files are not supported: give --data-path and --split"),
    ("--checkpoint-activations", "deprecated in Megatron-LM: use --recompute-activations"),
    ("--use-legacy-models", "only megatron-core models exist here"),
    ("--export-", MODELOPT),
    ("--finetune-hf-dataset", MODELOPT),
    ("--finetune-data-split", MODELOPT),
    ("--finetune-data-files", MODELOPT),
    ("--qad-train-target", MODELOPT),
    ("--freeze-base-for-mtp", MODELOPT),
    ("--modelopt-enabled", MODELOPT),
    ("--enable-gpt-oss", "GPT-OSS models (NVIDIA ModelOpt's YaRN setup) are not supported"),
]
NEUTRAL: Dict[str, str] = {
    "--expert-model-parallel-size": "1",
    "--num-experts": "0",
    "--mtp-num-layers": "0",
    "--timing-log-level": "0",
    "--eval-micro-batch-size": "1",
    "--exit-signal": "SIGTERM",
}
"""Flags whose given value means "the feature is off"; honoured (Megatron-LM does the same)."""

FORK_INSTEAD: List[Tuple[str, str]] = [
    # (name prefix or name, what this driver takes instead): the first matching entry wins
    ("--tokenizer-name-or-path", "--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH"),
    ("--tokenizer-path", "--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH"),
    ("--patch-tokenizer-type", "--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH"),
    ("--rope-theta", "--rotary-base"),
    ("--n-head-kv", "--num-query-groups"),
    ("--intermediate-size", "--ffn-hidden-size"),
    ("--extra-vocab-size", "--vocab-size"),
    ("--max-padding-length", "--seq-length"),
    ("--dataset", "--data-path (or --mock-data)"),
    ("--epochs", "--train-iters or --train-samples"),
    ("--train-mode", "--finetune with --load for fine-tuning"),
    ("--is-instruction-dataset", "--mask-prompt-loss (tools/preprocess_data.py --loss-start-key)"),
    ("--prompt-type", "--mask-prompt-loss (tools/preprocess_data.py --loss-start-key)"),
    ("--variable-seq-lengths", "nothing: packed micro-batches have variable lengths here already"),
    ("--enable-variable-seq-lengths", "nothing: packed micro-batches have variable lengths here already"),
    ("--context-parallel-algo", "--context-parallel-size (this driver's CP all-gathers keys/values per layer)"),
    ("--ulysses-degree-in-cp", "--context-parallel-size (this driver's CP all-gathers keys/values per layer)"),
    ("--cp-", "--context-parallel-size (this driver's CP all-gathers keys/values per layer)"),
    ("--adaptive-cp-", "--context-parallel-size (this driver's CP all-gathers keys/values per layer)"),
    ("--context-parallel-", "--context-parallel-size (this driver's CP all-gathers keys/values per layer)"),
    ("--use-cp-", "--context-parallel-size (this driver's CP all-gathers keys/values per layer)"),
    ("--recompute-", "--recompute-granularity / --recompute-method / --recompute-num-layers"),
    ("--swap-attention", "--recompute-granularity selective"),
    ("--use-moba-attn", "--sparse-attention --sb-block-size N --sb-topk K (block top-k routing, MoBA's kind)"),
    ("--moba-", "--sparse-attention --sb-block-size N --sb-topk K (block top-k routing, MoBA's kind)"),
    ("--hetero-", "one device type per run"),
    ("--enable-hetero", "one device type per run"),
    ("--auto-skip-spiky-loss", "--check-for-nan-in-loss-and-grad (stops on a non-finite loss)"),
    ("--spiky-loss-threshold", "--check-for-nan-in-loss-and-grad (stops on a non-finite loss)"),
    ("--use-wandb", "--wandb-project NAME"),
    ("--wandb-", "--wandb-project / --wandb-exp-name / --wandb-save-dir / --wandb-entity (WANDB_MODE, "
                 "WANDB_API_KEY in the environment)"),
]
