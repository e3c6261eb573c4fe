"""The ``--mode sim --json`` object: one row per simulated cluster cell.

::

    {"cost_model": str,
     "cells": [{"model": str, "context": int, "pp": int, "dp": int, "cp": int,
                "arms": {arm: tokens_per_s},
                "best_baseline": arm,
                "sb_vs_best": float}]}

``tokens_per_s``: real (non-padding) tokens the whole cluster (``dp x pp x cp`` GPUs)
trains per second of predicted step time, pooled over the cell's length files (sum of
tokens over sum of step times). Baselines are the arms that are neither SparseBalance
nor one of its parts (:func:`is_baseline`); ``sb_vs_best`` is the fastest full
SparseBalance arm (:data:`SB_ARMS`: alone, with the paper's anchor rule, or with dynamic
CP) over the fastest baseline.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

SB_ARMS = ("sparsebalance", "sparsebalance-anchor", "sparsebalance+dcp")
"""The full method (SAB + DST), alone or under dynamic CP: the numerator of sb_vs_best."""
SB_PARTS = ("sab", "dst")
"""Single mechanisms of SparseBalance: neither side of sb_vs_best."""


def is_baseline(arm: str) -> bool:
    """True for a peer's or Megatron's arm: not SparseBalance, not one of its parts
    (``sab``, ``dst``, ``sparsebalance*``)."""
    return arm not in SB_PARTS and not arm.startswith("sparsebalance")


def pooled_tokens_per_s(tables: Iterable[dict]) -> Dict[str, float]:
    """Per arm, tokens/s over several cell tables (``cluster_sim.simulate_cell(...).table``)
    of the same cluster shape: total tokens over total predicted time."""
    tok: Dict[str, float] = {}
    ms: Dict[str, float] = {}
    for t in tables:
        for arm, row in t["arms"].items():
            tok[arm] = tok.get(arm, 0.0) + row["tokens"]
            ms[arm] = ms.get(arm, 0.0) + row["tokens"] / row["tokens_per_ms"]
    return {a: 1e3 * tok[a] / ms[a] for a in tok}


def make_cell(model: str, context: int, pp: int, dp: int, cp: int, arms: Dict[str, float]) -> dict:
    """One row of the shape above from ``{arm: tokens_per_s}``."""
    base = {a: v for a, v in arms.items() if is_baseline(a)}
    sb = {a: v for a, v in arms.items() if a in SB_ARMS}
    if not base or not sb:
        raise ValueError(f"cell {model} {context} needs a baseline and a SparseBalance arm, "
                         f"got {sorted(arms)}")
    best = max(base, key=base.get)
    return {"model": model, "context": int(context), "pp": int(pp), "dp": int(dp), "cp": int(cp),
            "arms": {a: float(v) for a, v in arms.items()}, "best_baseline": best,
            "sb_vs_best": float(max(sb.values()) / base[best])}


def sim_cells(sim: dict) -> List[dict]:
    """Rows of a ``--mode sim`` result (``sim.json``: models x seq-lengths x CP sizes at
    one PP/DP), each pooled over the length files."""
    cfg = sim["config"]
    out = []
    for model, m in sim["models"].items():
        by_cp = {"1": m["cells"], **{c: v["cells"] for c, v in m.get("cp", {}).items()}}
        for cp, cells in by_cp.items():
            seqs = sorted({int(s) for by in cells.values() for s in by})
            for seq in seqs:
                tables = [by[str(seq)] for by in cells.values() if str(seq) in by]
                out.append(make_cell(model, seq, cfg["pp"], cfg["dp"], int(cp),
                                     pooled_tokens_per_s(tables)))
    return out


def check_cells(obj: dict) -> None:
    """Raise ValueError naming the first violation of the shape (module docstring),
    including ``best_baseline`` and ``sb_vs_best`` disagreeing with ``arms``."""
    if set(obj) != {"cost_model", "cells"} or not isinstance(obj["cost_model"], str):
        raise ValueError(f"keys must be cost_model (str) and cells, got {sorted(obj)}")
    keys = {"model", "context", "pp", "dp", "cp", "arms", "best_baseline", "sb_vs_best"}
    for i, c in enumerate(obj["cells"]):
        if set(c) != keys:
            raise ValueError(f"cells[{i}] keys {sorted(c)}")
        for k in ("context", "pp", "dp", "cp"):
            if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
                raise ValueError(f"cells[{i}].{k} must be a positive int")
        if not all(isinstance(v, float) and v > 0 for v in c["arms"].values()):
            raise ValueError(f"cells[{i}].arms must map arms to positive tokens/s")
        ref = make_cell(c["model"], c["context"], c["pp"], c["dp"], c["cp"], c["arms"])
        if c["best_baseline"] != ref["best_baseline"]:
            raise ValueError(f"cells[{i}].best_baseline {c['best_baseline']!r} is not the "
                             f"fastest baseline {ref['best_baseline']!r}")
        if abs(c["sb_vs_best"] - ref["sb_vs_best"]) > 1e-9 * ref["sb_vs_best"]:
            raise ValueError(f"cells[{i}].sb_vs_best {c['sb_vs_best']} != {ref['sb_vs_best']}")
