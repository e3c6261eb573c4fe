"""Packed-sequence params that carry their micro-batch's attention budget to the
attention modules, and the records of what those modules did back to the driver.

megatron-core hands the ``packed_seq_params`` of a micro-batch, untouched, from the
model's forward to every layer's ``core_attention``; the driver's forward step builds
one :class:`BudgetedPackedSeqParams` per micro-batch with the budget (a top-k, or under
threshold routing a TAU: :attr:`BudgetedPackedSeqParams.tau`) its data iterator
attached (the plan's entry, checked by ``sparsebalance.balancer.check_budget``) and the
step's record list, to which every sparse attention forward appends an
:class:`AttentionRecord` (:func:`record`). Nothing else holds the budget or the records
(no process-wide state), so it is right under pipeline parallelism (the backward of
micro-batch ``m`` runs after later micro-batches' forwards) and under activation
recomputation (megatron re-runs the attention forward in backward with the same
params object: the checkpointed function's closure holds it, so the recomputed call
routes as the original did).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Tuple

from megatron.core.packed_seq_params import PackedSeqParams

from sparsebalance.ops.kept import KeptPairs, read_kept

_FROM_KEPT = frozenset({"kept_pairs", "doc_kept_pairs", "head_kept_pairs"})


@dataclass
class AttentionRecord:
    """What one attention call did (one layer, one micro-batch)."""

    layer_number: int
    """1-based global layer number as megatron-core numbers layers."""
    microbatch: Optional[int]
    """Micro-batch id the packed params carried, or None when they carried none."""
    topk: Optional[int]
    """Budget the module used (None: dense attention; under threshold routing: the cap)."""
    kept_pairs: int
    """Kept (query, key) pairs summed over documents and heads."""
    causal_pairs: int
    """Causal (query, key) pairs summed over documents and heads."""
    doc_lengths: tuple = field(default_factory=tuple)
    """Lengths of the documents (cu_seqlens segments) in the call, in tokens."""
    doc_kept_pairs: tuple = field(default_factory=tuple)
    """Kept pairs of each document (over heads), when the backend routed by the shared plan
    (empty otherwise): what a sparsity estimator learns a document's density from."""
    head_kept_pairs: tuple = field(default_factory=tuple)
    """Kept pairs of each query head (over documents; they sum to ``kept_pairs``), when the
    backend routed by the shared plan or the layer was dense (empty otherwise): under
    per-head threshold routing the heads of a layer keep different numbers of pairs."""
    tau: Optional[float] = None
    """Threshold routing's TAU the module routed at (the micro-batch's DST level, or the
    run's); None: top-k routing or dense."""
    kept: Optional[KeptPairs] = field(default=None, compare=False, repr=False)
    """The call's kept pairs while they are still on the device (threshold routing): the
    three fields above are filled from them when one is first read, or for all of a step's
    records at once by :func:`read_records` (one copy); then None."""

    def __post_init__(self) -> None:
        if self.kept is not None and not self.kept.pending:  # known on the host: no reason to wait
            read_records([self])

    def __getattribute__(self, name):
        if name in _FROM_KEPT and object.__getattribute__(self, "kept") is not None:
            read_records([self])
        return object.__getattribute__(self, name)

    @property
    def density(self) -> float:
        """Fraction of causal pairs kept (1.0 for dense)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0


@dataclass
class BudgetedPackedSeqParams(PackedSeqParams):
    """megatron-core ``PackedSeqParams`` plus the micro-batch's attention budget."""

    budget: Optional[int] = None
    """Top-k key blocks of every sparse layer for this micro-batch on this stage (the
    DST plan's entry); None: each module's static default."""
    tau: Optional[float] = None
    """Threshold routing's TAU of every sparse layer for this micro-batch on this stage (DST's
    TAU level; the budget, if any, stays the cap); None: each module's static TAU."""
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
    records: Optional[list] = None
    """The list the attention modules append their :class:`AttentionRecord` to (the
    driver's, one per step); None: nothing is recorded."""


def record(packed_seq_params, rec: AttentionRecord) -> None:
    """Append ``rec`` to the record list ``packed_seq_params`` carries (if any)."""
    records = getattr(packed_seq_params, "records", None)
    if records is not None:
        records.append(rec)


def read_records(records: Iterable[AttentionRecord]) -> int:
    """Fill the kept pairs of every record still holding them on the device, with one
    device-to-host copy for all (the driver calls it once per step). Returns the copies (0 or 1)."""
    pend = [r for r in records if object.__getattribute__(r, "kept") is not None]
    copies = read_kept([r.kept for r in pend])
    for r in pend:
        kept, r.kept = r.kept, None
        r.kept_pairs = kept.total
        r.doc_kept_pairs = () if kept.doc is None else tuple(int(x) for x in kept.doc)
        r.head_kept_pairs = () if kept.head is None else tuple(int(x) for x in kept.head)
    return copies


def budget_of(packed_seq_params, default: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(top-k, micro-batch id) that ``packed_seq_params`` carries.

    Plain ``PackedSeqParams`` (or None, or no budget) give ``default``; the micro-batch
    id is None unless the params are :class:`BudgetedPackedSeqParams`.
    """
    if not isinstance(packed_seq_params, BudgetedPackedSeqParams):
        return default, None
    b = packed_seq_params.budget
    return (default if b is None else b), packed_seq_params.microbatch


def tau_of(packed_seq_params, default: Optional[float]) -> Optional[float]:
    """Threshold routing's TAU that ``packed_seq_params`` carries (DST's level), else ``default``."""
    t = getattr(packed_seq_params, "tau", None) if isinstance(packed_seq_params, BudgetedPackedSeqParams) else None
    return default if t is None else float(t)
