"""PNG figures of the report (matplotlib, Agg; every file written atomically)."""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, Optional

import numpy as np

from sparsebalance.io import atomic_path

from .report_md import STRETCH_SPEEDUP, TARGET_REAL_SPEEDUP


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> None:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    _plt().close(fig)


def speedup_bars(path: str, real: Optional[Dict[str, float]], sim: Optional[dict]) -> None:
    """Throughput speedup over megatron per arm: real runs and every simulated cell."""
    plt = _plt()
    panels = ([("real CPU runs (measured)", {"": real})] if real else [])
    if sim:
        cells = {f"{f} {int(s) // 1024}K": {a: r["speedup_vs_megatron"]
                                             for a, r in c["arms"].items()}
                 for f, by in sim.items() for s, c in by.items()}
        panels.append(("simulated cluster (predicted)", cells))
    if not panels:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (title, groups) in zip(axes[0], panels):
        arms = list(next(iter(groups.values())))
        w = 0.8 / len(groups)
        for g, (label, vals) in enumerate(groups.items()):
            x = np.arange(len(arms)) + g * w
            ax.bar(x, [vals.get(a, np.nan) for a in arms], w, label=label or None)
        ax.axhline(1.0, color="black", lw=0.8)
        target = TARGET_REAL_SPEEDUP if title.startswith("real") else STRETCH_SPEEDUP
        ax.axhline(target, color="red", lw=0.8, ls="--", label=f"target {target}x")
        ax.set_xticks(np.arange(len(arms)) + 0.4 - w / 2, arms, rotation=30, ha="right")
        ax.set_ylabel("throughput / megatron's")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)


def frontier(path: str, sim: dict, real_points: Optional[Dict[str, dict]] = None) -> None:
    """Throughput (vs megatron) against retained attention (vs static k0 on the same
    packing), anchor rule and critical-path planner, one panel per simulated cell."""
    plt = _plt()
    cells = [(f"{f} {int(s) // 1024}K", c) for f, by in sim.items() for s, c in by.items()
             if "frontier" in c]
    n = len(cells) + (1 if real_points else 0)
    if n == 0:
        raise ValueError("no frontier to plot")
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4), squeeze=False)
    for ax, (title, c) in zip(axes[0], cells):
        _frontier_panel(ax, c["frontier"], {a: c["arms"][a] for a in ("megatron", "sab")
                                            if a in c["arms"]})
        ax.set_title(title, fontsize=9)
    if real_points:
        _frontier_panel(axes[0][-1], real_points, {})
        axes[0][-1].set_title("real CPU runs", fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def _frontier_panel(ax, pts: Dict[str, dict], refs: Dict[str, dict]) -> None:
    for fam, color, marker in (("anchor", "tab:orange", "s"), ("critical-path", "tab:blue", "o")):
        rows = sorted((p for p in pts.values() if p["family"] == fam), key=lambda p: p["param"])
        if not rows:
            continue
        x = [p["retained_vs_static"] for p in rows]
        y = [p["speedup_vs_megatron"] for p in rows]
        ax.plot(x, y, marker=marker, color=color,
                label="anchor (p)" if fam == "anchor" else "critical-path (eps)")
        for p, xi, yi in zip(rows, x, y):
            ax.annotate(f"{p['param']:g}", (xi, yi), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    for name, r in refs.items():
        ax.scatter([r["retained_vs_static"]], [r["speedup_vs_megatron"]], color="gray",
                   marker="x")
        ax.annotate(name, (r["retained_vs_static"], r["speedup_vs_megatron"]), fontsize=6)
    ax.set_xlabel("retained attention / static k0")
    ax.set_ylabel("throughput / megatron's")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def validation_scatter(path: str, arms: Dict[str, dict]) -> None:
    """Predicted vs measured median step time per real arm, with the +-10% band."""
    plt = _plt()
    pts = {a: r for a, r in arms.items() if r.get("predicted_step_ms") is not None}
    if not pts:
        raise ValueError("no predicted step times")
    fig, ax = plt.subplots(figsize=(5, 4.5))
    m = np.array([r["step_ms"] for r in pts.values()])
    p = np.array([r["predicted_step_ms"] for r in pts.values()])
    lo, hi = 0.8 * min(m.min(), p.min()), 1.2 * max(m.max(), p.max())
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="black", lw=0.8)
    ax.fill_between(xs, 0.9 * xs, 1.1 * xs, color="gray", alpha=0.2, label="+-10%")
    ax.scatter(m, p)
    for a, mi, pi in zip(pts, m, p):
        ax.annotate(a, (mi, pi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured median step, ms")
    ax.set_ylabel("predicted median step, ms")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)


def last_timeline(directory: str, kind: str = "measured") -> Optional[dict]:
    """The last ``step_*.<kind>.json`` the driver wrote in ``directory`` (or None)."""
    files = sorted(glob.glob(os.path.join(directory, f"step_*.{kind}.json")))
    if not files:
        return None
    with open(files[-1]) as fh:
        doc = json.load(fh)
    doc["file"] = files[-1]
    return doc


def _sweep(cells: list) -> tuple:
    """The context-sweep cells (the most common (pp, dp, cp)) and the others."""
    from collections import Counter

    base = Counter((c["pp"], c["dp"], c["cp"]) for c in cells).most_common(1)[0][0]
    sweep = [c for c in cells if (c["pp"], c["dp"], c["cp"]) == base]
    return base, sweep, [c for c in cells if c not in sweep]


def scaling_heatmap(path: str, cells: list, cost_model: str) -> None:
    """sb_vs_best per cell: a model x context heatmap of the context sweep, and bars
    for the PP / DP / CP cells."""
    plt = _plt()
    (pp, dp, cp), sweep, rest = _sweep(cells)
    models = sorted({c["model"] for c in sweep})
    ctx = sorted({c["context"] for c in sweep})
    grid = np.full((len(models), len(ctx)), np.nan)
    for c in sweep:
        grid[models.index(c["model"]), ctx.index(c["context"])] = c["sb_vs_best"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    ax = axes[0]
    lim = max(abs(np.nanmax(grid) - 1), abs(1 - np.nanmin(grid)), 0.05)
    im = ax.imshow(grid, cmap="RdBu", vmin=1 - lim, vmax=1 + lim)
    for i in range(len(models)):
        for j in range(len(ctx)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.3f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(ctx)), [f"{c // 1024}K" for c in ctx])
    ax.set_yticks(range(len(models)), models)
    ax.set_title(f"best SparseBalance / best baseline\n(PP {pp}, DP {dp}, CP {cp})")
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax = axes[1]
    labels = [f"{c['model']} {c['context'] // 1024}K\npp{c['pp']} dp{c['dp']} cp{c['cp']}"
              for c in rest]
    vals = [c["sb_vs_best"] for c in rest]
    ax.bar(range(len(rest)), vals, color=["tab:blue" if v >= 1 else "tab:red" for v in vals])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.05, color="red", lw=0.8, ls="--", label="target 1.05x")
    ax.set_xticks(range(len(rest)), labels, fontsize=7, rotation=60, ha="right")
    ax.set_ylim(min(vals + [1.0]) - 0.05, max(vals + [1.05]) + 0.05)
    ax.set_title("other PP / DP / CP cells")
    ax.legend(fontsize=8)
    fig.suptitle(f"simulated, cost model {cost_model}", fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def scaling_lines(path: str, cells: list, cost_model: str) -> None:
    """Every arm's tokens/s over megatron's vs context, one panel per model (context sweep)."""
    plt = _plt()
    (pp, dp, cp), sweep, _ = _sweep(cells)
    models = sorted({c["model"] for c in sweep})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        cs = sorted((c for c in sweep if c["model"] == m), key=lambda c: c["context"])
        for arm in cs[0]["arms"]:
            y = [c["arms"][arm] / c["arms"]["megatron"] for c in cs]
            ax.plot([c["context"] // 1024 for c in cs], y, marker="o", label=arm,
                    ls="-" if arm.startswith("sparsebalance") else "--")
        ax.set_xscale("log", base=2)
        ax.set_xticks([c["context"] // 1024 for c in cs], [f"{c['context'] // 1024}K" for c in cs])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{m} (PP {pp}, DP {dp}, CP {cp})")
        ax.set_xlabel("context")
        ax.set_ylabel("tokens/s vs megatron")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle(f"simulated, cost model {cost_model} (at CP 1 sparsebalance+dcp = "
                 "sparsebalance)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    _save(fig, path)


def real_gantt(d: str, arms: dict, tl: dict, figs: dict) -> Optional[dict]:
    """Gantt and Chrome trace of each arm's last step, time in ms per 1,000 real tokens:
    the arms pack different token counts per step, so equal tokens put the picture on
    the table's footing (shorter = higher throughput). Returns each arm's replayed step
    in ms per 1,000 tokens (None when an arm's tokens are unknown)."""
    from sparsebalance.pipeline import simulate
    from sparsebalance.pipeline.trace import write_chrome_trace, write_gantt

    from .timelines import step_tokens

    results, per_ktok = {}, {}
    for n, t in tl.items():
        mean_tok = arms[n]["tokens_per_s"] * arms[n]["step_ms"] / 1e3 if n in arms else 0.0
        tokens, src = step_tokens(t, mean_tok)
        if tokens <= 0:
            return None
        scale = 1e3 / tokens
        res = simulate(np.asarray(t["fwd_ms"]) * scale, np.asarray(t["bwd_ms"]) * scale)
        results[f"{n} ({tokens:.0f} tokens{'' if src == 'step' else ', arm mean'})"] = res
        per_ktok[n] = res.step_ms
    picture = per_ktok["megatron"] / per_ktok["sparsebalance"]
    table = (arms["sparsebalance"]["tokens_per_s"] / arms["megatron"]["tokens_per_s"]
             if "megatron" in arms and "sparsebalance" in arms else float("nan"))
    write_gantt(os.path.join(d, "real_gantt.png"), results, unit="ms per 1,000 tokens",
                title=f"last step, measured op times replayed in megatron's 1F1B order, per "
                      f"1,000 tokens\nsparsebalance {picture:.3f}x megatron's throughput in "
                      f"this step ({table:.3f}x over all measured steps)")
    figs["real_gantt"] = "real_gantt.png"
    write_chrome_trace(os.path.join(d, "real_trace.json"), results)
    figs["real_trace"] = "real_trace.json"
    return per_ktok
