"""Packed-sequence params that carry their micro-batch's attention budget.

The driver sets each micro-batch's DST budget in :mod:`sparsebalance.runtime`
before its forward, but that is one value per process: under pipeline
parallelism the backward of micro-batch ``m`` runs after the forwards of later
micro-batches have replaced it. With activation recomputation the backward
re-runs the attention forward, which must use ``m``'s budget again (same
routing, same gradients). Megatron hands the same ``packed_seq_params`` object
to the original and to the recomputed forward (the checkpointed function's
closure holds it), so the budget travels with it:
:class:`~sparsebalance.attention.sparse.SparseAttention` reads the budget of a
:class:`BudgetedPackedSeqParams` in preference to the runtime's current one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.packed_seq_params import PackedSeqParams

from sparsebalance.runtime import Budget


@dataclass
class BudgetedPackedSeqParams(PackedSeqParams):
    """megatron-core ``PackedSeqParams`` plus the micro-batch's attention budget."""

    budget: Optional[Budget] = None
    """Top-k key blocks for this micro-batch on this stage (an int, or ``{layer_number:
    topk}``); None: each module's static default, as with ``runtime.set_budget(None)``."""
    microbatch: Optional[int] = None
    """Micro-batch id (within the step) the budget belongs to; used in attention records."""
    cp_layout: Optional[object] = None
    """Context parallelism: this rank's
    :class:`~sparsebalance.attention.context_parallel.CPLayout` of the micro-batch
    (None without CP)."""
