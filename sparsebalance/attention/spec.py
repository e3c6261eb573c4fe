"""GPT layer specs with our module in megatron-core's ``core_attention`` slot.

We never copy megatron's ``TransformerLayer``: we take megatron-core's own spec
(Transformer Engine's when TE is importable, the local one otherwise) and swap
only ``self_attention.submodules.core_attention``, and in the local spec without apex
the norms: megatron-core's torch fallback (``WrappedTorchNorm``) refuses sequence
parallelism, :class:`TorchNorm` is the same norm that also runs under it. The final norm
of the decoder comes from the block spec (:func:`get_gpt_decoder_spec`).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

try:  # Transformer Engine is a GPU-only extra.
    import transformer_engine  # noqa: F401

    HAS_TE = True
except Exception:  # ImportError, or a TE build that fails to load its CUDA libs
    HAS_TE = False


def get_gpt_layer_spec(
    core_attention: type,
    core_attention_params: Optional[dict[str, Any]] = None,
    *,
    use_te: Optional[bool] = None,
    normalization: str = "LayerNorm",
) -> ModuleSpec:
    """megatron-core's GPT layer spec with ``core_attention`` replaced.

    Args:
        core_attention: module class with ``DotProductAttention``'s signature.
        core_attention_params: extra constructor kwargs for it (ModuleSpec params).
        use_te: use Transformer Engine linears/norms; default: when importable.
        normalization: "LayerNorm" or "RMSNorm".
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = HAS_TE if use_te is None else use_te
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(normalization=normalization)
    else:
        spec = specs.get_gpt_layer_local_spec(normalization=normalization)
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=core_attention, params=dict(core_attention_params or {})
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is WrappedTorchNorm:
            setattr(spec.submodules, name, TorchNorm)
    return spec


class TorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch's ``LayerNorm`` / ``RMSNorm`` by
    ``config.normalization``), also under sequence parallelism.

    With ``config.sequence_parallel`` each TP rank normalises its own shard of the tokens,
    so each holds part of the norm's weight (and bias) gradient: the parameters are marked
    ``sequence_parallel`` and megatron-core's ``finalize_model_grads`` sums those gradients
    over the TP group, as it does for apex's and Transformer Engine's norms. Without
    sequence parallelism it is ``WrappedTorchNorm`` itself.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        import torch

        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r} with sequence parallelism: "
                             f"use one of {sorted(norms)}")
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centered gamma and memory-efficient layer norm need apex or "
                             "Transformer Engine norms")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def get_gpt_decoder_spec(layer_spec: ModuleSpec, config, vp_stage: Optional[int] = None):
    """What ``GPTModel(transformer_layer_spec=...)`` takes for one model chunk: ``layer_spec``
    itself, or, when its norms are :class:`TorchNorm`, the block's submodules with that norm
    as the final one too (megatron's block would pick ``WrappedTorchNorm``)."""
    if layer_spec.submodules.input_layernorm is not TorchNorm:
        return layer_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=TorchNorm)


def get_gpt_layer_dense_spec(**kwargs) -> ModuleSpec:
    """Layer spec with dense causal varlen attention (CPU-safe, THD-capable)."""
    from sparsebalance.attention.dense import CausalVarlenAttention

    return get_gpt_layer_spec(CausalVarlenAttention, **kwargs)
