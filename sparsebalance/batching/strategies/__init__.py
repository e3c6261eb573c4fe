"""Packing strategies behind one interface, and their registry.

Each strategy is a function ``(carried, stream, ctx) -> Packing``: it may read the
carried items and consume items from ``stream`` (a copy the sampler commits), and
returns ``dp * M`` bins plus the items it defers. It must place every forced item
(waited ``max_carry_steps`` steps, or any carried item once the epoch's stream is
exhausted); the sampler checks that, the capacity and the exactly-once accounting.
A new strategy is one file here plus one line in :data:`STRATEGIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sparsebalance.batching.strategies.dp_balanced import pack_dp_balanced
from sparsebalance.batching.strategies.greedy import pack_quadratic, pack_tokens
from sparsebalance.batching.strategies.sab import pack_sab
from sparsebalance.batching.strategies.sequential import pack_concat, pack_megatron, pack_sorted
from sparsebalance.batching.strategies.wlb import pack_wlb
from sparsebalance.registry import Registry


@dataclass(frozen=True)
class Strategy:
    """A registered packing strategy."""

    pack: Callable
    """``(carried, stream, ctx) -> Packing``."""
    predictor: str = "none"
    """Its use of a latency predictor: "none", "optional" (better costs with one) or
    "required"."""
    whole_documents: bool = True
    """Keeps every document whole (False: cuts documents at micro-batch boundaries)."""

    def __post_init__(self) -> None:
        if self.predictor not in ("none", "optional", "required"):
            raise ValueError(f"predictor must be none, optional or required, got {self.predictor!r}")


STRATEGIES: Registry[Strategy] = Registry("strategy", {
    "megatron": Strategy(pack_megatron),
    "concat": Strategy(pack_concat, whole_documents=False),
    "sorted": Strategy(pack_sorted),
    "tokens": Strategy(pack_tokens),
    "quadratic": Strategy(pack_quadratic),
    "wlb": Strategy(pack_wlb, predictor="optional"),
    "dp-balanced": Strategy(pack_dp_balanced),
    "sab": Strategy(pack_sab, predictor="required"),
})
"""Name -> packing strategy (the ``--sb-batching`` choices)."""


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; raises ValueError naming ``strategy``."""
    return STRATEGIES.pick(name)
