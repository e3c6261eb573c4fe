"""Maximal Update Parameterization (muP): Megatron-LM main's ``--use-mup`` and its ``--mup-*`` flags.

megatron-core 0.16.1 (the one this driver runs on) has no muP; Megatron-LM main has it in
``TransformerConfig.__post_init__``, ``LanguageModule`` / ``LanguageModelEmbedding`` /
``GPTModel`` and ``get_mup_config_overrides`` (megatron/core/optimizer). This module gives
the same model and the same optimizer groups from the driver's side, with the width
multiplier ``m = hidden_size / --mup-base-hidden-size`` (base: the hidden size, m = 1):

* init: hidden weights N(0, std / sqrt(m)); the output projections of attention and MLP
  N(0, std / (sqrt(2 L) sqrt(m))); the embeddings N(0, std), unscaled, and so is an untied
  output layer (``std`` = ``--init-method-std``);
* attention: softmax scale ``sqrt(--mup-base-head-dim or 1) / kv_channels ** --mup-attn-scale-power``
  (1 / d_head by default, in the core-attention slot: dense or sparse);
* the embedding output times ``--mup-embedding-mult``; the logits times ``--mup-output-mult``,
  which is set to 1 / m when left at 1.0 and m != 1 (as upstream);
* optimizer (Adam): matrix-like hidden parameters (2-D and more, not embedding or output) get
  LR and min LR / m and Adam epsilon / m; vector-like ones (biases, norms, embeddings, the
  output layer) keep the base values. SGD: vector-like LR x m. With ``--decoupled-lr`` the
  embedding and output parameters keep the decoupled LR, as upstream.

``--mup-width-mult`` is recomputed from the hidden sizes under ``--use-mup`` (upstream
overwrites it too); without ``--use-mup`` the ``--mup-*`` flags change nothing, as upstream.
Multi-latent attention with muP is refused (its softmax scale is MLA's own).
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Dict, Optional

import torch

from megatron.training.arg_checks import UsageError


def add_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM main's muP flags (``TransformerConfig`` fields: names, types, defaults)."""
    from megatron.training.arguments import _positive  # at call time: arguments imports families

    g = p.add_argument_group("muP (Megatron-LM main's flags and meaning; see mup.py)")
    g.add_argument("--use-mup", action="store_true",
                   help="Maximal Update Parameterization: width-scaled init, LR and Adam eps per parameter "
                        "group, 1/d attention, output multiplier")
    g.add_argument("--mup-base-hidden-size", type=_positive(int), default=None, metavar="H",
                   help="hidden size of the base model (default: --hidden-size, width multiplier 1)")
    g.add_argument("--mup-width-mult", type=float, default=1.0,
                   help="recomputed as --hidden-size / --mup-base-hidden-size under --use-mup (as upstream)")
    g.add_argument("--mup-embedding-mult", type=float, default=1.0, help="multiplier of the embedding output")
    g.add_argument("--mup-output-mult", type=float, default=1.0,
                   help="multiplier of the logits (left at 1.0: 1 / width multiplier)")
    g.add_argument("--mup-base-head-dim", type=float, default=None,
                   help="softmax scale = sqrt(this) / kv_channels ** --mup-attn-scale-power (default: 1 / ...)")
    g.add_argument("--mup-attn-scale-power", type=float, default=1.0,
                   help="power of kv_channels in the softmax scale (1.0: muP's 1/d; 0.5: standard)")


def validate(args: argparse.Namespace) -> None:
    """Upstream's ``__post_init__`` resolution: the width multiplier and the output multiplier."""
    if not getattr(args, "use_mup", False):
        return
    if getattr(args, "multi_latent_attention", False):
        raise UsageError("--use-mup with --multi-latent-attention is not supported (MLA's softmax scale is its own)")
    if args.mup_base_hidden_size is None:
        args.mup_base_hidden_size = args.hidden_size
    args.mup_width_mult = args.hidden_size / args.mup_base_hidden_size
    if args.mup_output_mult == 1.0 and args.mup_width_mult != 1.0:
        args.mup_output_mult = 1.0 / args.mup_width_mult


def softmax_scale(args: argparse.Namespace) -> float:
    """``sqrt(base_head_dim or 1) / kv_channels ** power`` (kv_channels: hidden / heads unless given)."""
    kv = args.kv_channels or args.hidden_size // args.num_attention_heads
    base = 1.0 if args.mup_base_head_dim is None else args.mup_base_head_dim ** 0.5
    return base / kv ** args.mup_attn_scale_power


def _normal(std: float):
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


def config_fields(args: argparse.Namespace) -> dict:
    """``TransformerConfig`` fields for muP (none without ``--use-mup``)."""
    if not getattr(args, "use_mup", False):
        return {}
    std, m = args.init_method_std, args.mup_width_mult
    return {"init_method": _normal(std / math.sqrt(m)),
            "output_layer_init_method": _normal(std / (math.sqrt(2.0 * args.num_layers) * math.sqrt(m))),
            "embedding_init_method": _normal(std),
            "softmax_scale": softmax_scale(args)}


def apply_to_chunk(args: argparse.Namespace, chunk: torch.nn.Module) -> None:
    """muP on one built ``GPTModel`` chunk: embedding and output parameters marked (the optimizer
    groups read the mark), an untied output layer brought to N(0, std), the two multipliers."""
    if not getattr(args, "use_mup", False):
        return
    embedding = getattr(chunk, "embedding", None) if chunk.pre_process else None
    output = getattr(chunk, "output_layer", None) if chunk.post_process else None
    if embedding is not None:
        for param in embedding.parameters():
            param.is_embedding_parameter = True
        if args.mup_embedding_mult != 1.0:
            embedding.register_forward_hook(_times(args.mup_embedding_mult))
    if output is not None:
        if output.weight is not None:
            output.weight.is_embedding_parameter = True
            if args.untie_embeddings_and_output_weights:
                # built with the hidden init N(0, std / sqrt(m)); upstream's is the embeddings' N(0, std):
                # the same draws times sqrt(m), whatever the tensor-parallel split
                with torch.no_grad():
                    output.weight.mul_(math.sqrt(args.mup_width_mult))
        if args.mup_output_mult != 1.0:
            output.register_forward_hook(_times(args.mup_output_mult))


def _times(mult: float):
    """A forward hook that multiplies the module's output (or the first item of a tuple)."""
    def hook(module, inputs, out):
        if isinstance(out, tuple):
            return (out[0] * mult, *out[1:])
        return out * mult
    return hook


def _is_embedding(param: torch.nn.Parameter, name: str) -> bool:
    if getattr(param, "shared_embedding", False):
        return True
    if hasattr(param, "is_embedding_parameter"):
        return bool(param.is_embedding_parameter)
    return "embedding" in name.lower()


def _vector_like(param: torch.nn.Parameter, name: str) -> bool:
    return _is_embedding(param, name) or param.dim() <= 1


def optimizer_overrides(args: argparse.Namespace, config) -> Optional[Dict]:
    """megatron-core's optimizer ``config_overrides`` with upstream's muP groups
    (``get_mup_config_overrides`` of Megatron-LM main) added to the standard ones; None
    without ``--use-mup`` (megatron-core's standard groups)."""
    if not getattr(args, "use_mup", False):
        return None
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    overrides = dict(get_standard_config_overrides(config=config))
    m = args.mup_width_mult
    if m == 1.0:
        return overrides
    decoupled = config.decoupled_lr is not None

    def lr_scaled(param, name):
        if decoupled and getattr(param, "is_embedding_or_output_parameter", False):
            return False
        return not _vector_like(param, name)

    def vector_lr_scaled(param, name):
        if decoupled and getattr(param, "is_embedding_or_output_parameter", False):
            return False
        return _vector_like(param, name)

    def eps_scaled(param, name):
        return not _vector_like(param, name)

    def key(name, fn):
        return ParamKey(with_name_predicate=ParamWithNamePredicate(name=name, fn=fn))

    if config.optimizer == "sgd":
        overrides[key("mup_sgd_vector_like_excluding_embedding_output", vector_lr_scaled)] = {
            "max_lr": config.lr * m, "min_lr": config.min_lr * m}
        return overrides
    lr = {"max_lr": config.lr / m, "min_lr": config.min_lr / m}
    eps = {"eps": config.adam_eps / m} if "adam" in config.optimizer else {}
    if decoupled:
        overrides[key("mup_hidden_only_excluding_embedding_output", lr_scaled)] = lr
        if eps:
            overrides[key("mup_hidden_only_for_adam_eps", eps_scaled)] = eps
    else:
        overrides[key("mup_hidden_and_output", eps_scaled)] = {**lr, **eps}
    return overrides
