"""``dp-balanced``: Megatron-core's ``DpBalancedScheduler`` sequence packing.

Megatron-core's sequence-packing scheduler (``megatron/core/datasets/data_schedule.py``)
packs the global batch's documents in their original order into packed sequences of
at most ``max_seqlen_per_dp_cp_rank x cp_size`` tokens (next-fit: a document that does
not fit opens the next one), then deals the packed sequences round-robin over the
data-parallel ranks: micro-batch ``i`` of DP rank ``j`` is packed sequence
``i * dp + j``. It balances the *count* of packed sequences per rank, not their cost.

Ours, behind the common interface: the same next-fit in stream order into the step's
``dp x M`` micro-batches of ``seq_length`` tokens (the ``megatron`` strategy's fill),
then the round-robin deal (``rank_interleaved``). Megatron's scheduler varies the
number of micro-batches per step to fit a fixed number of documents; here the step's
token capacity is fixed, as for every strategy, so its rule that the number of packed
sequences be a multiple of ``dp`` holds by construction. Never defers.
"""

from __future__ import annotations

from sparsebalance.batching.packing import Carried, PackContext, Packing
from sparsebalance.batching.strategies.common import finish, rank_interleaved
from sparsebalance.batching.strategies.sequential import fill_in_order
from sparsebalance.batching.stream import StreamCursor


def pack_dp_balanced(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """Next-fit in stream order, packed sequence ``i`` to rank ``i % dp`` (module docstring)."""
    win, assign = fill_in_order(carried, stream, ctx)
    return finish(win, assign, ctx, rank_interleaved(ctx))
