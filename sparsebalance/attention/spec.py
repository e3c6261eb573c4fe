"""GPT layer specs with our module in megatron-core's ``core_attention`` slot.

We never copy megatron's ``TransformerLayer``: we take megatron-core's own spec
(Transformer Engine's when TE is importable, the local one otherwise) and swap
only ``self_attention.submodules.core_attention``.
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
    return spec


def get_gpt_layer_dense_spec(**kwargs) -> ModuleSpec:
    """Layer spec with dense causal varlen attention (CPU-safe, THD-capable)."""
    from sparsebalance.attention.dense import CausalVarlenAttention

    return get_gpt_layer_spec(CausalVarlenAttention, **kwargs)
