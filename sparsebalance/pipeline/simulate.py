"""The project's one pipeline step-time model: megatron's schedules from op durations.

Both entries walk the same dependency graph (:mod:`sparsebalance.pipeline.graph`):
``simulate`` takes durations per (dp replica, micro-batch, stage) and returns the
whole :class:`PipelineTimeline` (step time, per-rank busy/bubble time, the critical
path and every op's slack); :func:`step_ms` returns only the step time of each of a
batch of instances (the packers score many candidate orders at once). SAB, DST, the
simulator and the timelines all use these. Deterministic: equal inputs give equal
outputs, ties are broken by a fixed key (see ``critical_path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .graph import Graph, build_graph, earliest, finish_in_levels, latest

PHASES = ("F", "B")
_TOL = 1e-9


def op_id(phase: int, dp: int, microbatch: int, stage: int) -> str:
    """Stable op id, e.g. ``"F.d0.m3.s1"`` (stage = virtual stage ``v * pp + rank``)."""
    return f"{PHASES[phase]}.d{dp}.m{microbatch}.s{stage}"


@dataclass
class PipelineTimeline:
    """Predicted timeline of one step. Times in ms from the step start."""

    schedule: str
    """'1f1b' or 'interleaved'."""
    pp: int
    """Pipeline ranks."""
    vpp: int
    """Model chunks per rank."""
    dp: int
    """Data-parallel replicas."""
    num_microbatches: int
    """Micro-batches per replica."""
    step_ms: float
    """Step time: slowest replica (the gradient sync waits for it) + dp_sync_ms."""
    replica_step_ms: np.ndarray
    """[dp] finish time of each replica's last op."""
    start_ms: np.ndarray
    """[dp, 2, M, S] start of each op (phase 0 = forward, 1 = backward)."""
    end_ms: np.ndarray
    """[dp, 2, M, S] end of each op."""
    slack_ms: np.ndarray
    """[dp, 2, M, S] total float: how much the op may grow before the step grows."""
    replica_busy_ms: np.ndarray
    """[dp, pp] compute time per rank."""
    critical_path: List[str]
    """Op ids of the longest path of the slowest replica, first to last."""

    @property
    def per_replica_step_ms(self) -> List[float]:
        """Finish time of each replica, as a list."""
        return [float(x) for x in self.replica_step_ms]

    @property
    def busy_ms(self) -> np.ndarray:
        """[pp] compute time per rank, mean over replicas."""
        return self.replica_busy_ms.mean(axis=0)

    @property
    def replica_bubble_ms(self) -> np.ndarray:
        """[dp, pp] idle time per rank within the step (includes waiting for other replicas)."""
        return self.step_ms - self.replica_busy_ms

    @property
    def bubble_ms(self) -> np.ndarray:
        """[pp] idle time per rank, mean over replicas."""
        return self.replica_bubble_ms.mean(axis=0)

    @property
    def slack(self) -> dict:
        """Op id -> slack in ms, for every op."""
        d, two, M, S = self.slack_ms.shape
        return {op_id(p, r, m, s): float(self.slack_ms[r, p, m, s])
                for r in range(d) for p in range(two) for m in range(M) for s in range(S)}


def _as_array(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=float)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be a rectangular [dp][microbatch][stage] array: {e}")
    if a.ndim != 3 or 0 in a.shape:
        raise ValueError(f"{name} must be a non-empty [dp][microbatch][stage] array, "
                         f"got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{name} must hold finite durations >= 0 ms")
    return a


def durations_to_nodes(g: Graph, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """Stack [dp, M, S] forward/backward durations into the engine's ``[N, dp]``."""
    D = fwd.shape[0]
    return np.stack([fwd, bwd], axis=1).reshape(D, g.num_nodes).T.copy()


def critical_path_nodes(g: Graph, es: np.ndarray, ef: np.ndarray, col: int,
                        p2p_ms: float) -> List[int]:
    """Longest path of column ``col`` as node ids, first to last.

    Ties: the last op is the one with the latest finish, then the smallest node id;
    walking back, the input producer is preferred over the previous op on the rank.
    """
    N = g.num_nodes
    fin = ef[:N, col]
    v = int(np.flatnonzero(fin >= fin.max() - _TOL)[0])
    path = [v]
    while True:
        s = es[v, col]
        p_in, p_rank = int(g.pred[v, 1]), int(g.pred[v, 0])
        lag = p2p_ms if g.hop[v] else 0.0
        if p_in < N and abs(ef[p_in, col] + lag - s) <= _TOL * max(1.0, s):
            v = p_in
        elif p_rank < N and abs(ef[p_rank, col] - s) <= _TOL * max(1.0, s):
            v = p_rank
        else:
            break
        path.append(v)
    return path[::-1]


def simulate(fwd_ms: Sequence, bwd_ms: Sequence, *, schedule: str = "1f1b", vpp: int = 1,
             p2p_ms: float = 0.0, group: Optional[int] = None,
             dp_sync_ms: float = 0.0) -> PipelineTimeline:
    """Predict one step of megatron's pipeline schedule.

    Args:
        fwd_ms: ``[dp][microbatch][stage]`` forward time of each op, ms. For the
            interleaved schedule, stage = virtual stage ``v * pp + rank``
            (``pp = stages / vpp``).
        bwd_ms: same shape, backward time.
        schedule: '1f1b' or 'interleaved'.
        vpp: model chunks per rank (1 for '1f1b').
        p2p_ms: latency of each activation/gradient hop between ranks, ms.
        group: ``microbatch_group_size_per_vp_stage`` (default pp, as megatron).
        dp_sync_ms: time of the end-of-step gradient synchronisation, ms.
    """
    f = _as_array(fwd_ms, "fwd_ms")
    b = _as_array(bwd_ms, "bwd_ms")
    if f.shape != b.shape:
        raise ValueError(f"fwd_ms and bwd_ms shapes differ: {f.shape} vs {b.shape}")
    if vpp < 1 or f.shape[2] % vpp:
        raise ValueError(f"vpp must divide the number of stages {f.shape[2]}, got {vpp}")
    if p2p_ms < 0 or dp_sync_ms < 0:
        raise ValueError("p2p_ms and dp_sync_ms must be >= 0")
    D, M, S = f.shape
    pp = S // vpp
    g = build_graph(schedule, pp, M, vpp, group)
    dur = durations_to_nodes(g, f, b)
    es, ef = earliest(g, dur, p2p_ms)
    rep = ef[:-1].max(axis=0)
    step = float(rep.max())
    _, lf = latest(g, dur, p2p_ms, np.full(D, step))
    slack = lf[:-1] - ef[:-1]
    col = int(np.flatnonzero(rep >= step - _TOL)[0])
    cp = critical_path_nodes(g, es, ef, col, p2p_ms)
    busy = np.zeros((D, pp))
    rank_of_node = (np.arange(g.num_nodes) % S) % pp
    for r in range(pp):
        busy[:, r] = dur[rank_of_node == r].sum(axis=0)

    def shaped(a: np.ndarray) -> np.ndarray:
        return a[:g.num_nodes].T.reshape(D, 2, M, S)

    return PipelineTimeline(
        schedule=schedule, pp=pp, vpp=vpp, dp=D, num_microbatches=M,
        step_ms=step + float(dp_sync_ms), replica_step_ms=rep,
        start_ms=shaped(es), end_ms=shaped(ef), slack_ms=shaped(slack),
        replica_busy_ms=busy,
        critical_path=[op_id(g.unpack(v)[0], col, *g.unpack(v)[1:]) for v in cp],
    )


def step_ms(fwd_ms, bwd_ms, *, schedule: str = "1f1b", vpp: int = 1, p2p_ms: float = 0.0,
            group: Optional[int] = None) -> np.ndarray:
    """Step time (ms) of each instance of a batch: :func:`simulate`'s ``replica_step_ms``
    without the timeline (same engine, same numbers).

    Args:
        fwd_ms: ``[..., M, S]`` forward ms of micro-batch m on (virtual) stage s, in run
            order; leading dimensions are independent instances (replicas, candidates).
        bwd_ms: same shape, backward ms.

    Returns:
        ``[...]`` time from the first forward to the last backward of each instance.
    """
    f = np.asarray(fwd_ms, dtype=np.float64)
    b = np.asarray(bwd_ms, dtype=np.float64)
    M, S = f.shape[-2:]
    batch = f.shape[:-2]
    g = build_graph(schedule, S // vpp, M, vpp, group)
    n = int(np.prod(batch, dtype=np.int64))
    at = _level_rows(g)
    nodes = np.empty((g.num_nodes, n))
    nodes[at[0].ravel()] = f.reshape(n, M * S).T
    nodes[at[1].ravel()] = b.reshape(n, M * S).T
    return _finish_ms(g, nodes, p2p_ms).reshape(batch)


def step_ms_rows(fwd_rows, bwd_rows, seq, *, schedule: str = "1f1b", vpp: int = 1,
                 p2p_ms: float = 0.0, group: Optional[int] = None) -> np.ndarray:
    """:func:`step_ms` of instances assembled from a table of micro-batches.

    Instance i runs micro-batch ``seq[i, m]`` of the table at position m, so the result
    is ``step_ms(fwd_rows[seq], bwd_rows[seq])``, the same floats, without building the
    ``[B, M, S]`` arrays (the packers score thousands of candidate orders and moves that
    differ from each other in one or two micro-batches).

    Args:
        fwd_rows, bwd_rows: ``[R, S]`` forward / backward ms of R micro-batches per stage.
        seq: ``[B, M]`` int, table row of each position of each instance.

    Returns:
        ``[B]`` step time of each instance (ms).
    """
    fr = np.asarray(fwd_rows, dtype=np.float64)
    br = np.asarray(bwd_rows, dtype=np.float64)
    seq = np.asarray(seq)
    if fr.ndim != 2 or fr.shape != br.shape or seq.ndim != 2:
        raise ValueError(f"fwd_rows/bwd_rows must be equal [R, S] arrays and seq [B, M], got "
                         f"{fr.shape}, {br.shape}, {seq.shape}")
    S = fr.shape[1]
    B, M = seq.shape
    g = build_graph(schedule, S // vpp, M, vpp, group)
    at = _level_rows(g)
    seq_t = np.ascontiguousarray(seq.T)  # [M, B]
    nodes = np.empty((g.num_nodes, B))
    for p, rows in enumerate((fr, br)):
        cols = np.ascontiguousarray(rows.T)  # [S, R]: one gather of [M, B] per stage
        for j in range(S):
            nodes[at[p, :, j]] = cols[j].take(seq_t)
    return _finish_ms(g, nodes, p2p_ms)


def step_ms_scaled(x, fwd, bwd, *, schedule: str = "1f1b", vpp: int = 1, p2p_ms: float = 0.0,
                   group: Optional[int] = None) -> np.ndarray:
    """:func:`step_ms` of instances whose micro-batch m takes ``x[i, m]`` times the stage
    times ``fwd``, ``bwd``: ``step_ms(x[:, :, None] * fwd, x[:, :, None] * bwd)``, the same
    floats (SAB's pipeline-profile search scores hundreds of such shapes at a time).

    Args:
        x: ``[B, M]`` scale of each micro-batch of each instance.
        fwd, bwd: ``[S]`` stage times (ms) of a micro-batch of scale 1.

    Returns:
        ``[B]`` step time of each instance (ms).
    """
    x = np.asarray(x, dtype=np.float64)
    f0 = np.asarray(fwd, dtype=np.float64)
    b0 = np.asarray(bwd, dtype=np.float64)
    if x.ndim != 2 or f0.ndim != 1 or f0.shape != b0.shape:
        raise ValueError(f"x must be [B, M] and fwd/bwd equal [S] arrays, got {x.shape}, "
                         f"{f0.shape}, {b0.shape}")
    B, M = x.shape
    S = f0.size
    g = build_graph(schedule, S // vpp, M, vpp, group)
    at = _level_rows(g)
    x_t = np.ascontiguousarray(x.T)  # [M, B]
    nodes = np.empty((g.num_nodes, B))
    for p, base in enumerate((f0, b0)):
        for j in range(S):
            nodes[at[p, :, j]] = x_t * base[j]
    return _finish_ms(g, nodes, p2p_ms)


def _level_rows(g: Graph) -> np.ndarray:
    """``[2, M, S]`` row of each op (phase, micro-batch, stage) in the engine's level order."""
    at = np.empty(g.num_nodes, dtype=np.int64)
    at[g.perm] = np.arange(g.num_nodes)
    return at.reshape(2, g.num_microbatches, g.num_stages)


def _finish_ms(g: Graph, nodes: np.ndarray, p2p_ms: float) -> np.ndarray:
    """Latest finish ``[B]`` of op durations ``nodes`` ``[N, B]`` (rows in the engine's
    level order, :func:`_level_rows`): the step time of :func:`earliest`, without the start
    times and the copies back to node order that :func:`simulate` needs."""
    return finish_in_levels(g, nodes, p2p_ms)[:-1].max(axis=0)
