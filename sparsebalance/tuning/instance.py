"""Planning instance: predicted op time and retained attention as functions of the budget.

JSON form (the CLI's ``--instance``)::

    {"schedule": "1f1b" | "interleaved", "pp": P, "vpp": V, "dp": D, "microbatches": M,
     "k0": int, "kmin": int, "kmax": int, "levels": [int, ...] (optional),
     "p2p_ms": float, "weight": [[w per micro-batch] per dp replica] (optional; or
     [[[w per stage] per micro-batch] per dp replica]),
     "ops": [[[{"fwd": [[k, ms], ...], "bwd": [[k, ms], ...], "attn": [[k, pairs], ...]}
               per stage] per micro-batch] per dp replica]}

Each curve is piecewise linear in k between its points and constant beyond its
ends; values must be non-decreasing. For the interleaved schedule, stage means
virtual stage ``v * P + rank`` (``P * V`` stages). Budgets are chosen from the
allowed set ``levels`` (default: every integer in ``[kmin, kmax]``); ``k0`` is
always allowed so that the static plan is a valid plan.

Under threshold routing the levels may be TAUs instead (``"unit": "tau"``; ``k0``, ``kmin``,
``kmax`` and ``levels`` then TAUs in (0, 1], the run's top-k the cap of every level:
``from_predictor.build_tau_instance``); the planners only see level indices and the curves,
so they plan TAU exactly as they plan top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..pipeline.schedule import check_schedule

MAX_LEVELS = 4096
CURVES = ("fwd", "bwd", "attn")
UNITS = ("topk", "tau")
"""What a budget level is: a top-k (key blocks) or a threshold routing TAU."""


@dataclass(frozen=True)
class Instance:
    """Budget-planning problem for one training step."""

    schedule: str
    """'1f1b' or 'interleaved'."""
    pp: int
    """Pipeline ranks P."""
    vpp: int
    """Model chunks per rank V (1 for '1f1b')."""
    dp: int
    """Data-parallel replicas D."""
    microbatches: int
    """Micro-batches per replica M."""
    k0: float
    """Static budget of the baseline (a top-k, or under ``unit="tau"`` the run's TAU)."""
    kmin: float
    """Smallest allowed budget."""
    kmax: float
    """Largest allowed budget."""
    levels: np.ndarray
    """[L] allowed budgets, sorted, unique, including k0 (int top-k, or float TAU)."""
    fwd: np.ndarray
    """[L, D, M, S] forward ms of each op at each level."""
    bwd: np.ndarray
    """[L, D, M, S] backward ms."""
    attn: np.ndarray
    """[L, D, M, S] retained attention (kept query-key pairs) of each op."""
    p2p_ms: float = 0.0
    """Latency of one hop between pipeline ranks, ms."""
    group: Optional[int] = None
    """Interleaved: micro-batch group size per virtual stage (default P)."""
    weight: Optional[np.ndarray] = None
    """[D, M] sensitivity of each micro-batch: estimated loss per dropped kept pair
    (``sparsebalance.tuning.sensitivity``), or [D, M, S] of each op (a stage's layers pay
    differently: ``sparsebalance.tuning.stage_sensitivity``); None: every pair counts alike."""
    unit: str = "topk"
    """What a level is (:data:`UNITS`): "topk" or threshold routing's "tau"."""
    k0_index: int = field(init=False)
    """Index of k0 in ``levels``."""

    def __post_init__(self) -> None:
        g = check_schedule(self.schedule, self.pp, self.microbatches, self.vpp, self.group)
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.unit == "tau" and not 0.0 < float(np.min(self.levels)) <= float(np.max(self.levels)) <= 1.0:
            raise ValueError("TAU levels must lie in (0, 1]")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if not self.kmin <= self.k0 <= self.kmax:
            raise ValueError(f"k0={self.k0} outside [kmin={self.kmin}, kmax={self.kmax}]")
        lv = np.asarray(self.levels)
        if lv.ndim != 1 or np.any(np.diff(lv) <= 0) or self.k0 not in lv:
            raise ValueError("levels must be sorted, unique and contain k0")
        shape = (len(lv), self.dp, self.microbatches, self.pp * self.vpp)
        for name in CURVES:
            a = getattr(self, name)
            if a.shape != shape:
                raise ValueError(f"{name} table must have shape {shape}, got {a.shape}")
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"{name} values must be finite and >= 0")
            if np.any(np.diff(a, axis=0) < 0):
                raise ValueError(f"{name} must be non-decreasing in the budget")
        if self.weight is not None:
            w = np.asarray(self.weight, dtype=float)
            if w.shape not in (shape[1:3], shape[1:]) or not np.all(np.isfinite(w)) or np.any(w < 0):
                raise ValueError(f"weight must be a [dp, microbatch] = {shape[1:3]} or [dp, microbatch, "
                                 f"stage] = {shape[1:]} table of finite values >= 0")
            object.__setattr__(self, "weight", w)
        object.__setattr__(self, "k0_index", int(np.flatnonzero(lv == self.k0)[0]))
        if self.schedule == "interleaved":
            object.__setattr__(self, "group", g)

    @property
    def stages(self) -> int:
        """Virtual stages S = P * V."""
        return self.pp * self.vpp

    def op_weight(self, weight: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """[D, M, S] weight of each op: ``weight`` (default :attr:`weight`) of its micro-batch
        ([D, M]) or its own ([D, M, S]); None without one."""
        w = self.weight if weight is None else np.asarray(weight, dtype=float)
        if w is None:
            return None
        return np.broadcast_to(w[:, :, None], (self.dp, self.microbatches, self.stages)) if w.ndim == 2 else w

    def at(self, idx: np.ndarray):
        """(fwd, bwd, attn) arrays [D, M, S] for level indices ``idx`` [D, M, S]."""
        ix = np.asarray(idx)[None]
        return tuple(np.take_along_axis(getattr(self, n), ix, 0)[0] for n in CURVES)

    def budgets(self, idx: np.ndarray) -> np.ndarray:
        """Budgets [D, M, S] for level indices: int64 top-k values, or float TAUs."""
        b = self.levels[np.asarray(idx)]
        return b.astype(np.int64) if self.unit == "topk" else b.astype(np.float64)

    def indices(self, budget: Sequence) -> np.ndarray:
        """Level indices [D, M, S] of a budget table; raises if a budget is not allowed."""
        b = np.asarray(budget, dtype=np.int64 if self.unit == "topk" else np.float64)
        pos = np.searchsorted(self.levels, b)
        pos = np.minimum(pos, len(self.levels) - 1)
        if b.shape != self.fwd.shape[1:] or np.any(self.levels[pos] != b):
            raise ValueError("budget must be a [dp][microbatch][stage] table of allowed levels")
        return pos


def _curve(points: Any, where: str) -> np.ndarray:
    try:
        a = np.asarray(points, dtype=float)
    except (ValueError, TypeError):
        raise ValueError(f"{where}: curve must be a list of [k, value] pairs")
    if a.ndim != 2 or a.shape[1] != 2 or len(a) == 0:
        raise ValueError(f"{where}: curve must be a non-empty list of [k, value] pairs")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{where}: curve values must be finite")
    if np.any(np.diff(a[:, 0]) <= 0):
        raise ValueError(f"{where}: curve k values must be strictly increasing")
    if np.any(np.diff(a[:, 1]) < 0):
        raise ValueError(f"{where}: curve is not non-decreasing")
    if np.any(a[:, 1] < 0):
        raise ValueError(f"{where}: curve values must be >= 0")
    return a


def _int(d: Mapping, key: str, default: Any = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"'{key}' must be an integer, got {v!r}")
    return int(v)


def instance_from_json(d: Any) -> Instance:
    """Parse and validate the JSON form (see module docstring); ValueError on bad input."""
    if not isinstance(d, Mapping):
        raise ValueError("instance must be a JSON object")
    for key in ("pp", "dp", "microbatches", "k0", "kmin", "kmax", "ops"):
        if key not in d:
            raise ValueError(f"instance is missing '{key}'")
    schedule = d.get("schedule", "1f1b")
    P, V, D, M = _int(d, "pp"), _int(d, "vpp", 1), _int(d, "dp"), _int(d, "microbatches")
    unit = d.get("unit", "topk")
    if unit not in UNITS:
        raise ValueError(f"'unit' must be one of {UNITS}, got {unit!r}")
    if unit == "tau":
        k0, kmin, kmax, lv = _tau_levels(d)
    else:
        k0, kmin, kmax, lv = _topk_levels(d)
    try:
        p2p = float(d.get("p2p_ms", 0.0))
    except (TypeError, ValueError):
        raise ValueError("'p2p_ms' must be a number")
    if not np.isfinite(p2p) or p2p < 0:
        raise ValueError("'p2p_ms' must be a finite number >= 0")
    group = d.get("group")
    check_schedule(schedule, P, M, V, None if group is None else _int(d, "group"))
    S = P * V
    ops = d["ops"]
    levels = np.asarray(lv, dtype=float)
    tabs = {n: np.empty((len(lv), D, M, S)) for n in CURVES}
    if not isinstance(ops, list) or len(ops) != D:
        raise ValueError(f"'ops' must have {D} dp replicas")
    for r, rep in enumerate(ops):
        if not isinstance(rep, list) or len(rep) != M:
            raise ValueError(f"ops[{r}] must have {M} micro-batches (ragged nesting)")
        for m, mb in enumerate(rep):
            if not isinstance(mb, list) or len(mb) != S:
                raise ValueError(f"ops[{r}][{m}] must have {S} stages (ragged nesting)")
            for s, op in enumerate(mb):
                if not isinstance(op, Mapping):
                    raise ValueError(f"ops[{r}][{m}][{s}] must be an object")
                for n in CURVES:
                    if n not in op:
                        raise ValueError(f"ops[{r}][{m}][{s}] is missing '{n}'")
                    c = _curve(op[n], f"ops[{r}][{m}][{s}].{n}")
                    tabs[n][:, r, m, s] = np.interp(levels, c[:, 0], c[:, 1])
    weight = d.get("weight")
    try:
        weight = None if weight is None else np.asarray(weight, dtype=float)
    except (TypeError, ValueError):
        raise ValueError("'weight' must be a [dp][microbatch] or [dp][microbatch][stage] table of numbers")
    return Instance(schedule=schedule, pp=P, vpp=V, dp=D, microbatches=M, k0=k0, kmin=kmin,
                    kmax=kmax, levels=np.asarray(lv, dtype=np.int64 if unit == "topk" else np.float64),
                    p2p_ms=p2p, group=None if group is None else int(group), weight=weight, unit=unit, **tabs)


def _topk_levels(d: Mapping):
    """(k0, kmin, kmax, levels) of a top-k instance."""
    k0, kmin, kmax = _int(d, "k0"), _int(d, "kmin"), _int(d, "kmax")
    if not kmin <= k0 <= kmax:
        raise ValueError(f"k0={k0} outside [kmin={kmin}, kmax={kmax}]")
    if kmin < 0:
        raise ValueError(f"kmin must be >= 0, got {kmin}")
    if d.get("levels") is not None:
        raw = d["levels"]
        if not isinstance(raw, list) or not raw or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or int(x) != x
                for x in raw):
            raise ValueError("'levels' must be a non-empty list of integers")
        lv = sorted(set(int(x) for x in raw) | {k0})
        if lv[0] < kmin or lv[-1] > kmax:
            raise ValueError(f"levels must lie in [kmin={kmin}, kmax={kmax}]")
    else:
        if kmax - kmin + 1 > MAX_LEVELS:
            raise ValueError(f"[kmin, kmax] spans more than {MAX_LEVELS} budgets: give 'levels'")
        lv = list(range(kmin, kmax + 1))
    return k0, kmin, kmax, lv


def _tau_levels(d: Mapping):
    """(k0, kmin, kmax, levels) of a TAU instance: 'levels' required, each in (0, 1]."""
    raw = d.get("levels")
    if not isinstance(raw, list) or not raw or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 < float(x) <= 1.0 for x in raw):
        raise ValueError("a TAU instance needs 'levels': a non-empty list of TAUs in (0, 1]")
    vals = []
    for key in ("k0", "kmin", "kmax"):
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
            raise ValueError(f"'{key}' must be a TAU in (0, 1], got {v!r}")
        vals.append(float(v))
    k0, kmin, kmax = vals
    if not kmin <= k0 <= kmax:
        raise ValueError(f"k0={k0} outside [kmin={kmin}, kmax={kmax}]")
    lv = sorted(set(float(x) for x in raw) | {k0})
    if lv[0] < kmin or lv[-1] > kmax:
        raise ValueError(f"levels must lie in [kmin={kmin}, kmax={kmax}]")
    return k0, kmin, kmax, lv


def instance_to_json(inst: Instance) -> dict:
    """JSON form of an instance (curves given at the allowed levels)."""
    cast = int if inst.unit == "topk" else float
    lv = [cast(x) for x in inst.levels]
    D, M, S = inst.dp, inst.microbatches, inst.stages
    ops = [[[{n: [[k, float(getattr(inst, n)[i, r, m, s])] for i, k in enumerate(lv)]
              for n in CURVES} for s in range(S)] for m in range(M)] for r in range(D)]
    out = {"schedule": inst.schedule, "pp": inst.pp, "vpp": inst.vpp, "dp": D,
           "microbatches": M, "k0": cast(inst.k0), "kmin": cast(inst.kmin), "kmax": cast(inst.kmax),
           "levels": lv, "p2p_ms": inst.p2p_ms, "ops": ops}
    if inst.unit != "topk":
        out["unit"] = inst.unit
    if inst.schedule == "interleaved":
        out["group"] = inst.group
    if inst.weight is not None:
        out["weight"] = inst.weight.tolist()
    return out
