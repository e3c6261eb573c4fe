"""A converted or trained checkpoint as a single-process model for evaluation scripts.

Builds the GPT the way the driver does (``megatron/training/model.py``) with PP=1 and
the attention an evaluation asks for, and loads the weights through megatron's
dist_checkpointing. Used by ``benchmarks/eval_longctx.py``, ``real_accuracy.py``,
``sparsity_study.py``, ``attention_recall.py``, ``heldout_loss.py`` and ``real_finetune.py``.
"""

from __future__ import annotations

import argparse
import os


class EvalModelError(Exception):
    """Checkpoint cannot be used; reported as one line (``code`` is the exit status)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def eval_args(train_args, *, sparse: bool, sb_topk, sb_block_size, backend):
    """The checkpoint's arguments with the layout and attention of this evaluation."""
    import copy

    from megatron.training.arguments import build_parser

    args = copy.copy(train_args)
    # Checkpoints saved before a flag existed lack it: take the flag's default.
    for name, value in vars(build_parser().parse_args([])).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    args.tensor_model_parallel_size = 1
    args.pipeline_model_parallel_size = 1
    args.num_layers_per_virtual_pipeline_stage = None
    args.virtual_pipeline_model_parallel_size = None
    args.sparse_attention = sparse
    if sb_topk is not None:
        args.sb_topk = sb_topk
    if sb_block_size is not None:
        args.sb_block_size = sb_block_size
    if backend is not None:
        args.sb_attention_backend = backend
    for name in ("sb_topk", "sb_block_size"):
        if sparse and (getattr(args, name, None) or 0) < 1:
            raise EvalModelError(f"--{name.replace('_', '-')} must be >= 1")
    return args


class EvalModel:
    """A single-process GPTModel seen as ``logits(seqs)`` (see benchmarks.harness.longctx.runner)."""

    def __init__(self, gpt, args):
        self.gpt = gpt.eval()
        self.args = args
        self.max_positions = int(args.max_position_embeddings)
        self.device = next(gpt.parameters()).device
        self.iteration = None  # set by load_eval_model

    def logits(self, seqs):
        """``[T_i]`` token tensors -> ``[T_i, V]`` logits, one packed THD forward."""
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        lens = [len(s) for s in seqs]
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        tokens = torch.cat(seqs).view(1, -1).to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).view(1, -1).to(self.device)
        out = self.gpt(tokens, pos, None, packed_seq_params=packed)  # [1, T, V]
        return list(out[0].float().cpu().split(lens))

    def close(self) -> None:
        from megatron.training.initialize import shutdown

        shutdown()


def build_eval_model(train_args, load_weights, **attention) -> EvalModel:
    """Initialise a world of one, build the GPT as the driver does, load weights.

    ``load_weights(chunks)`` fills the driver's (DDP-wrapped) model chunks.
    """
    from megatron.training.initialize import initialize, use_cpu
    from megatron.training.model import build_model, transformer_config
    from megatron.training.tokenizer import padded_vocab_size, vocab_size_for

    args = eval_args(train_args, **attention)
    if args.sparse_attention:
        try:
            import sparsebalance.attention.sparse  # noqa: F401
        except ImportError as e:
            raise EvalModelError(f"--sparse-attention: the sparse attention module is not available ({e})",
                                 code=1) from None
    initialize(args)
    try:
        config = transformer_config(args, use_cpu(args))
        vocab = padded_vocab_size(
            vocab_size_for(args.tokenizer_type, getattr(args, "tokenizer_model", None), args.vocab_size),
            args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
        chunks = build_model(args, config, vocab)
        load_weights(chunks)
    except BaseException:
        from megatron.training.initialize import shutdown

        shutdown()
        raise
    return EvalModel(chunks[0].module, args)  # the DDP wrapper is not needed for inference


def stored_train_args(root: str, iteration: int):
    """The argparse Namespace saved in the checkpoint's common state, or None."""
    from megatron.core import dist_checkpointing

    from megatron.training.checkpointing import iter_dir

    common = dist_checkpointing.load_common_state_dict(iter_dir(root, iteration))
    stored = common.get("args") if isinstance(common, dict) else None
    if stored is None:
        return None
    return argparse.Namespace(**stored) if isinstance(stored, dict) else stored


def parse_train_args(flags: str):
    """``--train-args``: pretrain_gpt.py's flags -> the Namespace the driver builds the model from."""
    import shlex

    from megatron.training.arguments import build_parser, derive_model_fields

    parser = build_parser()

    def refuse(message):
        raise EvalModelError(f"--train-args: {message}")

    parser.error = refuse  # one line, exit 2, where the caller reports EvalModelError
    args = parser.parse_args(shlex.split(flags))
    # The derived model fields arguments.validate() fills (it also checks data files,
    # which evaluation does not need).
    derive_model_fields(args)
    args.virtual_pipeline_model_parallel_size = None
    return args


def load_eval_model(root: str, train_flags, **attention) -> EvalModel:
    """The latest checkpoint under ``root`` (pretrain_gpt.py's --save) as an EvalModel.

    The model is rebuilt from the arguments stored in the checkpoint; when it has
    none, from ``train_flags`` (the pretrain_gpt.py flags it was trained with).
    Weights load through megatron's dist_checkpointing, whose global layer keys
    let a PP=2 (or any layout) checkpoint load into this PP=1 model.
    """
    from megatron.training.checkpointing import load_weights, read_tracker

    try:
        iteration = read_tracker(root)
    except ValueError as e:
        raise EvalModelError(str(e)) from None
    if iteration is None:
        raise EvalModelError(f"--load: no checkpoint in {root} (no latest_checkpointed_iteration.txt)")
    stored = stored_train_args(root, iteration)
    if stored is None and train_flags is None:
        raise EvalModelError(f"--load: checkpoint {root} does not store its training arguments; "
                             f"pass the pretrain_gpt.py model flags with --train-args")
    train_args = parse_train_args(train_flags) if train_flags is not None else stored

    def weights(chunks):
        try:
            load_weights(root, chunks)
        except ValueError as e:
            raise EvalModelError(str(e)) from None

    model = build_eval_model(train_args, weights, **attention)
    model.iteration = iteration
    return model


def open_eval_model(root: str, train_flags, threads, fail_fn, **attention):
    """``load_eval_model`` for a command line: quiet imports, ``threads`` torch threads
    (default: OMP_NUM_THREADS, else torch's), load errors to ``fail_fn(message, code)``.

    Returns ``(model, threads)``.
    """
    import warnings

    import torch

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    # torch.distributed.checkpoint's deprecation notices while megatron reads the
    # checkpoint are not actionable here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing")
    threads = threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return load_eval_model(root, train_flags, **attention), threads
    except EvalModelError as e:
        fail_fn(str(e), e.code)
