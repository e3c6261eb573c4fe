"""Micro-batch compositions for profiling and validation (pure numpy, seeded).

A composition is ``(lengths, topk)``: the document lengths of one packed
micro-batch of at most ``capacity`` tokens and its budget (None = dense).

Real compositions are resampled from length files (the repository's
``data/lengths/*.json``, real long-context mixtures, or a user's own corpus'). Those lengths
are for 32K-128K contexts; a CPU run uses a shorter ``--seq-length``, so lengths
are multiplied by ``length_scale`` (default ``capacity / 32768``: the paper's 32K
micro-batch maps onto ours) to keep the share of long documents per micro-batch —
what makes packing imbalanced — the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

Composition = tuple[list[int], Optional[int]]
REFERENCE_CONTEXT = 32768
"""Micro-batch tokens the shared length files are mapped from (the paper's 32K)."""


def load_length_pool(paths: Sequence[str]) -> np.ndarray:
    """All document lengths of the given JSON files (lists of positive ints)."""
    pool = []
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: cannot read a JSON list of document lengths ({e})") from None
        if not isinstance(data, list) or not data:
            raise ValueError(f"{p}: expected a non-empty JSON list of document lengths")
        pool.append(np.asarray(data, dtype=np.int64))
    out = np.concatenate(pool) if pool else np.zeros(0, np.int64)
    if out.size == 0 or out.min() < 1:
        raise ValueError("length files must hold positive lengths")
    return out


@dataclass(frozen=True)
class GridSpec:
    """What to profile: micro-batch size, routing block, budgets, pool resampling."""

    capacity: int
    """Tokens per micro-batch (``--seq-length``)."""
    block_size: int
    """Routing block size, tokens."""
    budgets: tuple
    """Budgets (top-k) to profile; None = dense."""
    length_scale: Optional[float] = None
    """Multiplier on resampled lengths; None = capacity / 32768."""

    def __post_init__(self) -> None:
        if self.capacity < 2 or self.block_size < 1:
            raise ValueError(f"capacity must be >= 2 and block_size >= 1, got "
                             f"{self.capacity}, {self.block_size}")
        if not self.budgets:
            raise ValueError("budgets must not be empty")

    @property
    def scale(self) -> float:
        """Effective length multiplier."""
        return self.length_scale if self.length_scale is not None else self.capacity / REFERENCE_CONTEXT


def sample_pack(pool: np.ndarray, spec: GridSpec, rng: np.random.Generator,
                fill: float = 1.0) -> list[int]:
    """One micro-batch packed from documents drawn from ``pool`` in random order.

    Whole documents are added while they fit into ``fill * capacity`` tokens; a
    document longer than the capacity is cut to it (Megatron-style chunking), so
    every pack holds at least one document.
    """
    target = max(1, int(fill * spec.capacity))
    out: list[int] = []
    total = 0
    for _ in range(10_000):
        L = int(max(1, round(pool[rng.integers(pool.size)] * spec.scale)))
        L = min(L, spec.capacity)
        if total + L > target:
            if not out:
                out.append(min(L, target))
            break
        out.append(L)
        total += L
    return out


def training_grid(pool: np.ndarray, spec: GridSpec, rng: np.random.Generator,
                  n_mixes: int, fractions: Sequence[float] = (1.0, 0.75, 0.5, 0.25, 0.125)
                  ) -> list[Composition]:
    """Profiling grid: single long documents, many short ones, resampled mixes, each
    at every budget.

    The extremes pin the pair term (one long document: pairs ~ L^2 or ~ L*cap) and
    the token/document terms (many short ones); the mixes cover what training sees.
    ``fractions`` are the single-document lengths as fractions of the capacity.
    """
    C, B = spec.capacity, spec.block_size
    comps: list[list[int]] = []
    for frac in fractions:
        L = int(C * frac)
        if L >= 1:
            comps.append([L])
    for size in sorted({max(1, B // 2), B, 4 * B}):
        if size < C:
            comps.append([size] * (C // size))
    comps.append([C // 2] + [B] * ((C - C // 2) // B))  # one long doc + short tail
    for i in range(n_mixes):
        comps.append(sample_pack(pool, spec, rng, fill=1.0 if i % 2 == 0 else rng.uniform(0.3, 1.0)))
    return [(c, k) for c in comps for k in spec.budgets]


def heldout_set(pool: np.ndarray, spec: GridSpec, rng: np.random.Generator, n: int,
                k_range: tuple[int, int], dense_share: float = 0.15) -> list[Composition]:
    """Random micro-batches not in the grid: resampled packs with random fill and a
    random budget drawn uniformly from ``k_range`` (dense with ``dense_share``)."""
    lo, hi = k_range
    if lo < 0 or hi < lo:
        raise ValueError(f"k_range must be 0 <= lo <= hi, got {k_range}")
    out = []
    for _ in range(n):
        lengths = sample_pack(pool, spec, rng, fill=float(rng.uniform(0.3, 1.0)))
        topk = None if rng.random() < dense_share else int(rng.integers(lo, hi + 1))
        out.append((lengths, topk))
    return out
