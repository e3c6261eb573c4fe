"""Scaling study: every simulated arm over context, model, PP, DP and CP.

Not the full cartesian product (that is hours on one core): a star around one base
cluster per axis, each cell a full ``cluster_sim.simulate_cell`` on every length file.

* context sweep: 32K, 64K, 128K, 256K x {qwen05b, qwen3b, llama7b} at PP 4, DP 8, CP 1;
* PP sweep at 128K, DP 8, CP 1: PP 8 and 16 (llama7b, 32 layers), PP 8 (qwen05b, 24
  layers), PP 12 (qwen3b: 36 layers divide by 4, 6, 9, 12, not by 8 or 16);
* DP sweep at 128K, PP 4, CP 1 (qwen3b): DP 16, 32, 64;
* CP sweep at PP 4, DP 8: CP 2 and 4 for qwen3b at 128K and llama7b at 256K;
* the real model of issue 49 (SmolLM2-135M's shape, 30 layers): 32K, 64K, 128K at PP 5
  (30 layers do not divide by 4), DP 8, CP 1.

Micro-batches per replica per step: 32 (>= every PP). A cell's step holds
``dp x 32 x context`` tokens, more than a length file has at DP 64, so each file's
lengths are resampled into a long enough stream (:func:`stream_for`: seeded
permutations of the file concatenated; the length distribution is the file's).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from .cells import is_baseline, make_cell, pooled_tokens_per_s
from .cluster_sim import MODELS, SimConfig, simulate_cell

Cell = Tuple[str, int, int, int, int]
"""(model, context tokens, pp, dp, cp)."""

K = 1024
GRID: Tuple[Cell, ...] = tuple(
    [(m, c * K, 4, 8, 1) for m in ("qwen05b", "qwen3b", "llama7b") for c in (32, 64, 128, 256)]
    + [("qwen05b", 128 * K, 8, 8, 1), ("qwen3b", 128 * K, 12, 8, 1),
       ("llama7b", 128 * K, 8, 8, 1), ("llama7b", 128 * K, 16, 8, 1)]
    + [("qwen3b", 128 * K, 4, d, 1) for d in (16, 32, 64)]
    + [("qwen3b", 128 * K, 4, 8, c) for c in (2, 4)] + [("llama7b", 256 * K, 4, 8, c) for c in (2, 4)]
    + [("smollm2", c * K, 5, 8, 1) for c in (32, 64, 128)])
"""The cells of the study (module docstring)."""
QUICK_GRID: Tuple[Cell, ...] = (("qwen05b", 32 * K, 4, 8, 1), ("qwen3b", 128 * K, 4, 8, 1),
                                ("qwen3b", 128 * K, 4, 8, 2))
"""A three-cell smoke of the study."""
MICRO_BATCHES = 32
"""Micro-batches per replica per step in every cell."""


def stream_for(lengths: np.ndarray, tokens: int, seed: int) -> np.ndarray:
    """``lengths`` resampled to at least ``tokens`` tokens: seeded permutations of the
    file, concatenated (the file itself when it is long enough)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.sum() >= tokens:
        return lengths
    rng = np.random.default_rng(seed)
    reps = int(np.ceil(tokens / lengths.sum()))
    return np.concatenate([lengths] + [rng.permutation(lengths) for _ in range(reps)])


def run_cell(cell: Cell, files: Dict[str, np.ndarray], base: SimConfig) -> dict:
    """Simulate one cell on every length file: ``{"cell": row of cells.make_cell,
    "tables": {file: simulate_cell table}}``."""
    model, context, pp, dp, cp = cell
    cfg = replace(base, pp=pp, dp=dp, cp=cp, micro_batches=MICRO_BATCHES,
                  model=tuple(MODELS[model].items()))
    # Room for the steps plus the carry queue and the chunks of long documents.
    need = int((cfg.steps + cfg.max_carry_steps + 2) * dp * MICRO_BATCHES * context * 1.25)
    tables = {f: simulate_cell(stream_for(L, need, cfg.seed), context, cfg, frontier=False).table
              for f, L in files.items()}
    row = make_cell(model, context, pp, dp, cp, pooled_tokens_per_s(tables.values()))
    return {"cell": row, "tables": tables}


def run_study(grid: Sequence[Cell], files: Dict[str, np.ndarray], base: SimConfig,
              log: Callable[[str], None]) -> List[dict]:
    """:func:`run_cell` over ``grid``, in order."""
    out = []
    for cell in grid:
        log(f"[compare] scaling {cell[0]} {cell[1] // K}K pp{cell[2]} dp{cell[3]} cp{cell[4]}")
        out.append(run_cell(cell, files, base))
    return out


def summary_lines(cells: List[dict]) -> List[str]:
    """Median and spread of sb_vs_best, and the 3B-at-128K gain over Megatron."""
    g = np.array([c["sb_vs_best"] for c in cells])
    lines = [f"sb_vs_best over {len(cells)} cells: median {np.median(g):.3f}x, "
             f"min {g.min():.3f}x, max {g.max():.3f}x"]
    for c in cells:
        if c["model"] == "qwen3b" and c["context"] == 128 * K and "megatron" in c["arms"]:
            sb = max(v for a, v in c["arms"].items() if not is_baseline(a)
                     and a.startswith("sparsebalance"))
            lines.append(f"qwen3b 128K pp{c['pp']} dp{c['dp']} cp{c['cp']}: best SparseBalance "
                         f"{sb / c['arms']['megatron']:.3f}x megatron")
    return lines
