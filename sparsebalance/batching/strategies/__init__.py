"""Packing strategies behind one interface.

Each strategy is a function ``(carried, stream, ctx) -> Packing``: it may read the
carried items and consume items from ``stream`` (a copy the sampler commits), and
returns ``dp * M`` bins plus the items it defers. It must place every forced item
(waited ``max_carry_steps`` steps, or any carried item once the epoch's stream is
exhausted); the sampler checks that, the capacity and the exactly-once accounting.
"""

from __future__ import annotations

from sparsebalance.batching.strategies.greedy import pack_quadratic, pack_tokens
from sparsebalance.batching.strategies.sequential import pack_concat, pack_megatron, pack_sorted
from sparsebalance.batching.strategies.sab import pack_sab
from sparsebalance.batching.strategies.wlb import pack_wlb

STRATEGIES = {
    "megatron": pack_megatron,
    "concat": pack_concat,
    "sorted": pack_sorted,
    "tokens": pack_tokens,
    "quadratic": pack_quadratic,
    "wlb": pack_wlb,
    "sab": pack_sab,
}
"""Name -> packing function."""

COST_STRATEGIES = frozenset({"sab"})
"""Strategies that need a cost model (a predictor)."""


def get_strategy(name: str):
    """The packing function called ``name``; raises ValueError naming ``strategy``."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {name!r}") from None
