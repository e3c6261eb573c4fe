"""Which tokens each context-parallel rank holds (numpy only, below everything that uses it).

Megatron's THD layout under context parallelism, the one megatron-core's RoPE assumes:
every document is padded to a multiple of ``2 * cp`` tokens and cut into ``2 * cp``
equal chunks; CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every document
(an early chunk, cheap in causal attention, with a late, expensive one), documents in
order. The driver splits micro-batches with it, the attention module builds its layout
on it (:mod:`sparsebalance.attention.context_parallel`) and the predictor prices the
padded lengths (:mod:`sparsebalance.predictor.context_parallel`).

Sequence parallelism (megatron-core's, TP > 1 with ``--sequence-parallel``) splits the
tokens a rank holds over its TP group, so their count must be a multiple of the TP size:
:func:`sequence_parallel_pad` gives the extra padding, appended to the micro-batch's last
document (after the CP padding, so each document stays a multiple of ``2 * cp``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def padded_lengths(lengths: Sequence[int], cp: int) -> np.ndarray:
    """Document lengths rounded up to a multiple of ``2 * cp`` tokens (int64)."""
    unit = 2 * int(cp)
    L = np.asarray(lengths, dtype=np.int64)
    return (L + unit - 1) // unit * unit


def local_token_index(padded: Sequence[int], cp: int, rank: int) -> np.ndarray:
    """Indices into the padded packed layout of the tokens CP rank ``rank`` holds, in
    its local order (per document: chunk ``rank`` then chunk ``2 * cp - 1 - rank``).

    Args:
        padded: padded document lengths, each a multiple of ``2 * cp``.
    Returns:
        int64 ``[sum(padded) / cp]``.
    """
    P = np.asarray(padded, dtype=np.int64)
    if np.any(P % (2 * cp)):
        raise ValueError(f"padded lengths must be multiples of 2 * cp = {2 * cp}")
    S = P // (2 * cp)  # chunk size per document
    start = np.cumsum(P) - P
    heads = start + rank * S
    tails = start + (2 * cp - 1 - rank) * S
    firsts = np.stack([heads, tails], 1).reshape(-1)
    sizes = np.repeat(S, 2)
    return np.repeat(firsts - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))


def sequence_parallel_pad(tokens: int, cp: int, sp: int) -> int:
    """Padding tokens that make a micro-batch of ``tokens`` stored tokens (CP padding
    included: a multiple of ``2 * cp`` when ``cp > 1``) splittable over ``sp``
    sequence-parallel ranks: the least ``pad >= 0`` with ``(tokens + pad) / cp`` a
    multiple of ``sp``, and with ``pad`` a multiple of ``2 * cp`` under CP (the last
    document stays cuttable into ``2 * cp`` chunks). Less than ``sp`` tokens without CP,
    less than ``cp * lcm(2, sp)`` with it."""
    tokens, cp, sp = int(tokens), int(cp), int(sp)
    if cp > 1 and tokens % (2 * cp):
        raise ValueError(f"a CP micro-batch holds a multiple of 2 * cp = {2 * cp} tokens, got {tokens}")
    unit = sp if cp == 1 else math.lcm(2, sp)  # per CP rank; its share is even under CP
    return cp * (-(tokens // cp) % unit)
