"""GPT layer specs with our module in megatron-core's ``core_attention`` slot.

We never copy megatron's ``TransformerLayer``: we take megatron-core's own spec
(Transformer Engine's when TE is importable, the local one otherwise) and swap
only ``self_attention.submodules.core_attention``, and in the local spec without apex
the norms: megatron-core's torch fallback (``WrappedTorchNorm``) refuses sequence
parallelism and zero-centred gamma (Megatron-LM's ``--apply-layernorm-1p``);
:class:`TorchNorm` is the same norm that also runs under them. The final norm of the
decoder comes from the block spec (:func:`get_gpt_decoder_spec`).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
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
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
) -> ModuleSpec:
    """megatron-core's GPT layer spec with ``core_attention`` replaced.

    Args:
        core_attention: module class with ``DotProductAttention``'s signature.
        core_attention_params: extra constructor kwargs for it (ModuleSpec params).
        use_te: use Transformer Engine linears/norms; default: when importable.
        normalization: "LayerNorm" or "RMSNorm".
        qk_layernorm: normalise each head's query and key before attention (Megatron-LM's
            ``--qk-layernorm``; megatron-core's ``q_layernorm`` / ``k_layernorm`` slots).
        multi_latent_attention: megatron-core's multi-latent attention (``MLASelfAttention``;
            its core attention gets query/key and value heads of different sizes).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = HAS_TE if use_te is None else use_te
    if use_te:  # TE's norms read config.normalization: its spec takes no normalization argument
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm,
                                                               multi_latent_attention=multi_latent_attention)
    else:
        spec = specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm,
                                              multi_latent_attention=multi_latent_attention)
    # Copy the path to the slots changed below, not the whole spec: megatron-core's own spec
    # objects are shared by every caller (and without TE its TE classes are mocks, which
    # deepcopy refuses).
    spec = copy.copy(spec)
    spec.submodules = copy.copy(spec.submodules)
    spec.submodules.self_attention = copy.copy(spec.submodules.self_attention)
    spec.submodules.self_attention.submodules = copy.copy(spec.submodules.self_attention.submodules)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=core_attention, params=dict(core_attention_params or {})
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is WrappedTorchNorm:
            setattr(spec.submodules, name, TorchNorm)
    attention = spec.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # kv_layernorm: MLA's latent
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, TorchQKNorm)
    return spec


class _ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``LayerNorm`` whose scale is ``1 + weight``, the weight starting at zero (what apex's
    and Transformer Engine's ``zero_centered_gamma`` compute)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``RMSNorm`` whose scale is ``1 + weight``, the weight starting at zero."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def torch_norm(config, hidden_size: int, eps: float) -> torch.nn.Module:
    """torch's ``LayerNorm`` / ``RMSNorm`` by ``config.normalization``, zero-centred when
    ``config.layernorm_zero_centered_gamma``."""
    norms = {"LayerNorm": (torch.nn.LayerNorm, _ZeroCenteredLayerNorm),
             "RMSNorm": (torch.nn.RMSNorm, _ZeroCenteredRMSNorm)}
    if config.normalization not in norms:
        raise ValueError(f"normalization {config.normalization!r} with sequence parallelism or "
                         f"zero-centred gamma: use one of {sorted(norms)}")
    if config.memory_efficient_layer_norm:
        raise ValueError("memory-efficient layer norm needs apex or Transformer Engine norms")
    return norms[config.normalization][bool(config.layernorm_zero_centered_gamma)](hidden_size, eps=eps)


class TorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch's ``LayerNorm`` / ``RMSNorm`` by
    ``config.normalization``), also under sequence parallelism.

    With ``config.sequence_parallel`` each TP rank normalises its own shard of the tokens,
    so each holds part of the norm's weight (and bias) gradient: the parameters are marked
    ``sequence_parallel`` and megatron-core's ``finalize_model_grads`` sums those gradients
    over the TP group, as it does for apex's and Transformer Engine's norms. With
    ``config.layernorm_zero_centered_gamma`` the scale is ``1 + weight`` (see
    :func:`torch_norm`). Otherwise it is ``WrappedTorchNorm`` itself.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not (config.sequence_parallel or config.layernorm_zero_centered_gamma):
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        norm = torch_norm(config, hidden_size, eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm


class TorchQKNorm:
    """The ``q_layernorm`` / ``k_layernorm`` of :class:`TorchNorm`'s kind (``--qk-layernorm``).

    It normalises each head's ``kv_channels`` after the column-parallel QKV projection, on
    the full (gathered) sequence, so under sequence parallelism its parameters are not
    marked: megatron-core's ``finalize_model_grads`` sums the gradients of ``q_layernorm`` /
    ``k_layernorm`` over the TP group by name when ``config.qk_layernorm`` is set.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not (config.sequence_parallel or config.layernorm_zero_centered_gamma):
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        return torch_norm(config, hidden_size, eps)


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
