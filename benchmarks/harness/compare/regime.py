"""Where balance pays: the scaling study in WLB-LLM's regime (issue 58, items 1 and 5).

The scaling study (``scaling.py``) runs 32 micro-batches per replica under top-k sparse
attention only. WLB-LLM trains with a global batch of ``PP x DP``: about ``PP``
micro-batches per replica, where one long document's micro-batch is a large share of
the step. This grid adds that axis and dense attention:

* llama7b (the layer ``h100-analytic`` was fitted on), DP 8, CP 1;
* context 64K, 128K, 160K x PP 4, 8 x micro-batches per replica M in {PP, 2 x PP, 32};
* attention ``dense`` (every block kept: k0 = context / block, so the top-k path keeps the
  whole causal mask), ``topk`` (the run's k0, default 32 of 256-token blocks) and, with a
  density study, ``threshold`` (64K and 128K at PP 4; ``density_study.py``);
* 128K PP 4 also at M = 16: the figure's x axis.

Every cell runs the arms of :data:`ARMS` on every length file; each arm reports tokens/s
pooled over the files, its speedup over megatron, WLB-LLM's imbalance degree
(``imbalance.py``: mean and max over the steps of every file) and tokens/s per step
(mean and max). One command writes ``regime.json``, ``regime.md`` and the figure::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode sim --regime --sim-models llama7b \\
        --density-study results/scaling_threshold/fixture_study.json --report results/regime
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from .cells import pooled_tokens_per_s
from .cluster_sim import MODELS, SimConfig, simulate_cell
from .scaling import stream_for

K = 1024
ARMS = ("megatron", "wlb", "sab", "sparsebalance", "dst")
"""Arms of every cell (megatron first: the reference of every ratio)."""
ATTENTION = ("dense", "topk", "threshold")
"""Attention of a cell (module docstring)."""


class Cell(NamedTuple):
    """One cluster cell of the regime grid."""

    model: str
    context: int
    pp: int
    dp: int
    micro_batches: int
    attention: str


GRID: tuple = tuple(
    [Cell("llama7b", c * K, pp, 8, m, a) for c in (64, 128, 160) for pp in (4, 8)
     for m in (pp, 2 * pp, 32) for a in ("dense", "topk")]
    + [Cell("llama7b", 128 * K, 4, 8, 16, a) for a in ("dense", "topk")])
"""Top-k and dense cells (module docstring)."""
THRESHOLD_GRID: tuple = tuple(Cell("llama7b", c * K, 4, 8, m, "threshold")
                              for c in (64, 128) for m in (4, 8, 32))
"""Threshold cells, run when a density study is given."""
QUICK_GRID: tuple = (Cell("llama7b", 128 * K, 4, 8, 4, "dense"), Cell("llama7b", 128 * K, 4, 8, 4, "topk"))
"""A two-cell smoke of the grid."""
FIGURE = dict(context=128 * K, pp=4, dp=8)
"""The figure's cells: these, every M, dense and top-k."""


def cell_config(cell: Cell, base: SimConfig) -> SimConfig:
    """``base`` at the cell's shape and attention."""
    if cell.attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {cell.attention!r}")
    if cell.attention == "threshold" and not base.density_study:
        raise ValueError("threshold cells need a density study (--density-study)")
    topk = -(-cell.context // base.block_size) if cell.attention == "dense" else base.topk
    return replace(base, pp=cell.pp, dp=cell.dp, cp=1, micro_batches=cell.micro_batches,
                   model=tuple(MODELS[cell.model].items()), topk=topk,
                   routing="threshold" if cell.attention == "threshold" else "topk")


def pooled_arms(tables: Sequence[dict]) -> Dict[str, dict]:
    """Per arm over several files' cell tables: tokens/s pooled (``cells.pooled_tokens_per_s``),
    speedup over megatron, imbalance degree (mean and max over every step) and per-step
    tokens/s (mean and max over every step), the balanced-bound ratio pooled."""
    tps = pooled_tokens_per_s(tables)
    out = {}
    for arm in tables[0]["arms"]:
        rows = [t["arms"][arm] for t in tables]
        steps = [x for r in rows for x in r["imbalance_degree_steps"]]
        ms = [r["tokens"] / r["tokens_per_ms"] for r in rows]
        n = [len(r["imbalance_degree_steps"]) for r in rows]
        out[arm] = {
            "tokens_per_s": tps[arm], "speedup_vs_megatron": tps[arm] / tps["megatron"],
            "imbalance_degree": float(np.mean(steps)), "imbalance_degree_max": float(np.max(steps)),
            "tokens_per_s_step_mean": float(np.average([r["tokens_per_s_step_mean"] for r in rows],
                                                       weights=n)),
            "tokens_per_s_step_max": float(max(r["tokens_per_s_step_max"] for r in rows)),
            "vs_lower_bound": float(sum(ms) / sum(m / r["vs_lower_bound"] for m, r in zip(ms, rows))),
        }
    return out


def run_cell(cell: Cell, files: Dict[str, np.ndarray], base: SimConfig,
             arms: Sequence[str] = ARMS) -> dict:
    """One cell on every length file: its fields, ``arms`` (:func:`pooled_arms`) and
    ``tables`` (``{file: simulate_cell table}``)."""
    cfg = cell_config(cell, base)
    need = int((cfg.steps + cfg.max_carry_steps + 2) * cell.dp * cell.micro_batches * cell.context * 1.25)
    if cfg.routing == "threshold":  # the estimator's warm-up documents come from the stream too
        need += 2 * cell.dp * cell.micro_batches * cell.context
    tables = {f: simulate_cell(stream_for(L, need, cfg.seed), cell.context, cfg, arms=arms,
                               frontier=False).table for f, L in files.items()}
    return {**cell._asdict(), "topk": cfg.topk, "arms": pooled_arms(list(tables.values())),
            "tables": tables}


def grid_for(quick: bool, density_study: Optional[str]) -> tuple:
    """The cells to run."""
    if quick:
        return QUICK_GRID
    return GRID + (THRESHOLD_GRID if density_study else ())


def run_study(grid: Sequence[Cell], files: Dict[str, np.ndarray], base: SimConfig,
              log: Callable[[str], None]) -> List[dict]:
    """:func:`run_cell` over ``grid``, in order, one at a time."""
    out = []
    for c in grid:
        log(f"[compare] regime {c.model} {c.context // K}K pp{c.pp} dp{c.dp} M{c.micro_batches} {c.attention}")
        out.append(run_cell(c, files, base))
    return out


def figure(path: str, cells: List[dict], cost_model: str, shape: Optional[dict] = None) -> None:
    """Speedup over megatron against M at ``shape`` (default :data:`FIGURE`): a row per
    length file, a column per attention (dense, top-k), a line per arm."""
    from .figures import _plt, _save

    plt = _plt()
    shape = FIGURE if shape is None else shape
    sel = [c for c in cells if all(c[k] == v for k, v in shape.items()) and c["attention"] != "threshold"]
    if not sel:
        raise ValueError(f"no cell at {shape} to plot")
    files = list(sel[0]["tables"])
    atts = [a for a in ("dense", "topk") if any(c["attention"] == a for c in sel)]
    fig, axes = plt.subplots(len(files), len(atts), figsize=(5.2 * len(atts), 3.6 * len(files)),
                             squeeze=False, sharex=True)
    for i, f in enumerate(files):
        for j, att in enumerate(atts):
            ax = axes[i][j]
            cs = sorted((c for c in sel if c["attention"] == att), key=lambda c: c["micro_batches"])
            x = [c["micro_batches"] for c in cs]
            for arm in ARMS:
                y = [c["tables"][f]["arms"][arm]["speedup_vs_megatron"] for c in cs]
                ax.plot(x, y, marker="o", label=arm, ls="-" if arm in ("sab", "sparsebalance") else "--")
            bound = [c["tables"][f]["arms"]["megatron"]["vs_lower_bound"] for c in cs]
            ax.plot(x, bound, color="grey", lw=0.8, ls=":", label="megatron / balanced bound")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(m) for m in x])
            ax.axhline(1.0, color="black", lw=0.6)
            k0 = cs[0]["topk"]
            ax.set_title(f"{f}: {'dense (every block)' if att == 'dense' else f'top-{k0} sparse'}",
                         fontsize=9)
            ax.set_xlabel("micro-batches per replica (M)")
            ax.set_ylabel("tokens/s vs megatron")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle(f"{sel[0]['model']} {shape['context'] // K}K, PP {shape['pp']}, DP {shape['dp']}; "
                 f"simulated, cost model {cost_model}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    _save(fig, path)


def table_lines(cells: List[dict]) -> List[str]:
    """The markdown table: one row per cell, speedups over megatron and imbalance degrees."""
    lines = ["| context | PP | M | attention | megatron / bound | wlb | sab | sparsebalance | dst "
             "| imbalance degree megatron / wlb / sab / sparsebalance |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        a = c["arms"]
        att = "dense" if c["attention"] == "dense" else f"{c['attention']} (k0 {c['topk']})"
        lines.append(f"| {c['context'] // K}K | {c['pp']} | {c['micro_batches']} | {att} | "
                     f"{a['megatron']['vs_lower_bound']:.2f} | "
                     + " | ".join(f"{a[n]['speedup_vs_megatron']:.3f}" for n in ARMS[1:])
                     + " | " + " / ".join(f"{a[n]['imbalance_degree']:.2f}" for n in ARMS[:4]) + " |")
    return lines


def report(res: dict) -> str:
    """regime.md: how it was run, the table, the figure."""
    cfg = res["config"]
    return "\n".join([
        "# Where balance pays (simulated)", "",
        f"Command: `{res.get('command', '?')}`. Cost model: `{res['cost_model']}`. "
        f"{cfg['steps']} steps per cell and length file ({', '.join(res['files'])}), pooled; "
        f"llama7b, DP {GRID[0].dp}, CP 1, block {cfg['block_size']}.", "",
        "Speedup = real tokens/s over megatron's (same cell, same files). `megatron / bound` = "
        "megatron's step time over the balanced bound of its own packing (every micro-batch at the "
        "step's mean per-stage time). Imbalance degree = WLB-LLM's max micro-batch latency x M / "
        "sum over a replica's micro-batches (predicted per-stage fwd+bwd; "
        "`benchmarks/harness/compare/imbalance.py`), mean over steps. Every arm keeps each micro-batch "
        "within the sequence length in tokens.", ""]
        + table_lines(res["cells"]) + ["", "![speedup vs M](regime_vs_microbatches.png)", ""])
