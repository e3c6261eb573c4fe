"""Cross-flag checks of ``pretrain_gpt.py``'s command line, by topic (called by
:func:`megatron.training.arguments.validate`): Megatron-LM's spellings and refusals,
tokenizer files, SparseBalance, distributed optimizer, activation recomputation.
Each raises :class:`UsageError` (one line, exit 2). This module sits below
``arguments.py``: it imports nothing of the command line's, so the two form no loop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Iterator, Optional, Tuple

from sparsebalance.batching.strategies import STRATEGIES

DEFAULT_LOSS_CHUNK_TOKENS = 4096
"""Tokens per chunk of ``--cross-entropy-fusion-impl linear`` without ``--sb-loss-chunk-tokens``:
one chunk's fp32 logits over a 152K vocabulary are 2.5 GB, and its output-layer GEMM
(4096 x hidden x vocab) stays large enough to run at full speed."""


class UsageError(Exception):
    """Bad command line or input; reported as one line, exit code 2."""


_ASSUMED: Optional[Tuple[bool, bool]] = None
"""(CUDA, Transformer Engine) a launch-line check validates for (:func:`assume_hardware`);
None: this machine's."""


@contextlib.contextmanager
def assume_hardware(cuda: bool, te: bool) -> Iterator[None]:
    """Validate command lines as on a machine with (or without) CUDA and Transformer Engine:
    ``tools/check_launch_script.py --cuda --te`` judges a line for its target, not this machine."""
    global _ASSUMED
    before, _ASSUMED = _ASSUMED, (cuda, te)
    try:
        yield
    finally:
        _ASSUMED = before


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (torch imported on first use: ``--help`` stays fast)."""
    if _ASSUMED is not None:
        return _ASSUMED[0]
    import torch

    return torch.cuda.is_available()


def has_transformer_engine() -> bool:
    """Whether the ``transformer_engine`` package is installed (or assumed, see :func:`assume_hardware`)."""
    if _ASSUMED is not None:
        return _ASSUMED[1]
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def validate_megatron_lm(args: argparse.Namespace) -> None:
    """Megatron-LM's spellings, its rules, and the flags this driver refuses (one line each)."""
    from megatron.training import compat

    args.compat_warnings = list(getattr(args, "compat_warnings", None) or [])
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    # Megatron-LM: --no-position-embedding (add_position_embedding=False) only drops learned
    # absolute embeddings, which RoPE has none of; with any other type it is an error there.
    if args.no_position_embedding and args.position_embedding_type != "rope":
        raise UsageError("--no-position-embedding is deprecated, use --position-embedding-type (rope, or none "
                         "for no position signal); Megatron-LM refuses it without rope too")
    # --use-flash-attn: Megatron-LM main parses it and reads it nowhere (the backend stays
    # --attention-backend's), so it changes nothing here either.
    resolve_tokenizer_default(args)
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise UsageError("--recompute-activations means --recompute-granularity selective, but "
                             f"--recompute-granularity {args.recompute_granularity} was given")
        args.recompute_granularity = "selective"
    if args.deterministic_mode and args.cross_entropy_loss_fusion:
        raise UsageError("--deterministic-mode with --cross-entropy-loss-fusion: Megatron-LM requires the loss "
                         "unfused for determinism; drop one")
    if args.fp16 and args.bf16:
        raise UsageError("give --fp16 or --bf16, not both")
    if args.fp16 and not args.loss_scale and args.check_for_nan_in_loss_and_grad:
        # Megatron-LM's rule: non-finite gradients are the dynamic loss scaler's signal
        args.check_for_nan_in_loss_and_grad = False
        args.compat_warnings.append("--fp16 with dynamic loss scaling: no stop on a non-finite loss or grad norm "
                                    "(as in Megatron-LM; overflowing steps are skipped)")
    if args.squared_relu and args.swiglu:
        raise UsageError("give --squared-relu or --swiglu, not both (Megatron-LM asserts the same)")
    if args.test_mode and args.qk_layernorm and args.normalization != "LayerNorm":
        raise UsageError("--test-mode compares the q/k norms' weights and biases: --normalization "
                         f"{args.normalization} has no bias (use LayerNorm, or drop --test-mode)")
    for flag, value in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if value > 1:  # torch's Dropout takes [0, 1]
            raise UsageError(f"{flag} {value:g}: a dropout probability is at most 1")
    if args.ckpt_format not in ("torch_dist", "torch"):
        raise UsageError(f"--ckpt-format {args.ckpt_format}: this driver writes torch_dist checkpoints "
                         "(Megatron-LM's default) and reads those and legacy --ckpt-format torch ones")
    if args.transformer_impl == "inference_optimized":
        raise UsageError("--transformer-impl inference_optimized: inference layers do not apply to training")
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise UsageError(f"--profile-step-end {args.profile_step_end} must be after --profile-step-start "
                         f"{args.profile_step_start}")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron-LM turns it off too: nothing to split without TP
    if args.ckpt_format == "torch" and args.save:
        args.compat_warnings.append("--ckpt-format torch: Megatron-LM's legacy checkpoints are loaded, but --save "
                                    "writes torch_dist (which --load reads too)")
    try:
        args.compat_warnings += compat.resolve(args)
        args.compat_warnings += compat.check_hardware(args, cuda=has_cuda() and not args.cpu)
    except ValueError as e:
        raise UsageError(str(e))


def resolve_tokenizer_default(args: argparse.Namespace) -> None:
    """No ``--tokenizer-type``: Megatron-LM's ``pretrain_gpt.py`` default, GPT2BPETokenizer, where
    its files are given; without them (Megatron-LM stops there) ByteTokenizer, with one warning."""
    if args.tokenizer_type is not None:
        return
    if args.vocab_file or args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"
    else:
        args.tokenizer_type = "ByteTokenizer"
        args.compat_warnings.append("no --tokenizer-type: Megatron-LM's default GPT2BPETokenizer needs --vocab-file "
                                    "and --merge-file; training with ByteTokenizer (UTF-8 bytes)")


def validate_tokenizer(args: argparse.Namespace) -> None:
    """The files each ``--tokenizer-type`` reads are given, and no tokenizer flag goes unread."""
    from megatron.training.tokenizer import SENTENCEPIECE_TYPES, unused_tokenizer_files

    t = args.tokenizer_type
    if t == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise UsageError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or "
                         "a directory holding one)")
    if t in SENTENCEPIECE_TYPES and not args.tokenizer_model:
        raise UsageError(f"--tokenizer-type {t} needs --tokenizer-model (tokenizer.model)")
    if t == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise UsageError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                         "--merge-file (merges.txt)")
    if t == "NullTokenizer" and args.vocab_size is None:
        raise UsageError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.null_tokenizer_pad_id != -1:
        if t != "NullTokenizer":
            raise UsageError(f"--null-tokenizer-pad-id is read by --tokenizer-type NullTokenizer only, not {t}")
        if not 0 <= args.null_tokenizer_pad_id < args.vocab_size:
            raise UsageError(f"--null-tokenizer-pad-id {args.null_tokenizer_pad_id} is not a token id of "
                             f"--vocab-size {args.vocab_size} (or -1: no pad token)")
    unused = unused_tokenizer_files(t, args.tokenizer_model, args.vocab_file, args.merge_file)
    if unused:
        raise UsageError(f"{unused[0]} is not read by --tokenizer-type {t}: give the --tokenizer-type that "
                         f"reads it (HuggingFaceTokenizer, GPT2BPETokenizer, Llama2Tokenizer, ...)")


_SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _schedule_number(word: str) -> Optional[int]:
    """Megatron-LM's number in a schedule entry: an optional K/M/B/T suffix, ``int(float(x) * unit)``
    (None: not a number)."""
    word = word.strip().upper()
    unit = word[-1:] if word[-1:] in "KMBT" and word[-1:] else ""
    try:
        return int(float(word[:len(word) - len(unit)]) * _SUFFIX[unit])
    except ValueError:
        return None


def validate_batch_schedule(args: argparse.Namespace) -> None:
    """Megatron-LM's ``--step-batch-size-schedule "THRESHOLD:BS ..."`` (megatron-core's
    ``StepBatchsizeNumMicroBatchesCalculator``): entries split at spaces or commas, sorted by
    threshold; thresholds are tokens (``pretrain_gpt.py`` always has a ``--seq-length``), turned
    into samples by ``// --seq-length``; the first must be 0, the rest strictly increasing, every
    batch positive. Each iteration trains the batch of the last entry whose threshold the samples
    consumed before it reach. Sets ``args.batch_schedule`` (``[(samples, batch)]``) and
    ``args.global_batch_size`` to the first entry's batch; :func:`check_batch_schedule_run`
    refuses a run that would reach a later entry. ``--no-pad-vocab-size`` is resolved here too
    (it sets the padding multiple to 1)."""
    if not args.pad_vocab_size:
        args.make_vocab_size_divisible_by = 1
    args.batch_schedule = None
    text = args.step_batch_size_schedule
    if text is None:
        return
    if args.global_batch_size is not None:
        raise UsageError("give --step-batch-size-schedule or --global-batch-size, not both (as in Megatron-LM)")
    entries = []
    for word in text.replace(",", " ").split():
        at, colon, size = word.partition(":")
        at, size = _schedule_number(at), _schedule_number(size)
        if not colon or at is None or size is None:
            raise UsageError(f"--step-batch-size-schedule: {word!r} is not THRESHOLD:BATCH (e.g. 0:256 or 250B:512)")
        entries.append((at // args.seq_length, size))
    entries.sort(key=lambda e: e[0])
    if not entries or entries[0][0] != 0:
        raise UsageError(f"--step-batch-size-schedule {text!r}: the first entry must start at 0 (thresholds are "
                         f"tokens; below one --seq-length {args.seq_length} they are 0 samples)")
    for (before, _), (after, _) in zip(entries, entries[1:]):
        if after <= before:
            raise UsageError(f"--step-batch-size-schedule {text!r}: thresholds must be strictly increasing "
                             f"({before} then {after} samples of --seq-length {args.seq_length})")
    bad = [bs for _, bs in entries if bs <= 0]
    if bad:
        raise UsageError(f"--step-batch-size-schedule {text!r}: batch size {bad[0]} is not positive")
    args.batch_schedule = entries
    args.global_batch_size = entries[0][1]


def check_batch_schedule_run(args: argparse.Namespace) -> None:
    """After ``args.train_iters`` is resolved: the run of ``--step-batch-size-schedule`` trains
    the first entry's batch B at every iteration when the samples consumed before its last
    iteration, (train_iters - 1) x B, stay below the next threshold; otherwise the batch would
    change during the run, which this driver does not do (one line naming where)."""
    schedule = getattr(args, "batch_schedule", None)
    if not schedule or len(schedule) == 1:
        return
    first, (threshold, size) = schedule[0][1], schedule[1]
    if (args.train_iters - 1) * first >= threshold:
        at = -(-threshold // first) + 1  # the first iteration whose consumed samples reach it
        raise UsageError(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: the global batch would "
                         f"change from {first} to {size} at iteration {at} ({threshold} samples consumed) of the "
                         f"run's {args.train_iters}; a batch that changes during the run is not supported here "
                         "(train to that iteration, or give one size)")


def validate_balance(args: argparse.Namespace) -> None:
    """Resolve --sparse-balance and check the SAB / DST / predictor flags."""
    if args.sparse_balance:
        args.sparse_attention = True
    if args.sb_batching is None:
        args.sb_batching = "sab" if args.sparse_balance else "megatron"
    if args.sb_dst is None:
        args.sb_dst = "critical-path" if args.sparse_balance else "off"
    if args.sb_dst != "off" and not args.sparse_attention:
        raise UsageError(f"--sb-dst {args.sb_dst} tunes sparse-attention budgets: it needs "
                         "--sparse-attention (or --sparse-balance)")
    k0 = args.sb_topk
    args.sb_topk_min = k0 // 2 if args.sb_topk_min is None else args.sb_topk_min
    args.sb_topk_max = 2 * k0 if args.sb_topk_max is None else args.sb_topk_max
    if not args.sb_topk_min <= k0 <= args.sb_topk_max:
        raise UsageError(f"need --sb-topk-min {args.sb_topk_min} <= --sb-topk {k0} <= "
                         f"--sb-topk-max {args.sb_topk_max}")
    if (args.sparse_attention and args.sb_attention_backend in ("flex", "fa4")
            and (getattr(args, "context_parallel_size", 1) or 1) > 1):
        raise UsageError(f"--sb-attention-backend {args.sb_attention_backend} does not run with "
                         "--context-parallel-size > 1 (its kernels take whole documents in a "
                         "block-aligned buffer): use auto, triton, cuda, cpu or reference")
    if args.sb_threshold is not None and args.sb_routing != "threshold":
        raise UsageError("--sb-threshold needs --sb-routing threshold")
    if getattr(args, "sb_threshold_counts", None) is not None and args.sb_routing != "threshold":
        raise UsageError("--sb-threshold-counts needs --sb-routing threshold")
    if args.sb_routing == "threshold":
        if not args.sparse_attention:
            raise UsageError("--sb-routing threshold needs --sparse-attention (or --sparse-balance)")
        args.sb_threshold = 0.9 if args.sb_threshold is None else args.sb_threshold
        args.sb_threshold_counts = args.sb_threshold_counts or "per-head"
        if not 0.0 < args.sb_threshold <= 1.0:
            raise UsageError(f"--sb-threshold must be in (0, 1], got {args.sb_threshold}")
    args.sb_dst_taus = dst_taus(args)
    if not 0.0 < args.sb_p < 1.0:
        raise UsageError(f"--sb-p must be in (0, 1), got {args.sb_p}")
    if not 0.0 <= args.sb_attn_slack < 1.0:
        raise UsageError(f"--sb-attn-slack must be in [0, 1), got {args.sb_attn_slack}")
    if args.sb_dst_sensitivity != "off":
        if args.sb_dst == "off":
            raise UsageError("--sb-dst-sensitivity refines DST's budgets: it needs --sb-dst")
        if args.sb_sensitivity_study is None:
            raise UsageError("--sb-dst-sensitivity estimate needs --sb-sensitivity-study PATH")
    if args.sb_sensitivity_study is not None and args.sb_dst_sensitivity == "off":
        raise UsageError("--sb-sensitivity-study needs --sb-dst-sensitivity estimate")
    args.sb_stage_weight = stage_weight(args)
    if args.sb_profile is not None and args.sb_cost_model is not None:
        raise UsageError("give either --sb-profile or --sb-cost-model, not both")
    if args.sb_cost_model is not None:
        from sparsebalance.predictor import ANALYTIC_MODELS

        if args.sb_cost_model not in ANALYTIC_MODELS:
            raise UsageError(f"--sb-cost-model: unknown model {args.sb_cost_model!r} "
                             f"(known: {', '.join(sorted(ANALYTIC_MODELS))}; or --sb-profile PATH)")
    args.sb_has_predictor = args.sb_profile is not None or args.sb_cost_model is not None
    packer_needs = STRATEGIES[args.sb_batching].predictor == "required"
    needs = [f for f, on in ((f"--sb-batching {args.sb_batching}", packer_needs),
                             (f"--sb-dst {args.sb_dst}", args.sb_dst != "off")) if on]
    if needs and not args.sb_has_predictor:
        raise UsageError(f"{' and '.join(needs)} plan from predicted latency: give --sb-profile "
                         "PATH (made by tools/profile_latency.py) or --sb-cost-model h100-analytic")
    from megatron.training.pipeline_layout import check_auto

    if check_auto(args) is not None:
        raise UsageError(check_auto(args))
    if args.sb_allow_stale_profile and args.sb_profile is None:
        raise UsageError("--sb-allow-stale-profile needs --sb-profile")
    if args.sb_timeline is not None and not args.sb_has_predictor:
        raise UsageError("--sb-timeline compares predicted and measured timelines: it needs "
                         "--sb-profile or --sb-cost-model")
    for name in ("sb_timeline", "summary_json"):
        path = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if path is not None and name == "summary_json" and os.path.isdir(path):
            raise UsageError(f"{flag} {path} is a directory")
        if path is not None and name == "sb_timeline" and os.path.isfile(path):
            raise UsageError(f"{flag} {path} is a file, expected a directory")


def validate_wandb(args: argparse.Namespace) -> None:
    """``--wandb-*`` (megatron/training/wandb_log.py): where Megatron-LM's last rank fails when it
    opens the W&B run, one line at parse here."""
    if not args.wandb_project:
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:  # Megatron-LM: its `import wandb` raises
        raise UsageError("--wandb-project needs the wandb package (pip install wandb; Megatron-LM fails on "
                         "its import too)")
    if args.wandb_exp_name == "":  # Megatron-LM's ValueError
        raise UsageError("--wandb-exp-name is empty: give the W&B run a name (or leave the flag out)")
    if not args.wandb_save_dir and not args.save:  # Megatron-LM: os.path.join(args.save, 'wandb') raises
        raise UsageError("--wandb-project needs --wandb-save-dir or --save (the run's files go to SAVE/wandb)")


def validate_dropout(args: argparse.Namespace) -> None:
    """Dropout (Megatron-LM's defaults 0.1): megatron-core applies the hidden dropout; the dense
    attention modules drop attention probabilities, the sparse kernels cannot."""
    if args.attention_dropout > 0 and args.sparse_attention:
        raise UsageError(f"--attention-dropout {args.attention_dropout:g} with --sparse-attention: the sparse "
                         "attention kernels apply no dropout; pass --attention-dropout 0 (or leave it out)")
    if args.load and (args.hidden_dropout > 0 or args.attention_dropout > 0):
        args.compat_warnings.append("dropout with --load: checkpoints hold no RNG state, so a resumed run draws "
                                    "other dropout masks than an uninterrupted one")


def validate_distributed_optimizer(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the overlap flags."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise UsageError("--overlap-param-gather is only supported with --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise UsageError("--overlap-param-gather needs --overlap-grad-reduce")


def dst_taus(args: argparse.Namespace):
    """``--sb-dst-taus`` as a tuple of TAUs (None without the flag), and ``--sb-dst-tau-study``
    checked to go with it; UsageError (one line) for a ladder DST cannot use."""
    text = getattr(args, "sb_dst_taus", None)
    study = getattr(args, "sb_dst_tau_study", None)
    for flag, given in (("--sb-dst-taus", text is not None), ("--sb-dst-tau-study", study is not None)):
        if given and (args.sb_routing != "threshold" or args.sb_dst == "off"):
            raise UsageError(f"{flag} prices DST's TAU levels: it needs --sb-routing threshold and --sb-dst")
    if study is not None:
        from sparsebalance.batching.tau_curve import TauCurve

        try:
            TauCurve.from_study(study)
        except ValueError as e:
            raise UsageError(f"--sb-dst-tau-study {e}") from None
    if text is None or isinstance(text, tuple):
        return text
    from sparsebalance.config import check_ladder

    try:
        taus = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise UsageError(f"--sb-dst-taus {text}: expected a comma list of TAUs, e.g. 0.8,0.85,0.9,0.95") from None
    why = check_ladder(taus, args.sb_threshold)
    if why:
        raise UsageError(f"--sb-dst-taus {text}: {why}")
    return taus


def stage_weight(args: argparse.Namespace):
    """DST's weight per (virtual) stage from ``--sb-stage-sensitivity`` (a tuple; None without
    the flag); UsageError naming what does not fit the run."""
    path = getattr(args, "sb_stage_sensitivity", None)
    if path is None:
        return None
    if args.sb_dst == "off":
        raise UsageError("--sb-stage-sensitivity refines DST's budgets: it needs --sb-dst")
    from sparsebalance.tuning.stage_sensitivity import read_stage_profile

    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1  # set by validate() first
    stages = args.pipeline_model_parallel_size * vpp
    try:
        layers = chunk_layers(args)
        return tuple(float(x) for x in read_stage_profile(path).weights(stages, args.num_layers, layers))
    except ValueError as e:
        raise UsageError(f"--sb-stage-sensitivity {e}") from None


def stage_layers(args: argparse.Namespace) -> list:
    """Transformer layers of each pipeline stage (megatron-core's placement for the
    pipeline-split flags; :func:`megatron.training.pipeline_layout.stage_layers`)."""
    from megatron.training import pipeline_layout

    pp = args.pipeline_model_parallel_size
    if not pipeline_layout.given(args):
        return [args.num_layers // pp] * pp
    return pipeline_layout.stage_layers(args)


def chunk_layers(args: argparse.Namespace) -> list:
    """Transformer layers of each model chunk, virtual stage ``c * PP + r`` (PP entries without
    the interleaved schedule; :func:`megatron.training.pipeline_layout.chunk_layers`)."""
    from megatron.training import pipeline_layout

    if not pipeline_layout.given(args):
        vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        stages = args.pipeline_model_parallel_size * vpp
        return [args.num_layers // stages] * stages
    return pipeline_layout.chunk_layers(args)


def validate_pipeline_layout(args: argparse.Namespace) -> None:
    """``--num-layers`` over the pipeline stages: evenly, or as Megatron-LM's pipeline-split
    flags place them (:mod:`megatron.training.pipeline_layout`; not with the interleaved
    schedule, whose chunks this driver keeps equal)."""
    from megatron.training import pipeline_layout

    # --sb-auto-layout picks the split in setup (checked in validate_balance)
    if not pipeline_layout.given(args) and not args.sb_auto_layout and \
            args.num_layers % args.pipeline_model_parallel_size:
        raise UsageError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}")
    error = pipeline_layout.validate(args)
    if error is not None:
        raise UsageError(error)


def validate_recompute(args: argparse.Namespace) -> None:
    """Megatron-LM's rules: full needs a method and a layer count, selective takes neither."""
    gran, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if gran is None:  # Megatron-LM ignores them then
        given = [flag for flag, value in (("--recompute-method", method), ("--recompute-num-layers", n))
                 if value is not None]
        if given:
            args.compat_warnings.append(f"{' and '.join(given)} without --recompute-granularity: nothing is "
                                        "recomputed (as in Megatron-LM)")
        args.recompute_method = args.recompute_num_layers = None
        return
    if gran == "selective":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", n)):
            if value is not None:
                raise UsageError(f"--recompute-granularity selective recomputes core attention only: "
                                 f"it takes no {flag}")
        return
    if method is None:
        raise UsageError("--recompute-granularity full needs --recompute-method uniform or block")
    # megatron-core applies the method to each model chunk's layers (one chunk per virtual stage);
    # uneven stages; a layout's stage or a counted embedding / loss chunk may hold no layer
    # (nothing to recompute there)
    chunks = sorted(set(chunk_layers(args)) - {0})
    chunk = chunks[0]
    if n is None:
        raise UsageError(f"--recompute-granularity full needs --recompute-num-layers (1 .. {chunk}, "
                         "the layers of one model chunk)")
    if n > chunk:
        raise UsageError(f"--recompute-num-layers {n} is more than the {chunk} layers of a model chunk "
                         "(num layers / PP / virtual stages)")
    if method == "uniform" and any(c % n for c in chunks):
        raise UsageError(f"--recompute-method uniform needs --recompute-num-layers {n} to divide the "
                         f"{next(c for c in chunks if c % n)} layers of a model chunk")


def validate_loss_chunks(args: argparse.Namespace) -> None:
    """Megatron-LM's rule (its dev branch): the linear fusion needs --cross-entropy-loss-fusion.
    Sets ``args.loss_chunk_tokens``: tokens per chunk of the output layer + loss, 0 = unchunked."""
    linear = args.cross_entropy_fusion_impl == "linear"
    if linear and not args.cross_entropy_loss_fusion:
        args.compat_warnings.append("--cross-entropy-fusion-impl linear without --cross-entropy-loss-fusion: "
                                    "the loss is not fused (as in Megatron-LM)")
    if args.sb_loss_chunk_tokens is not None and not (linear and args.cross_entropy_loss_fusion):
        raise UsageError("--sb-loss-chunk-tokens sets the chunks of --cross-entropy-loss-fusion "
                         "--cross-entropy-fusion-impl linear; add those two flags")
    chunk = args.sb_loss_chunk_tokens or DEFAULT_LOSS_CHUNK_TOKENS
    args.loss_chunk_tokens = chunk if linear and args.cross_entropy_loss_fusion else 0
