"""Data types shared by the sampler and the packing strategies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

Segment = tuple  # (doc_id, offset, length), all int, tokens
"""One piece of a document in a micro-batch; it attends only within itself."""


@dataclass
class Carried:
    """Items waiting for a later step (aligned int64 arrays)."""

    doc: np.ndarray
    """[n] document ids."""
    offset: np.ndarray
    """[n] token offsets inside the document."""
    length: np.ndarray
    """[n] lengths in tokens."""
    age: np.ndarray
    """[n] steps each item has already waited (1..max_carry_steps)."""

    @classmethod
    def empty(cls) -> "Carried":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy(), z.copy())

    def __len__(self) -> int:
        return int(self.doc.size)

    @property
    def tokens(self) -> int:
        return int(self.length.sum())


@dataclass
class PackContext:
    """Everything a strategy may read besides the items themselves."""

    dp: int
    """Data-parallel ranks."""
    micro_batches: int
    """Micro-batches per rank per step (M)."""
    seq_length: int
    """Token capacity of one micro-batch."""
    max_carry_steps: int
    """An item that has waited this many steps must be placed now."""
    flush: bool
    """The epoch's stream is exhausted: every carried item must be placed if it fits."""
    carry_cap_tokens: int = 0
    """Strategies must not leave more carried tokens than this (half the step's
    capacity, which guarantees the forced items of the next step fit)."""
    cost: Optional[object] = None
    """:class:`~sparsebalance.batching.cost.CostModel`, or None (cost-free strategies)."""
    options: dict = field(default_factory=dict)
    """Strategy-specific knobs (documented by each strategy)."""

    @property
    def num_bins(self) -> int:
        """Micro-batches of the whole step (dp * M); bin j goes to rank j // M."""
        return self.dp * self.micro_batches


@dataclass
class Packing:
    """A strategy's answer for one step."""

    bins: list
    """[dp * M] lists of segments; bin j is micro-batch j % M of rank j // M, in
    pipeline order."""
    deferred: Carried
    """Items carried to the next step, ages already incremented."""


@dataclass
class StepPacking:
    """The packing of one global step, identical on every rank."""

    step: int
    """0-based global step index (consumed steps before this one)."""
    epoch: int
    """Epoch the items of this step belong to."""
    ranks: list
    """``ranks[dp_rank][microbatch]`` = list of ``(doc_id, offset, length)`` segments
    with total length <= seq_length."""
    microbatch_ms: Optional[np.ndarray] = None
    """[dp, M] predicted fwd+bwd time of each micro-batch summed over stages (ms);
    None without a predictor."""
    rank_ms: Optional[np.ndarray] = None
    """[dp] predicted pipeline (1F1B) step time of each rank (ms)."""
    stage_fwd_ms: Optional[np.ndarray] = None
    """[dp, M, pp] predicted forward time per stage (ms)."""
    stage_bwd_ms: Optional[np.ndarray] = None
    """[dp, M, pp] predicted backward time per stage (ms)."""
    carried_docs: int = 0
    """Items still waiting after this step."""
    pack_ms: float = 0.0
    """CPU time of the packing thread for this step, predictions included (ms); on
    an idle core this is the wall time, and unlike wall time it is not inflated when
    the machine is shared."""
    pack_wall_ms: float = 0.0
    """Wall time of the same call (ms): what a training step waits for when the plan is
    made on its critical path; on a shared machine it includes time the thread waited
    for a core."""

    @property
    def tokens(self) -> int:
        """Real tokens trained in this step."""
        return sum(s[2] for r in self.ranks for mb in r for s in mb)

    def lengths(self, pad_to: Optional[int] = None) -> list:
        """Attention segment lengths ``[dp][microbatch][segment]`` as trained: with
        ``pad_to``, each micro-batch ends in one padding segment up to ``pad_to`` tokens
        (computed like a document); an empty micro-batch is one padding token (the
        driver's micro-batches, ``megatron/training/data.py``, follow this rule)."""
        out = []
        for rank in self.ranks:
            row = []
            for mb in rank:
                lens = [int(s[2]) for s in mb]
                if pad_to is not None or not mb:
                    pad = max((pad_to or 1) - sum(lens), 0)
                    if pad:
                        lens.append(pad)
                row.append(lens)
            out.append(row)
        return out

    @property
    def step_ms(self) -> Optional[float]:
        """Predicted step time: the slowest rank (ms)."""
        return None if self.rank_ms is None else float(np.max(self.rank_ms))
