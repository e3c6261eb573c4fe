"""The simulator against WLB-LLM's published numbers (issue 58, item 2).

WLB-LLM (Wang et al., OSDI'25, arXiv 2503.17924) reports end-to-end speedups of its
packing + per-document CP sharding over fixed-length packing (Megatron-style) on Meta's
internal framework and H100 clusters: 1.15x at 64K, 1.30x at 128K, 1.40x for the 7B
model at 160K, 1.23x on average, 1.19x over greedy fixed-length packing; and, for the
PP level, imbalance degree 1.44 under plain packing, 1.05 with its outlier queues.

Each published context is simulated here as a llama7b cell in WLB-LLM's micro-batch
regime (global batch PP x DP: M = PP micro-batches per replica), dense attention (every
block kept), DP 8, CP 1, at PP 4 and PP 8 (the paper's own PP/DP/CP/TP per configuration
is not in the copy of the paper read for this table: ``docs/results.md``), with the arms
megatron (fixed-length next-fit packing), wlb (``sparsebalance/batching/strategies/wlb.py``)
and greedy-tokens (greedy fixed-length packing, LPT by tokens). Nothing is tuned to agree::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode sim --wlb-validation \\
        --sim-models llama7b --sim-steps 12 --report results/wlb_validation
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Sequence

import numpy as np

from .cluster_sim import SimConfig
from .regime import Cell, run_cell

K = 1024
SOURCE = "WLB-LLM, Wang et al., OSDI'25 (arXiv 2503.17924)"
ARMS = ("megatron", "wlb", "greedy-tokens")


class Published(NamedTuple):
    """One published configuration and its numbers (None: not published for it)."""

    name: str
    context: int
    speedup: float
    """WLB-LLM over fixed-length packing, end to end."""
    imbalance_baseline: Optional[float] = None
    imbalance_wlb: Optional[float] = None


PUBLISHED = (Published("64K", 64 * K, 1.15), Published("128K", 128 * K, 1.30, 1.44, 1.05),
             Published("160K, 7B", 160 * K, 1.40))
"""Per context (module docstring)."""
AVERAGE = 1.23
"""Published mean speedup over fixed-length packing."""
OVER_GREEDY = 1.19
"""Published speedup over greedy fixed-length packing."""
PPS = (4, 8)


def row(pub: Published, cell: Cell, arms: Dict[str, dict]) -> dict:
    """One table row: the simulator's numbers beside the published ones."""
    wlb, meg, greedy = arms["wlb"], arms["megatron"], arms["greedy-tokens"]
    return {"name": pub.name, "model": cell.model, "context": cell.context, "pp": cell.pp,
            "dp": cell.dp, "micro_batches": cell.micro_batches, "attention": cell.attention,
            "sim": {"wlb_vs_megatron": wlb["speedup_vs_megatron"],
                    "wlb_vs_greedy": wlb["tokens_per_s"] / greedy["tokens_per_s"],
                    "megatron_vs_bound": meg["vs_lower_bound"],
                    "imbalance_degree": {a: arms[a]["imbalance_degree"] for a in ARMS},
                    "imbalance_degree_max": {a: arms[a]["imbalance_degree_max"] for a in ARMS}},
            "published": {"wlb_vs_megatron": pub.speedup,
                          "imbalance_degree": ({"baseline": pub.imbalance_baseline,
                                                "wlb": pub.imbalance_wlb}
                                               if pub.imbalance_baseline else None)},
            "difference": wlb["speedup_vs_megatron"] - pub.speedup}


def run(files: Dict[str, np.ndarray], base: SimConfig, log: Callable[[str], None],
        published: Sequence[Published] = PUBLISHED, pps: Sequence[int] = PPS,
        model: str = "llama7b", dp: int = 8) -> dict:
    """Every published configuration at every PP in ``pps``: ``{"source", "rows",
    "summary"}`` (:func:`check` gives the shape)."""
    rows = []
    for pub in published:
        for pp in pps:
            cell = Cell(model, pub.context, pp, dp, pp, "dense")
            log(f"[compare] wlb-validation {pub.name} pp{pp} dp{dp} M{pp}")
            rows.append(row(pub, cell, run_cell(cell, files, base, arms=ARMS)["arms"]))
    mean = lambda key: float(np.mean([r["sim"][key] for r in rows]))  # noqa: E731
    return {"source": SOURCE, "rows": rows,
            "summary": {"mean_wlb_vs_megatron": {"sim": mean("wlb_vs_megatron"), "published": AVERAGE},
                        "mean_wlb_vs_greedy": {"sim": mean("wlb_vs_greedy"), "published": OVER_GREEDY}}}


def check(obj: dict) -> None:
    """Raise ValueError naming the first departure from the shape :func:`run` returns."""
    if not {"source", "rows", "summary"} <= set(obj) or not obj["rows"]:
        raise ValueError(f"need source, rows (non-empty), summary; got {sorted(obj)}")
    for i, r in enumerate(obj["rows"]):
        need = {"name", "model", "context", "pp", "dp", "micro_batches", "attention", "sim",
                "published", "difference"}
        if set(r) != need:
            raise ValueError(f"rows[{i}] keys {sorted(r)}")
        s = r["sim"]
        if set(s["imbalance_degree"]) != set(ARMS) or min(s["imbalance_degree"].values()) < 1.0:
            raise ValueError(f"rows[{i}].sim.imbalance_degree must give every arm a value >= 1")
        if not s["wlb_vs_megatron"] > 0 or abs(r["difference"] - (s["wlb_vs_megatron"]
                                                                 - r["published"]["wlb_vs_megatron"])) > 1e-12:
            raise ValueError(f"rows[{i}].difference is not sim - published")
    for k, v in obj["summary"].items():
        if set(v) != {"sim", "published"}:
            raise ValueError(f"summary.{k} keys {sorted(v)}")


def markdown(res: dict) -> str:
    """validation.md: the table."""
    lines = ["# The simulator against WLB-LLM's published numbers", "",
             f"Command: `{res.get('command', '?')}`. Cost model: `{res['cost_model']}`. Published: "
             f"{res['source']}. Simulated: llama7b, dense attention, M = PP micro-batches per "
             "replica, DP 8, CP 1, length files pooled; why the numbers differ: docs/results.md, "
             "\"The simulator against WLB-LLM\".", "",
             "| context | PP | M | wlb / megatron sim | published | difference | wlb / greedy sim "
             "| imbalance degree megatron / wlb / greedy sim | published baseline / wlb "
             "| megatron / bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        s, p = r["sim"], r["published"]
        imb = p["imbalance_degree"]
        pub_imb = f"{imb['baseline']:.2f} / {imb['wlb']:.2f}" if imb else "-"
        lines.append(f"| {r['name']} | {r['pp']} | {r['micro_batches']} | {s['wlb_vs_megatron']:.3f} | "
                     f"{p['wlb_vs_megatron']:.2f} | {r['difference']:+.3f} | {s['wlb_vs_greedy']:.3f} | "
                     + " / ".join(f"{s['imbalance_degree'][a]:.2f}" for a in ARMS)
                     + f" | {pub_imb} | "
                     f"{s['megatron_vs_bound']:.2f} |")
    sm = res["summary"]
    lines += ["", f"Mean over rows: wlb / megatron {sm['mean_wlb_vs_megatron']['sim']:.3f} "
              f"(published average {sm['mean_wlb_vs_megatron']['published']:.2f}); wlb / greedy "
              f"{sm['mean_wlb_vs_greedy']['sim']:.3f} (published {sm['mean_wlb_vs_greedy']['published']:.2f}).", ""]
    return "\n".join(lines)

