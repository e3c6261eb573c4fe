"""Model shape the latency predictors are built for.

Field names follow megatron's argument names (``--hidden-size`` ->
``hidden_size``) so the driver can pass its parsed arguments straight through.
The defaults describe a Qwen2.5-0.5B-like layer stack with the paper's MoBA
routing (block 256, top-k 32).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape and routing parameters that latency depends on."""

    num_layers: int = 24
    """Transformer layers of the whole model (split evenly over PP stages)."""
    hidden_size: int = 896
    """Model width h."""
    num_attention_heads: int = 14
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups); equal to num_attention_heads for MHA."""
    kv_channels: Optional[int] = None
    """Head dimension; None = hidden_size // num_attention_heads."""
    ffn_hidden_size: int = 4864
    """MLP inner width."""
    vocab_size: int = 151936
    """(Padded) vocabulary size of the output layer."""
    swiglu: bool = True
    """Gated MLP (three weight matrices) instead of two."""
    block_size: int = 256
    """Routing block size of the sparse attention, tokens."""
    topk: Optional[int] = 32
    """Default budget (key blocks kept besides sink + diagonal); None = dense."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads "
                             "when kv_channels is not given")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        if self.topk is not None and self.topk < 0:
            raise ValueError(f"topk must be >= 0 or None, got {self.topk}")

    @property
    def head_dim(self) -> int:
        """Head dimension in channels."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    # Per-token FLOPs of one layer's matmuls (forward, 2 FLOPs per multiply-add).
    @property
    def attn_linear_flops(self) -> float:
        """QKV + output projection FLOPs per token."""
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.num_query_groups * self.head_dim
        return 2.0 * self.hidden_size * (q + kv) + 2.0 * q * self.hidden_size

    @property
    def mlp_flops(self) -> float:
        """MLP FLOPs per token."""
        return 2.0 * self.hidden_size * self.ffn_hidden_size * (3 if self.swiglu else 2)

    @property
    def attn_pair_flops(self) -> float:
        """Core-attention FLOPs per kept (query, key) pair of one head, summed over heads
        (QK^T and PV: 2 matmuls x 2 FLOPs x head_dim x heads)."""
        return 4.0 * self.head_dim * self.num_attention_heads

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ModelShape":
        """Build from keyword arguments; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown model_cfg keys {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def layers_of(self, stage: int, pp: int) -> int:
        """Transformer layers held by pipeline stage ``stage`` of ``pp`` (even split,
        as megatron-core requires by default)."""
        if pp < 1:
            raise ValueError(f"pp must be >= 1, got {pp}")
        if not 0 <= stage < pp:
            raise ValueError(f"stage must be in [0, {pp}), got {stage}")
        if self.num_layers % pp:
            raise ValueError(f"num_layers ({self.num_layers}) is not divisible by pp ({pp})")
        return self.num_layers // pp
