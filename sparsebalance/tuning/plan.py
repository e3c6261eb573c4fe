"""Budget plans: the result type shared by every policy, and plan evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from ..pipeline.simulate import PipelineTimeline, simulate
from .instance import Instance


@dataclass
class Plan:
    """A budget table and what the pipeline model predicts for it."""

    policy: str
    """Policy that produced the plan ('static', 'anchor', 'critical-path')."""
    budget: np.ndarray
    """[D, M, S] budget per op (stage = virtual stage v * P + rank): int top-k, or under
    threshold routing's TAU levels (``Instance.unit == "tau"``) float TAU."""
    step_ms: float
    """Predicted step time of the plan, ms."""
    baseline_step_ms: float
    """Predicted step time with every op at k0, ms."""
    attn: float
    """Total retained attention (kept query-key pairs) of the plan."""
    baseline_attn: float
    """Total retained attention of the static plan."""
    critical_path: List[str]
    """Op ids on the plan's critical path (slowest replica)."""

    @property
    def attn_loss(self) -> float:
        """Fraction of the baseline's attention lost (negative: gained)."""
        return 1.0 - self.attn / self.baseline_attn if self.baseline_attn > 0 else 0.0

    def to_json(self) -> dict:
        """The CLI's output object (exactly the keys of the agreed interface)."""
        return {"budget": self.budget.tolist(),
                "step_ms": self.step_ms, "baseline_step_ms": self.baseline_step_ms,
                "attn": self.attn, "baseline_attn": self.baseline_attn,
                "critical_path": list(self.critical_path)}


def timeline_at(inst: Instance, idx: np.ndarray) -> PipelineTimeline:
    """The pipeline model's timeline of the step at level indices ``idx`` [D, M, S]."""
    f, b, _ = inst.at(idx)
    return simulate(f, b, schedule=inst.schedule, vpp=inst.vpp, p2p_ms=inst.p2p_ms,
                    group=inst.group)


def make_plan(inst: Instance, idx: np.ndarray, policy: str) -> Plan:
    """Evaluate level indices ``idx`` [D, M, S] into a :class:`Plan`."""
    idx = np.asarray(idx, dtype=np.int64)
    base = np.full_like(idx, inst.k0_index)
    res = timeline_at(inst, idx)
    b_res = timeline_at(inst, base)
    return Plan(policy=policy, budget=inst.budgets(idx),
                step_ms=res.step_ms, baseline_step_ms=b_res.step_ms,
                attn=float(inst.at(idx)[2].sum()), baseline_attn=float(inst.at(base)[2].sum()),
                critical_path=res.critical_path)


def static_plan(inst: Instance) -> Plan:
    """Every op at k0 (static sparse attention)."""
    return make_plan(inst, np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index),
                     "static")


def static_policy(inst: Instance, dst=None) -> Plan:
    """``DST_POLICIES["static"]``: every op at k0 (``dst`` unused)."""
    return static_plan(inst)
