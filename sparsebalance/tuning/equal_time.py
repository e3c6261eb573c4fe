"""Equal-step-time planning: the most kept pairs a plan can hold at the static plan's step time.

The critical-path policy's first objective is speed: the shortest step that keeps the
static plan's attention (the floor), then as much attention as fits under that step. The
question "at the step time static sparse attention already pays, how much more attention
can DST keep?" (the paper's free accuracy) turns the objectives round: the deadline is
fixed at the static plan's predicted step time and the attention is maximised under it.

Method. Every candidate is a plan of the existing policies, raised into the slack under the
deadline (:func:`~sparsebalance.tuning.critical_path.raise_indices`: free-float and
total-float passes, which never pass the deadline): the static plan (every op at ``k0``),
and the critical-path plans for each floor ("stage", "total") and attention slack in
``eps_grid``. A critical-path plan cuts the straggler, so its raise has the step time it
saved to spend on the idle stages; the static plan raised into its own float spends only the
float it already has. The candidate with the most attention wins (ties: the first, static
before the critical-path plans). The result is never slower than the deadline and never
holds less attention than the static plan.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .critical_path import FLOORS, critical_path_indices, objective, raise_indices
from .instance import Instance
from .plan import Plan, make_plan

EPS_GRID = (0.0, 0.05, 0.1, 0.2)
"""Attention slacks of the critical-path candidates (fraction of the static plan's)."""


def equal_time_indices(inst: Instance, deadline: Optional[float] = None,
                       eps_grid: Sequence[float] = EPS_GRID, floors: Sequence[str] = FLOORS,
                       shift_rounds: int = 4) -> np.ndarray:
    """Level indices [D, M, S] of the plan with the most kept pairs whose predicted step time
    is at most ``deadline`` ms (default: the static plan's; module docstring)."""
    for f in floors:
        if f not in FLOORS:
            raise ValueError(f"floor must be one of {FLOORS}, got {f!r}")
    static = np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index, dtype=np.int64)
    t_static = objective(inst, static)[0]
    dl = t_static if deadline is None else float(deadline)
    if dl < t_static * (1 - 1e-9):
        raise ValueError(f"deadline {dl} ms is below the static plan's step time {t_static} ms")
    cands = [static] + [critical_path_indices(inst, eps, floor=f) for f in floors for eps in eps_grid]
    best, best_a = None, -np.inf
    for idx in cands:
        raised = raise_indices(inst, idx, deadline=dl, shift_rounds=shift_rounds)
        t, a = objective(inst, raised)
        if t <= dl * (1 + 1e-9) and a > best_a * (1 + 1e-12):
            best, best_a = raised, a
    return best


def equal_time_plan(inst: Instance, deadline: Optional[float] = None, **kw) -> Plan:
    """:func:`equal_time_indices`, evaluated (policy ``equal-time``)."""
    return make_plan(inst, equal_time_indices(inst, deadline, **kw), "equal-time")
