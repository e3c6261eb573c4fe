"""Records of what the attention modules did, read back after each step.

The attention budget is NOT here: it rides on each micro-batch's packed-sequence
params (:class:`sparsebalance.attention.packed.BudgetedPackedSeqParams`). What stays
per process is the log of attention calls: every ``SparseAttention`` forward appends
an :class:`AttentionRecord` (its layer, the micro-batch id and budget its packed
params carried, kept and causal pairs) with :func:`record_attention`; the driver
collects them per step with :func:`pop_records` (achieved density, the density
estimates, the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class AttentionRecord:
    """What one attention call did (one layer, one micro-batch)."""

    layer_number: int
    """1-based global layer number as megatron-core numbers layers."""
    microbatch: Optional[int]
    """Micro-batch id the packed params carried, or None when they carried none."""
    topk: Optional[int]
    """Budget the module used (None: dense attention)."""
    kept_pairs: int
    """Kept (query, key) pairs summed over documents and heads."""
    causal_pairs: int
    """Causal (query, key) pairs summed over documents and heads."""
    doc_lengths: tuple = field(default_factory=tuple)
    """Lengths of the documents (cu_seqlens segments) in the call, in tokens."""
    doc_kept_pairs: tuple = field(default_factory=tuple)
    """Kept pairs of each document (over heads), when the backend routed by the shared plan
    (empty otherwise): what a sparsity estimator learns a document's density from."""

    @property
    def density(self) -> float:
        """Fraction of causal pairs kept (1.0 for dense)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0


class _Recorder:
    def __init__(self) -> None:
        self.records: list[AttentionRecord] = []
        self.recording: bool = True


_RECORDER = _Recorder()


def set_recording(enabled: bool) -> None:
    """Turn attention records on or off (off saves a little bookkeeping)."""
    _RECORDER.recording = bool(enabled)


def record_attention(record: AttentionRecord) -> None:
    """Called by attention modules after each (original, not recomputed) forward."""
    if _RECORDER.recording:
        _RECORDER.records.append(record)


def pop_records() -> list[AttentionRecord]:
    """Return and clear the records collected since the last call."""
    out, _RECORDER.records = _RECORDER.records, []
    return out
