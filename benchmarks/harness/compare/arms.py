"""The compared arms: a packing strategy x an attention-budget policy.

One table serves the simulation (packing strategy + DST planner on the pipeline
model) and the real runs (the ``pretrain_gpt.py`` flags that select the same
configuration), so both modes compare exactly the same things.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Arm:
    """One compared configuration."""

    name: str
    """Arm name used in tables and in the JSON summary."""
    batching: str
    """Packing strategy (``sparsebalance.batching`` name)."""
    dst: str = "off"
    """Budget policy: 'off' (static top-k), 'anchor' or 'critical-path'."""
    param: float = 0.0
    """Anchor: p (budget range +-p k0). Critical-path: attention slack eps."""
    sparse: bool = True
    """Block top-k sparse attention (False: full attention)."""
    plan_ahead: bool = True
    """DST plans the next step in the background (False: in line, before each step)."""
    no_cut: bool = False
    """DST only raises: no budget below k0 (``--sb-topk-min`` = ``--sb-topk``)."""
    description: str = ""
    """One line for the report."""
    dynamic_cp: bool = False
    """Simulation only: a CP size per document (Megatron-core's hybrid CP scheduler,
    ``dynamic_cp.py``) instead of the run's one CP size."""

    def driver_flags(self, topk: Optional[int] = None) -> List[str]:
        """``pretrain_gpt.py`` flags selecting this arm (model/corpus flags excluded).

        ``topk``: the run's ``--sb-topk`` (k0), needed by ``no_cut`` arms.
        """
        if self.no_cut and topk is None:
            raise ValueError(f"arm {self.name}: no_cut needs the run's top-k")
        if not self.sparse:
            return ["--sb-batching", self.batching]
        flags = ["--sparse-attention", "--sb-batching", self.batching, "--sb-dst", self.dst]
        if self.dst == "anchor":
            flags += ["--sb-anchor", "mean", "--sb-p", f"{self.param:g}"]
        elif self.dst == "critical-path":
            flags += ["--sb-attn-slack", f"{self.param:g}"]
        if self.dst != "off" and not self.plan_ahead:
            flags.append("--no-sb-plan-ahead")
        if self.no_cut:
            flags += ["--sb-topk-min", str(topk)]
        return flags


ARMS: Dict[str, Arm] = {a.name: a for a in (
    Arm("dense", "megatron", sparse=False,
        description="full causal attention, Megatron packing (reference for loss and density)"),
    Arm("megatron", "megatron",
        description="static sparse top-k k0, Megatron packing (the baseline)"),
    Arm("sab", "sab", description="sparsity-aware batching only, static k0"),
    Arm("dst", "megatron", "critical-path", 0.0,
        description="DST only: Megatron packing + critical-path budgets, attention slack 0"),
    Arm("sparsebalance", "sab", "critical-path", 0.0,
        description="SAB + critical-path DST, attention slack 0"),
    Arm("sparsebalance-anchor", "sab", "anchor", 0.1,
        description="SAB + the paper's mean-anchor DST, p = 0.1"),
    Arm("wlb", "wlb", description="WLB-LLM packing (dense-cost LPT + outlier queues), static k0"),
    Arm("dp-balanced", "dp-balanced",
        description="Megatron-core dp_balanced packing (in-order fill, round-robin over DP), "
                    "static k0"),
)}
"""Main arms, in report order."""

SIM_ONLY: Dict[str, Arm] = {a.name: a for a in (
    Arm("dynamic-cp", "dp-balanced", dynamic_cp=True,
        description="Megatron-core dynamic CP: dp_balanced packing, a power-of-two CP size per "
                    "document from the L^2/cp estimate, static k0"),
    Arm("sparsebalance+dcp", "sab", "critical-path", 0.0, dynamic_cp=True,
        description="SAB + critical-path DST under Megatron-core's dynamic CP scheduler"),
    Arm("greedy-tokens", "tokens",
        description="greedy fixed-length packing (LPT by token count), static k0: WLB-LLM's "
                    "second baseline, for the validation table (wlb_validation.py)"),
)}
"""Arms the real runs cannot select (no dynamic CP in the CPU driver): simulation only."""

ANCHOR_PS: Tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)
"""Frontier: anchor-rule p values (mean anchor)."""
SLACKS: Tuple[float, ...] = (0.0, 0.02, 0.05, 0.1)
"""Frontier: critical-path attention slack eps values."""


def frontier_arms() -> Dict[str, Arm]:
    """Frontier points on SAB packing: both DST families over their parameter grids."""
    out = {}
    for p in ANCHOR_PS:
        out[f"anchor-p{p:g}"] = Arm(f"anchor-p{p:g}", "sab", "anchor", p,
                                    description=f"SAB + mean anchor, p = {p:g}")
    for e in SLACKS:
        out[f"critical-path-eps{e:g}"] = Arm(f"critical-path-eps{e:g}", "sab", "critical-path", e,
                                             description=f"SAB + critical-path, eps = {e:g}")
    return out


FRONTIER: Dict[str, Arm] = frontier_arms()
"""Frontier points by name."""

ABLATIONS: Dict[str, Arm] = {a.name: a for a in (
    Arm("sparsebalance-inline", "sab", "critical-path", 0.0, plan_ahead=False,
        description="sparsebalance with each step's plan made in line (on the critical path)"),
    Arm("sparsebalance-nocut", "sab", "critical-path", 0.0, no_cut=True,
        description="sparsebalance whose DST only raises (--sb-topk-min = --sb-topk): no op "
                    "keeps less attention than static"),
)}
"""Arms that isolate one mechanism, run by name (``--arms``)."""


def get_arm(name: str) -> Arm:
    """Main or frontier arm by name; raises ValueError naming ``arm``."""
    if name in ARMS:
        return ARMS[name]
    if name in FRONTIER:
        return FRONTIER[name]
    if name in ABLATIONS:
        return ABLATIONS[name]
    raise ValueError(f"arm must be one of {sorted(ARMS) + sorted(FRONTIER) + sorted(ABLATIONS)}, "
                     f"got {name!r}")
