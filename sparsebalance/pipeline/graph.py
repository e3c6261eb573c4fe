"""Dependency graph of one pipeline replica's step and a batched longest-path engine.

Nodes are the ops of ONE data-parallel replica: node ``(phase * M + m) * S + j``
is phase F (0) or B (1) of micro-batch ``m`` on virtual stage ``j`` (``S = pp * vpp``
virtual stages, stage ``j`` lives on rank ``j % pp``). Each node has at most two
predecessors (the previous op on its rank; the op producing its input: F(m, j-1),
B(m, j+1), or F(m, S-1) for the last stage's backward) and at most two successors.
A hop between different ranks costs ``p2p_ms``. Sends are modelled as
asynchronous (a sender never waits for its receiver); megatron's combined
send/receive calls can make a rank wait for its peer a little longer, which
this model does not capture.

All replicas share the graph, so durations are arrays ``[N, B]`` whose columns are
independent instances (DP replicas, candidate plans). The engine walks the graph
level by level (a level = nodes whose predecessors are all in earlier levels), one
numpy operation over all nodes of a level and all columns at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional, Tuple

import numpy as np

from .schedule import RankOp, all_rank_orders, check_schedule


@dataclass(frozen=True)
class Graph:
    """Static structure of one replica's step (see module docstring)."""

    pp: int
    """Pipeline ranks."""
    vpp: int
    """Model chunks per rank (virtual pipeline size)."""
    num_microbatches: int
    """Micro-batches per step (per replica)."""
    pred: np.ndarray
    """[N, 2] int: previous op on the rank, input producer; N = none."""
    succ: np.ndarray
    """[N, 2] int: next op on the rank, input consumer; N = none."""
    hop: np.ndarray
    """[N] bool: the input edge (pred[:, 1] -> node) crosses ranks."""
    perm: np.ndarray = field(repr=False)
    """[N] node ids in topological-level order (the engine works in this order)."""
    bounds: Tuple[Tuple[int, int], ...] = field(repr=False)
    """Per level, its [start, stop) slice in ``perm`` order."""
    ppred: np.ndarray = field(repr=False)
    """[N, 2] predecessors in ``perm`` positions (N = none)."""
    psucc: np.ndarray = field(repr=False)
    """[N, 2] successors in ``perm`` positions (N = none)."""

    @property
    def num_stages(self) -> int:
        """Virtual stages S = pp * vpp."""
        return self.pp * self.vpp

    @property
    def num_nodes(self) -> int:
        """N = 2 * M * S."""
        return 2 * self.num_microbatches * self.num_stages

    def unpack(self, node: int) -> Tuple[int, int, int]:
        """(phase, micro-batch, virtual stage) of a node id."""
        S, M = self.num_stages, self.num_microbatches
        return node // (M * S), (node // S) % M, node % S


@lru_cache(maxsize=64)
def build_graph(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
                group: Optional[int] = None) -> Graph:
    """Graph of megatron's ``schedule`` for the given sizes (cached; immutable)."""
    check_schedule(schedule, pp, num_microbatches, vpp, group)
    M, S = num_microbatches, pp * vpp
    N = 2 * M * S
    pred = np.full((N, 2), N, dtype=np.int64)
    succ = np.full((N, 2), N, dtype=np.int64)
    hop = np.zeros(N, dtype=bool)

    def nid(op: RankOp, rank: int) -> int:
        phase, m, chunk = op
        return ((0 if phase == "F" else 1) * M + m) * S + chunk * pp + rank

    for r, ops in enumerate(all_rank_orders(schedule, pp, M, vpp, group)):
        ids = [nid(op, r) for op in ops]
        if sorted(ids) != sorted(set(ids)) or len(ids) != 2 * M * vpp:
            raise AssertionError(f"rank {r}: schedule does not run each op exactly once")
        for a, b in zip(ids, ids[1:]):
            pred[b, 0], succ[a, 0] = a, b
    for m in range(M):
        for j in range(S):
            f, b = (0 * M + m) * S + j, (1 * M + m) * S + j
            src_f = f - 1 if j > 0 else N
            src_b = b + 1 if j < S - 1 else f
            for dst, src in ((f, src_f), (b, src_b)):
                if src < N:
                    pred[dst, 1], succ[src, 1] = src, dst
                    hop[dst] = ((src % S) % pp) != ((dst % S) % pp)
    levels = _levels(pred, N)
    perm = np.concatenate(levels)
    pos = np.empty(N + 1, dtype=np.int64)
    pos[perm], pos[N] = np.arange(N), N
    stops = np.cumsum([len(lv) for lv in levels])
    bounds = tuple((int(b - len(lv)), int(b)) for lv, b in zip(levels, stops))
    return Graph(pp, vpp, M, pred, succ, hop, perm, bounds,
                 pos[pred[perm]], pos[succ[perm]])


def _levels(pred: np.ndarray, N: int) -> Tuple[np.ndarray, ...]:
    """Kahn levels; raises if the schedule deadlocks (a cycle)."""
    indeg = (pred < N).sum(axis=1)
    children: List[List[int]] = [[] for _ in range(N + 1)]
    for v in range(N):
        for p in pred[v]:
            children[p].append(v)
    frontier = [v for v in range(N) if indeg[v] == 0]
    out, seen = [], 0
    while frontier:
        out.append(np.array(sorted(frontier), dtype=np.int64))
        seen += len(frontier)
        nxt = []
        for v in frontier:
            for c in children[v]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    nxt.append(c)
        frontier = nxt
    if seen != N:
        raise AssertionError("schedule deadlocks: dependency cycle between ranks")
    return tuple(out)


def finish_in_levels(g: Graph, d: np.ndarray, p2p_ms: float) -> np.ndarray:
    """Earliest finish ``[N + 1, B]`` of durations ``d`` ``[N, B]``, both with rows in the
    graph's level order (``dur[g.perm]``); row N is the zero sentinel. The forward pass of
    :func:`earliest`, which ``step_ms`` uses alone (it needs no start times)."""
    N, B = d.shape
    ef = np.empty((N + 1, B))
    ef[N] = 0.0
    p0, p1 = g.ppred[:, 0], g.ppred[:, 1]
    lag = g.hop[g.perm] * float(p2p_ms)
    for a, b in g.bounds:
        x = ef[p1[a:b]]
        if p2p_ms:  # x + 0.0 is x for the times here (>= +0): skip the add
            x += lag[a:b, None]
        np.maximum(ef[p0[a:b]], x, out=ef[a:b])
        ef[a:b] += d[a:b]
    return ef


def earliest(g: Graph, dur: np.ndarray, p2p_ms: float) -> Tuple[np.ndarray, np.ndarray]:
    """Earliest start and finish, each ``[N + 1, B]`` (row N is a zero sentinel).

    Args:
        dur: ``[N, B]`` op durations in ms.
        p2p_ms: latency of one hop between ranks, in ms.
    """
    N, B = dur.shape
    ef = finish_in_levels(g, dur[g.perm], p2p_ms)
    out_f = np.zeros((N + 1, B))
    out_f[g.perm] = ef[:N]
    out_s = out_f.copy()
    out_s[:N] -= dur
    return out_s, out_f


def latest(g: Graph, dur: np.ndarray, p2p_ms: float, deadline: np.ndarray
           ) -> Tuple[np.ndarray, np.ndarray]:
    """Latest start and finish meeting ``deadline`` ``[B]``; each ``[N + 1, B]``.

    Row N is the +inf sentinel of "no successor".
    """
    N, B = dur.shape
    d = dur[g.perm]
    dl = np.asarray(deadline, dtype=float).reshape(1, B)
    s0, s1 = g.psucc[:, 0], g.psucc[:, 1]
    # An output edge crosses ranks iff its consumer's input edge does.
    cons = g.succ[g.perm, 1]
    out_lag = (np.where(cons < N, g.hop[np.minimum(cons, N - 1)], False) * float(p2p_ms))[:, None]
    ls = np.full((N + 1, B), np.inf)
    for a, b in reversed(g.bounds):
        ls[a:b] = np.minimum(np.minimum(ls[s0[a:b]], ls[s1[a:b]] - out_lag[a:b]), dl) - d[a:b]
    out_s = np.full((N + 1, B), np.inf)
    out_s[g.perm] = ls[:N]
    out_f = out_s.copy()
    out_f[:N] += dur
    return out_s, out_f
