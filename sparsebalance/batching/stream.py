"""The epoch-ordered stream of packable items (document chunks) and its cursor.

An *item* is a ``(doc_id, offset, length)`` piece of one document with
``length <= seq_length``: a document longer than ``seq_length`` becomes
``ceil(L / seq_length)`` consecutive chunks, each attending only within itself
(as Megatron does). Epoch ``e`` visits documents in the permutation drawn from
``(seed, e)``; the cursor is the only mutable state, so a sampler checkpoint is
``(epoch, position, head_offset)`` plus the carried items.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_permutation(num_docs: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Document order of ``epoch``: a permutation drawn from ``(seed, epoch)``, or identity."""
    if not shuffle:
        return np.arange(num_docs, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
    return rng.permutation(num_docs).astype(np.int64)


@dataclass
class EpochItems:
    """All items of one epoch in stream order (three aligned int64 arrays)."""

    doc: np.ndarray
    """[n] document id of each item."""
    offset: np.ndarray
    """[n] token offset of the item inside its document."""
    length: np.ndarray
    """[n] item length in tokens (1..seq_length)."""

    @classmethod
    def build(cls, lengths: np.ndarray, order: np.ndarray, seq_length: int) -> "EpochItems":
        """Chunk the documents of ``order`` into items of at most ``seq_length`` tokens."""
        L = lengths[order]
        n_chunks = (L + seq_length - 1) // seq_length
        doc = np.repeat(order, n_chunks)
        starts = np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
        chunk_idx = np.arange(doc.size, dtype=np.int64) - starts
        offset = chunk_idx * seq_length
        length = np.minimum(np.repeat(L, n_chunks) - offset, seq_length)
        return cls(doc.astype(np.int64), offset.astype(np.int64), length.astype(np.int64))

    def __len__(self) -> int:
        return int(self.doc.size)


class StreamCursor:
    """Read position in an epoch's items; strategies advance a copy, the sampler commits.

    ``head_offset`` tokens of the item at ``pos`` were already consumed (only the
    ``concat`` strategy cuts items, so it is 0 otherwise).
    """

    def __init__(self, items: EpochItems, pos: int = 0, head_offset: int = 0):
        self.items = items
        self.pos = int(pos)
        self.head_offset = int(head_offset)

    def copy(self) -> "StreamCursor":
        return StreamCursor(self.items, self.pos, self.head_offset)

    @property
    def remaining_items(self) -> int:
        """Items (including a partly consumed head) not yet taken."""
        return len(self.items) - self.pos

    def exhausted(self) -> bool:
        return self.pos >= len(self.items)

    def peek(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Next ``n`` items as (doc, offset, length) arrays, without consuming them."""
        s = slice(self.pos, min(self.pos + max(int(n), 0), len(self.items)))
        doc = self.items.doc[s]
        off = self.items.offset[s].copy()
        length = self.items.length[s].copy()
        if off.size and self.head_offset:
            off[0] += self.head_offset
            length[0] -= self.head_offset
        return doc, off, length

    def peek_tokens(self, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The longest prefix of whole items with total length <= ``budget``."""
        est = 64
        while True:
            doc, off, length = self.peek(est)
            n_fit = int(np.searchsorted(np.cumsum(length), budget, side="right"))
            if n_fit < doc.size or self.pos + est >= len(self.items):
                return doc[:n_fit], off[:n_fit], length[:n_fit]
            est *= 2

    def advance(self, n_items: int) -> None:
        """Consume ``n_items`` whole items (the head counts as one)."""
        self.pos += int(n_items)
        self.head_offset = 0

    def retreat(self, n_items: int) -> None:
        """Give back the last ``n_items`` whole items taken with :meth:`advance`."""
        if self.head_offset or n_items > self.pos:
            raise RuntimeError("cannot retreat over a partly consumed item")
        self.pos -= int(n_items)

    def consume_head_tokens(self, tokens: int) -> None:
        """Consume ``tokens`` of the head item only (cuts it; ``concat`` only)."""
        _, _, length = self.peek(1)
        if tokens >= int(length[0]):
            self.advance(1)
        else:
            self.head_offset += int(tokens)
