"""Packed-sequence params that carry their micro-batch's attention budget: the one
budget carrier from the DST plan to the attention modules.

megatron-core hands the ``packed_seq_params`` of a micro-batch, untouched, from the
model's forward to every layer's ``core_attention``; the driver's forward step builds
one :class:`BudgetedPackedSeqParams` per micro-batch with the budget the data
iterator attached (:mod:`sparsebalance.tuning.hook`). Nothing else holds the
budget, so it is right under pipeline parallelism (the backward of micro-batch
``m`` runs after later micro-batches' forwards) and under activation recomputation
(megatron re-runs the attention forward in backward with the same params object:
the checkpointed function's closure holds it, so the recomputed call routes as the
original did).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

from megatron.core.packed_seq_params import PackedSeqParams

Budget = Union[int, Mapping[int, int]]
"""Top-k key blocks: one int for every layer, or ``{layer_number: topk}``."""


@dataclass
class BudgetedPackedSeqParams(PackedSeqParams):
    """megatron-core ``PackedSeqParams`` plus the micro-batch's attention budget."""

    budget: Optional[Budget] = None
    """Top-k key blocks for this micro-batch on this stage (an int, or ``{layer_number:
    topk}``); None: each module's static default."""
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

    def __post_init__(self) -> None:
        if isinstance(self.budget, int) and self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")


def budget_of(packed_seq_params, default: Optional[int],
              layer_number: int) -> Tuple[Optional[int], Optional[int]]:
    """(top-k, micro-batch id) that ``packed_seq_params`` carries for ``layer_number``.

    Plain ``PackedSeqParams`` (or None, or no budget, or a mapping without this
    layer) give ``default`` and no micro-batch id.
    """
    if not isinstance(packed_seq_params, BudgetedPackedSeqParams):
        return default, None
    b, mb = packed_seq_params.budget, packed_seq_params.microbatch
    if b is None:
        return default, mb
    if isinstance(b, Mapping):
        return (int(b[layer_number]) if layer_number in b else default), mb
    return int(b), mb
