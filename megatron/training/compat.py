"""Megatron-LM's full flag set: what ``pretrain_gpt.py`` does with each flag it does not implement.

A Megatron-LM launch script must run unchanged or stop with ONE line saying why; a bare
"unrecognized arguments" is left for flags Megatron-LM does not have either. The names
(and how many values each takes) are data, in ``megatron_lm_flags.json`` (read from
Megatron-LM's own parser; see its ``source`` field). Every Megatron-LM flag that
:func:`megatron.training.arguments.build_parser` does not define itself is registered
by :func:`add_megatron_lm_flags` under a private dest and treated by :func:`treatment`:

* ``noop``: accepted; its effect is already what this driver does, or it only tunes
  performance of a path that does not exist here (fusions, buckets, workers). Honoured.
* ``ignored``: accepted with one warning line: a logging/profiling extra this driver
  does not produce. Results are unaffected.
* ``hardware``: needs a GPU / library this process lacks: one line naming what it needs.
* ``unsupported``: a family this driver does not train (MoE, MLA, Mamba, vision, RL,
  inference, ...) or an option not implemented: one line with the reason.

A flag given with its neutral value (``NEUTRAL``, e.g. ``--expert-model-parallel-size 1``)
is honoured whatever its family.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

DEST_PREFIX = "mlm__"
"""argparse dest prefix of the flags registered from the table (never read elsewhere)."""


@dataclass(frozen=True)
class Treatment:
    """How ``pretrain_gpt.py`` treats one Megatron-LM flag it does not define."""

    kind: str
    """``noop``, ``ignored``, ``hardware`` or ``unsupported``."""
    reason: str
    """Why (one clause, shown to the user)."""


_NOOP = {
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
        "--no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion --cross-entropy-loss-fusion "
        "--cross-entropy-fusion-impl --disable-jit-fuser --no-async-tensor-model-parallel-allreduce "
        "--disable-async-tensor-model-parallel-allreduce --use-fused-weighted-squared-relu "
        "--no-gradient-reduce-div-fusion --moe-permute-fusion",
    "communication / memory tuning that does not change results":
        "--ddp-bucket-size --ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw --ddp-average-in-collective "
        "--no-align-grad-reduce --no-align-param-gather --overlap-p2p-communication-warmup-flush "
        "--no-overlap-p2p-communication --no-scatter-gather-tensors-in-pipeline --use-cpu-initialization "
        "--manual-gc --manual-gc-interval --no-manual-gc-eval --disable-manual-gc-eval --empty-unused-memory-level "
        "--nccl-communicator-config-path --use-tp-pp-dp-mapping --disable-gloo-process-groups "
        "--distributed-timeout-seconds-after-init --local-rank --high-priority-stream-groups "
        "--tp-comm-bootstrap-backend --use-sharp --sharp-enabled-group --create-all-gather-group "
        "--microbatch-group-size-per-virtual-pipeline-stage --no-pin-cpu-grads --no-pin-cpu-params "
        "--overlap-param-gather-with-optimizer-step",
    "checkpoints are always torch_dist, written synchronously and loaded by every rank":
        "--use-dist-ckpt --dist-ckpt-format --async-save --use-persistent-ckpt-worker --ckpt-fully-parallel-save "
        "--no-ckpt-fully-parallel-save --disable-ckpt-fully-parallel-save --ckpt-fully-parallel-load "
        "--ckpt-assume-constant-structure --dist-ckpt-strictness --auto-detect-ckpt-format "
        "--dist-ckpt-workers --dist-ckpt-save-pre-mcore-014",
    "context parallelism always all-gathers keys/values (same results as p2p/a2a)": "--cp-comm-type",
    "the tokenizers package runs no remote code and loads the fast tokenizer":
        "--trust-remote-code --tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens --legacy-tokenizer",
    "no telemetry service is contacted": "--no-one-logger --one-logger-project --one-logger-run-name "
                                         "--one-logger-async --app-tag-run-name --app-tag-run-version "
                                         "--disable-msc --otel-enabled --otel-service-name",
}
_IGNORED = {
    "logging extra not produced by this driver (it logs loss, lr, grad norm, stage times, "
    "memory and validation loss)":
        "--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-progress "
        "--log-world-size-to-tensorboard --no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard "
        "--tensorboard-log-interval --timing-log-level --timing-log-option "
        "--no-barrier-with-level-1-timing --logging-level --log-energy --log-max-attention-logit "
        "--log-straggler --straggler-ctrlr-port --straggler-minmax-count --disable-straggler-on-startup "
        "--config-logger-dir",
    "Weights & Biases logging is not wired (use --tensorboard-dir)":
        "--wandb-project --wandb-exp-name --wandb-save-dir --wandb-entity",
    "profiling is not wired (use tools/profile_latency.py or torch.profiler around the run)":
        "--profile --profile-step-start --profile-step-end --use-pytorch-profiler --profile-ranks "
        "--record-memory-history --memory-snapshot-path",
}
_HARDWARE = {
    "needs Transformer Engine with FP8 support on a CUDA GPU (Hopper or newer), which this driver does not "
    "drive yet": "--fp8-format --fp8-recipe --fp8-margin --fp8-interval --fp8-amax-history-len "
                 "--fp8-amax-compute-algo --no-fp8-wgrad --disable-fp8-wgrad --fp8-param-gather "
                 "--first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 "
                 "--fp8-quantizer-factory --keep-fp8-transpose-cache --te-precision-config-file "
                 "--reuse-grad-buf-for-mxfp8-param-ag",
    "needs Transformer Engine with FP4 support on a Blackwell GPU":
        "--fp4-format --fp4-recipe --fp4-param-gather --fp4-quantizer-factory",
    "needs Transformer Engine userbuffers on CUDA GPUs with TP > 1, not driven by this driver":
        "--tp-comm-overlap --tp-comm-overlap-cfg --no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad "
        "--no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag "
        "--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag "
        "--disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs --use-nccl-ub",
    "needs CUDA graphs on a GPU, not driven by this driver":
        "--enable-cuda-graph --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl --cuda-graph-scope",
}
_FAMILIES: List[Tuple[str, str]] = [
    # (name prefix, reason): the first matching prefix wins
    ("--moe-", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--num-experts", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--expert-", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--overlap-moe-", "mixture of experts is not supported: this driver trains dense GPT models"),
    ("--mtp-", "multi-token prediction is not supported"),
    ("--multi-latent-attention", "multi-latent attention (MLA) is not supported"),
    ("--q-lora-rank", "multi-latent attention (MLA) is not supported"),
    ("--kv-lora-rank", "multi-latent attention (MLA) is not supported"),
    ("--qk-head-dim", "multi-latent attention (MLA) is not supported"),
    ("--qk-pos-emb-head-dim", "multi-latent attention (MLA) is not supported"),
    ("--v-head-dim", "multi-latent attention (MLA) is not supported"),
    ("--mscale", "multi-latent attention (MLA) is not supported"),
    ("--cache-mla-latents", "multi-latent attention (MLA) is not supported"),
    ("--mla-", "multi-latent attention (MLA) is not supported"),
    ("--rotary-scaling-factor", "multi-latent attention (MLA) is not supported"),
    ("--mamba-", "Mamba / hybrid models are not supported"),
    ("--hybrid-attention-ratio", "Mamba / hybrid models are not supported"),
    ("--hybrid-mlp-ratio", "Mamba / hybrid models are not supported"),
    ("--hybrid-override-pattern", "Mamba / hybrid models are not supported"),
    ("--is-hybrid-model", "Mamba / hybrid models are not supported"),
    ("--disable-mamba-", "Mamba / hybrid models are not supported"),
    ("--linear-", "linear-attention variants are not supported (block top-k sparse attention is)"),
    ("--experimental-attention-variant", "experimental attention variants are not supported "
                                         "(use --sparse-attention)"),
    ("--dsa-", "DeepSeek sparse attention is not supported (use --sparse-attention)"),
    ("--inference-", "inference options do not apply to pretrain_gpt.py"),
    ("--rl-", "reinforcement learning is not supported"),
    ("--grpo-", "reinforcement learning is not supported"),
    ("--langrl-", "reinforcement learning is not supported"),
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
    ("--fim-", "fill-in-the-middle data is not supported"),
    ("--sft", "supervised fine-tuning datasets are not supported (use --mask-prompt-loss)"),
    ("--inprocess-", "in-process restart is not supported (use --save/--load with --exit-signal-handler)"),
    ("--enable-ft-package", "the fault-tolerance package is not supported (see --step-timeout-minutes)"),
    ("--calc-ft-timeouts", "the fault-tolerance package is not supported (see --step-timeout-minutes)"),
    ("--ft-", "the fault-tolerance package is not supported (see --step-timeout-minutes)"),
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
    ("--non-persistent-", "non-persistent (local) checkpoints are not supported"),
    ("--rampup-batch-size", "batch-size ramp-up is not supported"),
    ("--logits-", "logit distillation is not supported"),
    ("--heterogeneous-", "heterogeneous layer configurations are not supported"),
    ("--train-data-path", "separate split files are not supported: give --data-path and --split"),
    ("--valid-data-path", "separate split files are not supported: give --data-path and --split"),
    ("--test-data-path", "separate split files are not supported: give --data-path and --split"),
    ("--use-checkpoint-args", "model flags are not read from checkpoints: pass them (tools/checkpoint/"
                              "convert.py prints them for a converted model)"),
    ("--checkpoint-activations", "deprecated in Megatron-LM: use --recompute-activations"),
    ("--use-legacy-models", "only megatron-core models exist here"),
]
NEUTRAL: Dict[str, str] = {
    "--expert-model-parallel-size": "1",
    "--expert-tensor-parallel-size": "1",
    "--num-experts": "0",
    "--mtp-num-layers": "0",
    "--timing-log-level": "0",
}
"""Flags whose given value means "the feature is off"; honoured (Megatron-LM does the same)."""


def _table() -> Dict[str, Treatment]:
    out: Dict[str, Treatment] = {}
    for kind, groups in (("noop", _NOOP), ("ignored", _IGNORED), ("hardware", _HARDWARE)):
        for reason, names in groups.items():
            for name in names.split():
                out[name] = Treatment(kind, reason)
    return out


TABLE = _table()
"""Explicitly placed flags -> treatment (families and the default are in :func:`treatment`)."""


def megatron_lm_flags() -> Dict[str, object]:
    """Megatron-LM's flags -> argparse nargs (0: switch; None: one value; '*', '+', or a count)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_flags.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)["flags"]


def treatment(flag: str, value: Optional[str] = None) -> Treatment:
    """How a Megatron-LM flag this driver does not define is treated (see module docstring)."""
    if flag in NEUTRAL and value is not None and _same_number(value, NEUTRAL[flag]):
        return Treatment("noop", "its value turns the feature off")
    if flag in TABLE:
        return TABLE[flag]
    for prefix, reason in _FAMILIES:
        if flag.startswith(prefix):
            return Treatment("unsupported", reason)
    return Treatment("unsupported", "not implemented by this driver (docs/usage.md lists what is)")


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every Megatron-LM flag ``parser`` lacks (hidden from ``--help``), so that
    :func:`resolve` can name its treatment instead of argparse saying "unrecognized"."""
    known = {s for a in parser._actions for s in a.option_strings}
    for flag, nargs in megatron_lm_flags().items():
        if flag in known:
            continue
        dest = DEST_PREFIX + flag[2:].replace("-", "_")
        if nargs == 0:
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=dest, nargs=nargs, default=None, help=argparse.SUPPRESS)


def given_foreign(args: argparse.Namespace) -> List[Tuple[str, Optional[str]]]:
    """``(flag, value text)`` of each table-registered flag present in ``args``, in name order."""
    out = []
    for dest, value in sorted(vars(args).items()):
        if dest.startswith(DEST_PREFIX) and value is not None:
            flag = "--" + dest[len(DEST_PREFIX):].replace("_", "-")
            flag = _spelling(flag)
            text = None if value is True else " ".join(map(str, value)) if isinstance(value, list) else str(value)
            out.append((flag, text))
    return out


def _spelling(flag: str) -> str:
    """The table's spelling of ``flag`` (Megatron-LM mixes ``_`` and ``-`` in a few names)."""
    names = megatron_lm_flags()
    if flag in names:
        return flag
    alt = [n for n in names if n.replace("_", "-") == flag]
    return alt[0] if alt else flag


def resolve(args: argparse.Namespace) -> List[str]:
    """Check the Megatron-LM flags given that this driver does not define.

    Returns the warning lines for ``ignored`` flags (one line for all of them); raises
    ``ValueError`` (one line) for the first ``hardware`` or ``unsupported`` flag.
    """
    ignored = []
    for flag, value in given_foreign(args):
        t = treatment(flag, value)
        if t.kind == "ignored":
            ignored.append(flag)
        elif t.kind in ("hardware", "unsupported"):
            raise ValueError(f"{flag}: {t.reason}")
    if not ignored:
        return []
    return [f"accepted without effect: {' '.join(ignored)} ({treatment(ignored[0]).reason})"
            if len({treatment(f).reason for f in ignored}) == 1 else
            f"accepted without effect (logging/profiling extras this driver does not produce): {' '.join(ignored)}"]


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_hardware(args: argparse.Namespace, cuda: bool) -> None:
    """Hardware-bound flags this driver defines: fine where the GPU / library is present,
    else ``ValueError`` with one line naming the flag and what it needs."""
    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16)):
        if on and not cuda:
            raise ValueError(f"{flag} needs CUDA (the CPU path trains in fp32; drop {flag} or "
                             "run on a GPU without --cpu)")
    if args.distributed_backend == "nccl" and not cuda:
        raise ValueError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    te = args.transformer_impl == "transformer_engine"
    if te and not (cuda and _importable("transformer_engine")):
        missing = " and ".join(x for x, ok in (("CUDA", cuda), ("the transformer_engine package",
                                                                 _importable("transformer_engine"))) if not ok)
        raise ValueError(f"--transformer-impl transformer_engine needs {missing} (or pass "
                         "--transformer-impl local, this driver's default)")
    if te and args.sparse_attention:
        raise ValueError("--transformer-impl transformer_engine with --sparse-attention: the sparse "
                         "attention is this project's core-attention module; use --transformer-impl local")
    if te and args.context_parallel_size > 1:
        raise ValueError("--transformer-impl transformer_engine with --context-parallel-size > 1 is not "
                         "supported (this driver's CP attention is its own); use --transformer-impl local")
    if args.attention_backend in ("flash", "fused") and not te:
        flag = "--use-flash-attn (= --attention-backend flash)" if args.use_flash_attn else \
            f"--attention-backend {args.attention_backend}"
        raise ValueError(f"{flag} is Transformer Engine's: it needs "
                         "--transformer-impl transformer_engine on a CUDA GPU with transformer_engine "
                         "(auto/local/unfused use this project's attention)")
    if args.sequence_parallel:  # TP > 1 here (arguments.py turns it off with TP = 1, as Megatron-LM does)
        raise ValueError("--sequence-parallel with --tensor-model-parallel-size > 1 splits every "
                         "micro-batch's tokens over TP ranks; packed micro-batches of varying length "
                         "are not supported with it")


def split_script_flags(tokens: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """``[(flag, values)]`` of a launch command's arguments: values are the tokens after a
    flag up to the next ``--`` token (how a shell-split Megatron-LM command reads)."""
    out: List[Tuple[str, List[str]]] = []
    for tok in tokens:
        if tok.startswith("--"):
            name, eq, val = tok.partition("=")
            out.append((name, [val] if eq else []))
        elif out:
            out[-1][1].append(tok)
    return out
