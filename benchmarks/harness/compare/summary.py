"""The one-object JSON summary of an evaluation (the shape fixed by the issue).

::

    {"arms": {arm: {"step_ms", "tokens_per_s", "loss", "density", "imbalance",
                    "bubble_fraction"}},                       # real runs
     "speedup_vs_megatron": {arm: tokens/s of arm / tokens/s of megatron},
     "sim": {length file: {seq-length: {arm: predicted step ms}}},
     "validation": {arm: (predicted - measured) / measured}}

Sections without data are empty objects (a sim-only evaluation has no real arms).
"""

from __future__ import annotations

from typing import Optional

ARM_KEYS = ("step_ms", "tokens_per_s", "loss", "density", "imbalance", "bubble_fraction")
"""Per-arm keys of ``arms``."""


def build_summary(real: Optional[dict] = None, sim: Optional[dict] = None) -> dict:
    """Summary from the real-run result (``campaign.run_arms``) and the sim result
    (``{file: {seq: cell table}}`` of :func:`benchmarks.harness.compare.cluster_sim.simulate_cell`)."""
    arms, speed, val = {}, {}, {}
    if real:
        for name, row in real.get("arms", {}).items():
            arms[name] = {k: row[k] for k in ARM_KEYS}
        base = arms.get("megatron")
        if base and base["tokens_per_s"] > 0:
            speed = {n: a["tokens_per_s"] / base["tokens_per_s"] for n, a in arms.items()}
        val = {n: row["validation"] for n, row in real.get("arms", {}).items()
               if row.get("validation") is not None}
    sims = {}
    for fname, by_seq in (sim or {}).items():
        sims[fname] = {str(seq): {a: cell["arms"][a]["step_ms"] for a in cell["arms"]}
                       for seq, cell in by_seq.items()}
    return {"arms": arms, "speedup_vs_megatron": speed, "sim": sims, "validation": val}


def check_summary(summary: dict) -> None:
    """Raise ValueError naming the first violation of the fixed shape."""
    if set(summary) != {"arms", "speedup_vs_megatron", "sim", "validation"}:
        raise ValueError(f"summary keys must be arms, speedup_vs_megatron, sim, validation; "
                         f"got {sorted(summary)}")
    for name, row in summary["arms"].items():
        if set(row) != set(ARM_KEYS):
            raise ValueError(f"summary arms[{name!r}] keys {sorted(row)}")
        if not isinstance(row["bubble_fraction"], list):
            raise ValueError(f"summary arms[{name!r}].bubble_fraction must be a list")
    for key in ("speedup_vs_megatron", "validation"):
        for name, v in summary[key].items():
            if not isinstance(v, float):
                raise ValueError(f"summary {key}[{name!r}] must be a number")
    for f, by_seq in summary["sim"].items():
        for seq, by_arm in by_seq.items():
            if not all(isinstance(v, float) for v in by_arm.values()):
                raise ValueError(f"summary sim[{f!r}][{seq!r}] must map arms to ms")
