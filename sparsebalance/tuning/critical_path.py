"""Pipeline-aware budget planner ("critical-path" policy).

Objective, in this order: (1) minimise the predicted step time subject to the
retained attention of each pipeline stage being at least ``(1 - eps)`` times the static
plan's on that stage (every op at ``k0``) and every budget in the allowed levels; (2) at
that step time, maximise the retained attention.

Why per stage (``floor="stage"``, the default): budget cuts answer imbalance that changes
from micro-batch to micro-batch; a stage that is slower in every micro-batch (its layers, or
the output layer and loss on the last stage) is a layout's imbalance, fixed by the layer split
(``tools/propose_layout.py``), not by cutting that stage in every micro-batch and paying for it
on the others. Each stage's floor makes the plan trade budget between the micro-batches of a
stage only, against that stage's own typical time. ``floor="total"`` keeps one floor for the
whole step (budget may move between stages).

Method. The replicas interact only through the step time (the slowest one) and
the attention total, so for a deadline ``T`` each replica can be planned on its own.
Three steps, all on the exact dependency graph of megatron's schedule, every
candidate plan being one column of the same vectorised longest-path sweep:

1. Cut. Capped plans: each op gets the highest level whose predicted latency is
   within ``theta`` times an anchor (its stage's mean at ``k0``, or its replica's
   mean, which also moves budget off the slowest stage), for a grid of ``theta``;
   plus the static plan. For every candidate step time ``T`` (a step time of one
   of these plans), each replica takes its capped plan with the most attention
   that fits under ``T``.
2. Raise where there is slack. With the ops at their earliest starts, an op may
   grow by its free float (the gap to its earliest successor, or to ``T``) without
   moving anything else; with the ops at their latest starts, by the gap to its
   latest predecessor. All ops take their float at once (the old start times stay
   a valid schedule, so the step can never pass ``T``), each taking the level with
   the most attention that fits; the two passes alternate. Critical ops have no
   float, so raises land off the critical path. The smallest ``T`` whose raised
   plan keeps the attention floor wins; the static plan raised into its own slack
   is always a candidate, so the plan is never slower than static and never below
   the floor.
3. Polish (local search, within a fixed compute budget): cut one level on an op of
   the critical path of the slowest replica and raise into the new slack, or swap
   that cut for one level more on any other op; every choice is timed at once; keep
   the best move that shortens the step and keeps the floor; repeat.

Finally the plan is raised with its own step time as the deadline (objective 2):
free-float passes, then total-float rounds that give one op per replica the whole
float of its forward and backward (an op whose forward has float only early and
whose backward only late cannot move in the free-float passes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import numpy as np

from ..pipeline.graph import Graph, build_graph, earliest, latest
from ..pipeline.simulate import critical_path_nodes
from .instance import Instance
from .plan import Plan, make_plan

_TOL = 1e-9
_SWAP_CELLS = 4_000_000
"""Largest swap sweep of the polish, in (op x column) cells (~100 MB of float64)."""


class _Batch:
    """Level tables laid out for the engine: columns are (candidate, replica) pairs."""

    def __init__(self, inst: Instance, num_candidates: int,
                 weight: Optional[np.ndarray] = None) -> None:
        self.inst = inst
        self.g: Graph = build_graph(inst.schedule, inst.pp, inst.microbatches, inst.vpp,
                                    inst.group)
        D, M, S = inst.dp, inst.microbatches, inst.stages
        self.D, self.MS, self.K = D, M * S, num_candidates
        L = len(inst.levels)
        self.col_rep = np.tile(np.arange(D), num_candidates)  # column c -> replica c % D
        self._rows = np.arange(M * S)[:, None]

        def lay(a: np.ndarray) -> np.ndarray:
            return a.reshape(L, D, M * S).transpose(0, 2, 1)  # [L, MS, D]

        self.Fr, self.Br, self.Ar = lay(inst.fwd), lay(inst.bwd), lay(inst.attn)
        # Weighted kept pairs (a weight per micro-batch [D, M] or per op [D, M, S]:
        # tuning/sensitivity.py, tuning/stage_sensitivity.py).
        self.Wr = self.Ar if weight is None else lay(inst.attn * inst.op_weight(weight)[None])
        self.Lr = self.Fr + self.Br
        N = self.g.num_nodes
        s1 = self.g.succ[:, 1]
        self.out_lag = (np.where(s1 < N, self.g.hop[np.minimum(s1, N - 1)], False)
                        * inst.p2p_ms)[:, None]
        self.in_lag = (self.g.hop * inst.p2p_ms)[:, None]
        self.scale = max(float(inst.fwd.max() + inst.bwd.max()), 1.0)

    def _pick(self, table: np.ndarray, X: np.ndarray) -> np.ndarray:
        """table[X[i, c], i, replica(c)] -> [MS, C]."""
        return table[X, self._rows, self.col_rep[None, :]]

    def durations(self, X: np.ndarray) -> np.ndarray:
        """[N, C] durations of level indices X [MS, C]."""
        return np.concatenate([self._pick(self.Fr, X), self._pick(self.Br, X)], axis=0)

    def attention(self, X: np.ndarray) -> np.ndarray:
        """[K] total attention of each candidate (summed over its replicas)."""
        return self._pick(self.Ar, X).sum(axis=0).reshape(self.K, self.D).sum(axis=1)

    def stage_attention(self, X: np.ndarray) -> np.ndarray:
        """[K, S] attention of each candidate on each stage (summed over micro-batches and replicas)."""
        S = self.inst.stages
        return self._pick(self.Ar, X).reshape(self.MS // S, S, self.K, self.D).sum(axis=(0, 3)).T

    def weighted(self, X: np.ndarray) -> np.ndarray:
        """[K] total weighted attention of each candidate (== attention without weights)."""
        return self._pick(self.Wr, X).sum(axis=0).reshape(self.K, self.D).sum(axis=1)

    def makespan(self, X: np.ndarray) -> np.ndarray:
        """[K] step time of each candidate (slowest of its replicas)."""
        _, ef = earliest(self.g, self.durations(X), self.inst.p2p_ms)
        return ef[:-1].max(axis=0).reshape(self.K, self.D).max(axis=1)

    def _take(self, X: np.ndarray, room: np.ndarray) -> np.ndarray:
        """Per op, the level with the most attention whose growth fits ``room`` [N, C].

        Only ops with room in both phases can move. Curves are non-decreasing in the
        level, so the levels that fit form a prefix (found by bisection); the
        current level always stays allowed. Among levels with the same attention
        the lowest (fastest) is taken.
        """
        MS = self.MS
        tol = _TOL * self.scale
        i, c = np.nonzero((room[:MS] > tol) & (room[MS:] > tol))
        if len(i) == 0:
            return X
        r, x = self.col_rep[c], X[i, c]
        top = np.minimum(
            _count(self.Fr, i, r, self.Fr[x, i, r] + room[i, c], strict=False),
            _count(self.Br, i, r, self.Br[x, i, r] + room[MS + i, c], strict=False)) - 1
        top = np.maximum(top, x)
        out = X.copy()
        out[i, c] = _count(self.Ar, i, r, self.Ar[top, i, r], strict=True)
        return out

    def fill(self, X: np.ndarray, deadline: np.ndarray, rounds: int = 4) -> np.ndarray:
        """Raise level indices X [MS, C] into the slack under ``deadline`` [C]."""
        g, p2p, N = self.g, self.inst.p2p_ms, self.g.num_nodes
        dl = deadline[None, :]
        for _ in range(rounds):
            es, ef = earliest(g, self.durations(X), p2p)
            es[N] = np.inf
            free = np.minimum(np.minimum(es[g.succ[:, 0]], es[g.succ[:, 1]] - self.out_lag),
                              dl) - ef[:N]
            X1 = self._take(X, free)
            ls, lf = latest(g, self.durations(X1), p2p, deadline)
            lf[N] = 0.0
            back = ls[:N] - np.maximum(lf[g.pred[:, 0]], lf[g.pred[:, 1]] + self.in_lag)
            X2 = self._take(X1, back)
            if np.array_equal(X2, X):
                break
            X = X2
        return X

    def shift(self, X: np.ndarray, deadline: np.ndarray, rounds: int) -> np.ndarray:
        """Raise one op per column per round into its total float under ``deadline``.

        The free-float passes of :meth:`fill` cannot move an op whose forward has
        float only at its earliest start and whose backward only at its latest (the
        usual case on a stage that waits for a slower one). Total float has no such
        gap, but is shared along paths, so only one op per column (the one gaining
        the most attention) takes it per round: its forward and backward together
        grow by at most the smaller of their total floats, so no path can pass
        ``deadline``.
        """
        g, p2p, N, MS = self.g, self.inst.p2p_ms, self.g.num_nodes, self.MS
        tol = _TOL * self.scale
        cols = np.arange(X.shape[1])
        for _ in range(rounds):
            dur = self.durations(X)
            _, ef = earliest(g, dur, p2p)
            _, lf = latest(g, dur, p2p, deadline)
            tf = lf[:N] - ef[:N]
            room = np.minimum(tf[:MS], tf[MS:])
            i, c = np.nonzero(room > tol)
            if len(i) == 0:
                break
            r, x = self.col_rep[c], X[i, c]
            top = np.maximum(_count(self.Lr, i, r, self.Lr[x, i, r] + room[i, c],
                                    strict=False) - 1, x)
            new = _count(self.Ar, i, r, self.Ar[top, i, r], strict=True)
            gain = np.zeros(X.shape)
            gain[i, c] = self.Ar[new, i, r] - self.Ar[x, i, r]
            best = np.argmax(gain, axis=0)
            moving = gain[best, cols] > 0
            if not moving.any():
                break
            upd = np.zeros(X.shape, dtype=np.int64) - 1
            upd[i, c] = new
            X = X.copy()
            X[best[moving], cols[moving]] = upd[best[moving], cols[moving]]
        return X


def _count(table: np.ndarray, i: np.ndarray, r: np.ndarray, thr: np.ndarray,
           strict: bool) -> np.ndarray:
    """Per element, how many levels have ``table[l, i, r] <= thr`` (``<`` if strict).

    ``table`` [L, MS, D] is non-decreasing along L, so this is a vectorised bisection.
    """
    L, MS, D = table.shape
    flat = table.reshape(-1)
    base = i * D + r
    lo, hi = np.zeros(len(i), dtype=np.int64), np.full(len(i), L, dtype=np.int64)
    for _ in range(int(L).bit_length()):
        mid = (lo + hi) >> 1
        v = np.take(flat, np.minimum(mid, L - 1) * (MS * D) + base)
        past = (v >= thr) if strict else (v > thr)
        past &= lo < hi
        np.copyto(hi, mid, where=past)
        np.copyto(lo, mid + 1, where=~past & (lo < hi))
    return lo


def _family(inst: Instance, thetas: np.ndarray) -> np.ndarray:
    """Capped plans, [MS, D * 2K]: candidate c = (family, theta) occupies columns c*D..c*D+D-1.

    Each op takes the highest level whose latency is within the cap (else the
    lowest); the cap is theta times an anchor at k0: the mean latency of the op's
    stage (family 0), or of its whole replica (family 1, which also moves budget
    away from the slowest stage). Long ops are cut to the cap, short ones raised.
    """
    D, M, S = inst.dp, inst.microbatches, inst.stages
    lat = (inst.fwd + inst.bwd).reshape(len(inst.levels), D, M * S).transpose(0, 2, 1)
    lat0 = lat[inst.k0_index]  # [MS, D]
    a_stage = np.tile(lat0.reshape(M, S, D).mean(axis=0), (M, 1))  # [MS, D]
    a_rep = np.broadcast_to(lat0.mean(axis=0, keepdims=True), lat0.shape)
    caps = np.concatenate([thetas[:, None, None] * a[None] for a in (a_stage, a_rep)])
    # Latency is non-decreasing in the level: the levels within a cap are a prefix.
    K2 = caps.shape[0]
    i = np.broadcast_to(np.arange(M * S)[None, :, None], caps.shape).ravel()
    r = np.broadcast_to(np.arange(D)[None, None, :], caps.shape).ravel()
    fits = _count(lat, i, r, caps.ravel() * (1 + _TOL), strict=False).reshape(K2, M * S, D)
    return np.maximum(fits - 1, 0).transpose(1, 0, 2).reshape(M * S, -1)


FLOORS = ("stage", "total")
"""Where the attention floor holds: on each stage, or over the whole step."""


def _floor_min(one: _Batch, k0: np.ndarray, eps: float, floor: str) -> np.ndarray:
    """The attention a plan must keep: [S] per stage, or [1] in total (tolerance included)."""
    per = one.stage_attention(k0)[0]
    target = (1.0 - eps) * (per if floor == "stage" else per.sum(keepdims=True))
    return target - _TOL * np.maximum(np.abs(target), 1.0)


def _meets(stage_att: np.ndarray, floor_min: np.ndarray) -> np.ndarray:
    """Whether each plan's attention per stage ``stage_att`` [..., S] keeps ``floor_min``."""
    att = stage_att if stage_att.shape[-1] == len(floor_min) else stage_att.sum(axis=-1, keepdims=True)
    return (att >= floor_min).all(axis=-1)


def critical_path_indices(inst: Instance, eps: float = 0.0, num_caps: int = 24,
                          num_deadlines: int = 4, polish_moves: int = 16,
                          polish_budget: float = 5e5, shift_rounds: int = 4,
                          floor: str = "stage", per_replica: bool = False) -> np.ndarray:
    """Level indices [D, M, S] of the critical-path plan (see module docstring).

    Args:
        eps: attention slack: the plan keeps at least ``(1 - eps)`` of the static
            plan's retained attention (on each stage, or in total). 0 = never less than static.
        floor: "stage" (each stage keeps its own static attention) or "total".
        num_caps: cap factors per cap family (search resolution).
        num_deadlines: candidate deadlines raised per round.
        polish_moves: most local-search moves (cuts and swaps) after the search.
        polish_budget: the local search stops after sweeping this many (op x
            candidate column) cells, which bounds planning time on large instances.
        shift_rounds: total-float raise rounds (one op per replica each).
        per_replica: also plan every replica on its own (:func:`_per_replica_indices`) and
            keep whichever plan is faster (then keeps more attention).
    """
    if per_replica and inst.dp > 1:
        kw = dict(num_caps=num_caps, num_deadlines=num_deadlines, polish_moves=polish_moves,
                  polish_budget=polish_budget, shift_rounds=shift_rounds, floor=floor)
        joint = critical_path_indices(inst, eps, **kw)
        split = _per_replica_indices(inst, eps, **kw)
        (tj, aj), (ts, as_) = objective(inst, joint), objective(inst, split)
        if ts < tj * (1 - _TOL) or (ts <= tj * (1 + _TOL) and as_ > aj):
            return split
        return joint
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"eps must be in [0, 1], got {eps}")
    if num_caps < 2 or num_deadlines < 1 or shift_rounds < 0 or polish_moves < 0:
        raise ValueError("need num_caps >= 2, num_deadlines >= 1, shift_rounds >= 0 and "
                         "polish_moves >= 0")
    if floor not in FLOORS:
        raise ValueError(f"floor must be one of {FLOORS}, got {floor!r}")
    D, M, S = inst.dp, inst.microbatches, inst.stages
    MS = M * S
    one = _Batch(inst, 1)
    k0 = np.full((MS, D), inst.k0_index, dtype=np.int64)
    t_static = float(one.makespan(k0)[0])
    floor_min = _floor_min(one, k0, eps, floor)
    # The static plan raised into its own slack: always feasible, never slower.
    best_X = one.fill(k0, np.full(D, t_static))
    best_t, best_a = float(one.makespan(best_X)[0]), float(one.attention(best_X)[0])

    # Cut: capped plans per replica; per deadline, each replica takes its best one.
    thetas = np.linspace(0.5, 1.5, num_caps)
    cand = np.concatenate([_family(inst, thetas), k0], axis=1)
    K = cand.shape[1] // D
    fam = _Batch(inst, K)
    _, ef = earliest(fam.g, fam.durations(cand), inst.p2p_ms)
    span = ef[:-1].max(axis=0).reshape(K, D)
    per = fam._pick(fam.Ar, cand).reshape(M, S, K, D).sum(axis=0)  # [S, K, D]
    att = per.sum(axis=0)
    times = np.unique(span)
    times = times[times <= best_t]
    if len(times):
        ok = span[None, :, :] <= times[:, None, None] * (1 + _TOL)  # [T, K, D]
        best_att = np.where(ok, att[None], -np.inf)
        pick = np.argmax(best_att, axis=1)  # [T, D]
        held = per[:, pick, np.arange(D)].sum(axis=2).T  # [T, S] attention of each deadline's picks
        # Raise: the raise phase adds attention, so also try deadlines below the
        # first one the capped plans meet on their own.
        first = np.flatnonzero(_meets(held, floor_min))
        hi = int(first[0]) if len(first) else len(times) - 1
        sel = np.unique(np.linspace(0, hi, num_deadlines).round().astype(int))
        ts = times[sel]
        X0 = np.concatenate([cand.reshape(MS, K, D)[:, pick[i], np.arange(D)] for i in sel],
                            axis=1)
        ras = _Batch(inst, len(sel))
        X = ras.fill(X0, np.repeat(ts, D))
        a2, t2 = ras.attention(X), ras.makespan(X)
        for j in np.flatnonzero(_meets(ras.stage_attention(X), floor_min)):
            if t2[j] < best_t - _TOL * best_t or (abs(t2[j] - best_t) <= _TOL * best_t
                                                  and a2[j] > best_a):
                best_X, best_t, best_a = X[:, j * D:(j + 1) * D].copy(), t2[j], a2[j]
    # Polish within a fixed compute budget (large instances get few or no moves).
    best_X = _polish(inst, one.fill(best_X, np.full(D, best_t)), floor_min, polish_moves,
                     polish_budget, shift_rounds)
    # Objective (2): everything that fits under the chosen step time.
    best_t = float(one.makespan(best_X)[0])
    best_X = one.fill(best_X, np.full(D, best_t))
    best_X = one.fill(one.shift(best_X, np.full(D, best_t), shift_rounds), np.full(D, best_t))
    return best_X.T.reshape(D, M, S)


def replica_instance(inst: Instance, r: int) -> Instance:
    """Replica ``r`` of ``inst`` as an instance of its own (dp = 1)."""
    w = None if inst.weight is None else inst.weight[r:r + 1]
    return replace(inst, dp=1, fwd=inst.fwd[:, r:r + 1], bwd=inst.bwd[:, r:r + 1],
                   attn=inst.attn[:, r:r + 1], weight=w)


CROSS_SLACKS = (0.03, 0.1, 0.3)
"""Per-replica planning: deeper cuts a slow replica may take below its own floor (its share of
the attention, per stage or in total), the other replicas' raises paying for them."""


def _per_replica_indices(inst: Instance, eps: float, **kw) -> np.ndarray:
    """Each replica planned as its own instance; then budget moved from the slow replicas to
    the fast ones.

    Why: the replicas meet only at the step's end (the slowest one) and in the attention
    floor. The joint search's polish cuts one op of the slowest replica per move, so with
    several replicas of nearly equal time (a balanced packing) and a lever that moves op times
    by little (TAU levels), its moves run out before every replica's critical path is
    shortened. Planned alone, each replica gets the whole search.

    1. Each replica's plan at the step's slack ``eps`` (its own floor: its sum keeps the step's)
       and at deeper slacks ``eps + CROSS_SLACKS`` (floors it cannot keep alone).
    2. Deadlines ``T``, from the slowest replica's own plan down through the replicas' plan
       times: each replica takes its plans that fit ``T``, raised into ``T``, the one keeping
       the most attention (else the shallowest); the smallest ``T`` whose plans together keep
       the step's floor wins (the search stops at the first ``T`` that misses it).
    """
    D, M, S = inst.dp, inst.microbatches, inst.stages
    floor, shift = kw["floor"], kw["shift_rounds"]
    subs = [replica_instance(inst, r) for r in range(D)]
    slacks = (eps,) + tuple(min(1.0, eps + x) for x in CROSS_SLACKS)
    plans = [[critical_path_indices(sub, e, **kw) for e in slacks] for sub in subs]
    times = np.array([[objective(sub, x)[0] for x in ps] for sub, ps in zip(subs, plans)])
    one = _Batch(inst, 1)
    floor_min = _floor_min(one, np.full((M * S, D), inst.k0_index, dtype=np.int64), eps, floor)

    def keeps(X: np.ndarray) -> bool:
        return bool(_meets(inst.at(X)[2].sum(axis=(0, 1))[None], floor_min)[0])

    t_own = float(times[:, 0].max())
    best = np.concatenate([raise_indices(sub, ps[0], t_own, shift) for sub, ps in zip(subs, plans)])
    for T in np.unique(times[times < t_own * (1 - _TOL)])[::-1]:
        fits = [[raise_indices(sub, x, float(T), shift) for x, t in zip(ps, ts) if t <= T * (1 + _TOL)]
                for sub, ps, ts in zip(subs, plans, times)]
        if any(not f for f in fits):
            break
        most = np.concatenate([max(f, key=lambda x, s=sub: float(s.at(x)[2].sum()))
                               for f, sub in zip(fits, subs)])
        shallow = np.concatenate([f[0] for f in fits])
        X = most if keeps(most) else shallow if keeps(shallow) else None
        if X is None:
            break
        best = X
    return raise_indices(inst, best, shift_rounds=shift)


def _critical_vars(inst: Instance, one: _Batch, X: np.ndarray) -> Tuple[np.ndarray, int]:
    """Variables (rows of X) on the critical path of the slowest replica, and that replica."""
    es, ef = earliest(one.g, one.durations(X), inst.p2p_ms)
    rep = ef[:-1].max(axis=0)
    col = int(np.argmax(rep))
    nodes = critical_path_nodes(one.g, es, ef, col, inst.p2p_ms)
    return np.unique(np.array(nodes) % one.MS), col


def _polish(inst: Instance, X: np.ndarray, floor_min: np.ndarray, max_moves: int, budget: float,
            shift_rounds: int = 4, num_tries: int = 4) -> np.ndarray:
    """Local search around X [MS, D]; each move must shorten the step and keep the
    attention floor ``floor_min`` (:func:`_floor_min`); up to ``max_moves`` moves, stopping before the sweeps
    would exceed ``budget`` (op x column) cells. Two kinds of move, best one wins:

    * cut: one op of the slowest replica's critical path loses one level, then
      everything is raised into the new slack (the ``num_tries`` cuts that shorten
      the step most are raised);
    * swap: that cut plus one level more for any other op (of any replica), which
      moves budget from ops the critical path runs through twice (forward and
      backward) to ops it touches once or not at all.
    """
    D, L = inst.dp, len(inst.levels)
    one = _Batch(inst, 1)
    cell = D * one.g.num_nodes  # one sweep of one candidate plan
    spent = 0.0
    for _ in range(max_moves):
        rows, col = _critical_vars(inst, one, X)
        rows = rows[X[rows, col] > 0]
        cost = cell * (len(rows) + num_tries * (16 + 2 * shift_rounds))
        if len(rows) == 0 or spent + cost > budget:
            break
        spent += cost
        t = float(one.makespan(X)[0])
        cuts = np.tile(X, (1, len(rows)))
        cuts[rows, np.arange(len(rows)) * D + col] -= 1
        bc = _Batch(inst, len(rows))
        spans = bc.makespan(cuts)
        order = np.argsort(spans, kind="stable")[:num_tries]
        order = order[spans[order] < t * (1 - _TOL)]
        cands, cand_att, cand_span, cand_ok = [], [], [], []
        if len(order):
            sel = (order[:, None] * D + np.arange(D)).ravel()
            bk = _Batch(inst, len(order))
            dl = np.repeat(spans[order], D)
            filled = bk.shift(bk.fill(cuts[:, sel], dl), dl, shift_rounds)
            cands.append(filled)
            cand_att.append(bk.attention(filled))
            cand_span.append(bk.makespan(filled))
            cand_ok.append(_meets(bk.stage_attention(filled), floor_min))
        # Swaps: every (critical cut, raise elsewhere) pair, timed as is (only while
        # the pairs fit in a bounded sweep).
        up_r, up_c = np.nonzero(X < L - 1)
        if 0 < len(rows) * len(up_r) * cell <= min(_SWAP_CELLS, budget - spent):
            spent += len(rows) * len(up_r) * cell
            n_cut, n_up = len(rows), len(up_r)
            sw = np.tile(cuts, (1, n_up))  # block u holds all cuts, then raise u
            base = np.arange(n_up)[:, None] * (n_cut * D) + np.arange(n_cut)[None, :] * D
            sw[np.repeat(up_r, n_cut), (base + up_c[:, None]).ravel()] += 1
            bs = _Batch(inst, n_cut * n_up)
            cands.append(sw)
            cand_att.append(bs.attention(sw))
            cand_span.append(bs.makespan(sw))
            cand_ok.append(_meets(bs.stage_attention(sw), floor_min))
        if not cands:
            break
        att, span2 = np.concatenate(cand_att), np.concatenate(cand_span)
        ok = np.flatnonzero(np.concatenate(cand_ok) & (span2 < t * (1 - _TOL)))
        if len(ok) == 0:
            break
        k = ok[np.lexsort((-att[ok], span2[ok]))[0]]
        X = np.concatenate(cands, axis=1)[:, k * D:(k + 1) * D].copy()
    return X


def raise_indices(inst: Instance, idx: np.ndarray, deadline: Optional[float] = None,
                  shift_rounds: int = 4) -> np.ndarray:
    """Raise level indices [D, M, S] into the slack without passing ``deadline``.

    Free-float passes, then ``shift_rounds`` total-float rounds, then free-float
    passes again. ``deadline`` defaults to the plan's own step time, so the result
    is never slower.
    """
    D, M, S = inst.dp, inst.microbatches, inst.stages
    one = _Batch(inst, 1)
    X = np.asarray(idx, dtype=np.int64).reshape(D, M * S).T.copy()
    t = float(one.makespan(X)[0]) if deadline is None else float(deadline)
    dl = np.full(D, t)
    return one.fill(one.shift(one.fill(X, dl), dl, shift_rounds), dl).T.reshape(D, M, S)


def critical_path_plan(inst: Instance, eps: float = 0.0, floor: str = "stage") -> Plan:
    """The critical-path plan, evaluated (the joint search; ``per_replica`` is an experiment:
    see :func:`_per_replica_indices`)."""
    return make_plan(inst, critical_path_indices(inst, eps, floor=floor), "critical-path")


def policy(inst: Instance, dst) -> Plan:
    """``DST_POLICIES["critical-path"]``: the critical-path plan under ``dst`` (a
    :class:`sparsebalance.config.DSTConfig`: ``attn_slack``, ``floor``)."""
    return critical_path_plan(inst, eps=dst.attn_slack, floor=dst.floor)


def objective(inst: Instance, idx: np.ndarray) -> Tuple[float, float]:
    """(step ms, total attention) of level indices [D, M, S] under the engine."""
    one = _Batch(inst, 1)
    X = np.asarray(idx, dtype=np.int64).reshape(inst.dp, -1).T
    return float(one.makespan(X)[0]), float(one.attention(X)[0])
