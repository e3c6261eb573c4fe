"""Per-micro-batch attention budget, set by the driver and read by attention modules.

The data iterator yields each micro-batch together with its budget (top-k key
blocks) for this pipeline stage; a thin wrapper around megatron-core's
``forward_step_func`` calls :func:`set_budget` before the model runs, and every
``SparseAttention`` module reads it with :func:`get_budget`. Attention modules
report what they actually did with :func:`record_attention`, which the
predictor's density estimates and the tests read back with :func:`pop_records`.

State is process-local: each pipeline rank runs its own stage, so a single
current value per process is exactly "the budget of this micro-batch on this
stage". Per-layer budgets are supported by passing a mapping
``{layer_number: topk}``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Union

Budget = Union[int, Mapping[int, int]]


@dataclass
class AttentionRecord:
    """What one attention call did (one layer, one micro-batch)."""

    layer_number: int
    """1-based global layer number as megatron-core numbers layers."""
    microbatch: Optional[int]
    """Micro-batch id set with the budget, or None when unset."""
    topk: Optional[int]
    """Budget the module used (None: dense attention)."""
    kept_pairs: int
    """Kept (query, key) pairs summed over documents and heads."""
    causal_pairs: int
    """Causal (query, key) pairs summed over documents and heads."""
    doc_lengths: tuple = field(default_factory=tuple)
    """Lengths of the documents (cu_seqlens segments) in the call, in tokens."""

    @property
    def density(self) -> float:
        """Fraction of causal pairs kept (1.0 for dense)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0


class _State:
    def __init__(self) -> None:
        self.budget: Optional[Budget] = None
        self.microbatch: Optional[int] = None
        self.records: list[AttentionRecord] = []
        self.recording: bool = True


_STATE = _State()


def set_budget(topk: Optional[Budget], microbatch: Optional[int] = None) -> None:
    """Set the budget for the next forward on this rank (None: module default)."""
    if isinstance(topk, int) and topk < 0:
        raise ValueError(f"topk must be >= 0, got {topk}")
    _STATE.budget = topk
    _STATE.microbatch = microbatch


def clear_budget() -> None:
    """Forget the current budget; modules fall back to their static default."""
    _STATE.budget = None
    _STATE.microbatch = None


def get_budget(default: Optional[int], layer_number: Optional[int] = None) -> Optional[int]:
    """Budget for ``layer_number`` in the current micro-batch, else ``default``."""
    b = _STATE.budget
    if b is None:
        return default
    if isinstance(b, Mapping):
        return int(b.get(layer_number, default)) if layer_number in b else default
    return int(b)


def current_microbatch() -> Optional[int]:
    """Micro-batch id given to the last :func:`set_budget` call."""
    return _STATE.microbatch


@contextlib.contextmanager
def budget(topk: Optional[Budget], microbatch: Optional[int] = None) -> Iterator[None]:
    """Context manager form of :func:`set_budget`; restores the previous value."""
    prev = (_STATE.budget, _STATE.microbatch)
    set_budget(topk, microbatch)
    try:
        yield
    finally:
        _STATE.budget, _STATE.microbatch = prev


def set_recording(enabled: bool) -> None:
    """Turn attention records on or off (off saves a little bookkeeping)."""
    _STATE.recording = bool(enabled)


def record_attention(record: AttentionRecord) -> None:
    """Called by attention modules after each forward."""
    if _STATE.recording:
        if record.microbatch is None:
            record.microbatch = _STATE.microbatch
        _STATE.records.append(record)


def pop_records() -> list[AttentionRecord]:
    """Return and clear the records collected since the last call."""
    out, _STATE.records = _STATE.records, []
    return out
