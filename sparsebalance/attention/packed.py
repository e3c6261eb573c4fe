"""Packed-sequence params that carry their micro-batch's attention budget: the one
budget carrier from the DST plan to the attention modules.

megatron-core hands the ``packed_seq_params`` of a micro-batch, untouched, from the
model's forward to every layer's ``core_attention``; the driver's forward step builds
one :class:`BudgetedPackedSeqParams` per micro-batch with the budget the data
iterator attached (:mod:`sparsebalance.tuning.hook`, which also checked it). Nothing
else holds the budget, so it is right under pipeline parallelism (the backward of
micro-batch ``m`` runs after later micro-batches' forwards) and under activation
recomputation (megatron re-runs the attention forward in backward with the same
params object: the checkpointed function's closure holds it, so the recomputed call
routes as the original did).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class BudgetedPackedSeqParams(PackedSeqParams):
    """megatron-core ``PackedSeqParams`` plus the micro-batch's attention budget."""

    budget: Optional[int] = None
    """Top-k key blocks of every sparse layer for this micro-batch on this stage (the
    DST plan's entry); None: each module's static default."""
    microbatch: Optional[int] = None
    """Micro-batch id (within the step) the budget belongs to; used in attention records."""
    cu_seqlens_host: Optional[object] = None
    """``cu_seqlens_q`` on the host (int32 CPU tensor), riding with the micro-batch: routing
    reads document boundaries from it, so no layer copies the device tensor back (a host
    sync). None: the modules copy ``cu_seqlens_q`` once per micro-batch."""
    cp_layout: Optional[object] = None
    """Context parallelism: this rank's
    :class:`~sparsebalance.attention.context_parallel.CPLayout` of the micro-batch
    (None without CP)."""


def budget_of(packed_seq_params, default: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(top-k, micro-batch id) that ``packed_seq_params`` carries.

    Plain ``PackedSeqParams`` (or None, or no budget) give ``default``; the micro-batch
    id is None unless the params are :class:`BudgetedPackedSeqParams`.
    """
    if not isinstance(packed_seq_params, BudgetedPackedSeqParams):
        return default, None
    b = packed_seq_params.budget
    return (default if b is None else b), packed_seq_params.microbatch
