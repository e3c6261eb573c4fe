"""Scaling study: the grid, resampled streams, one tiny cell end to end, figures, report."""

import numpy as np
import pytest

from benchmarks.harness.compare.cells import check_cells, make_cell
from benchmarks.harness.compare.cluster_sim import MODELS, SimConfig
from benchmarks.harness.compare.figures import scaling_heatmap, scaling_lines
from benchmarks.harness.compare.report_md import scaling_report
from benchmarks.harness.compare.scaling import GRID, run_cell, stream_for


def test_grid_covers_the_issue_ranges_and_layer_splits():
    assert {c[1] for c in GRID} == {32768, 65536, 131072, 262144}
    assert {c[0] for c in GRID} == {"qwen05b", "qwen3b", "llama7b", "smollm2"}
    assert min(c[2] for c in GRID) == 4 and max(c[2] for c in GRID) == 16
    assert min(c[3] for c in GRID) == 8 and max(c[3] for c in GRID) == 64
    assert {c[4] for c in GRID} == {1, 2, 4}
    for model, _, pp, _, _ in GRID:  # every stage holds whole layers
        layers = MODELS[model].get("num_layers", 24)
        assert layers % pp == 0, (model, pp)


def test_stream_for_resamples_the_file():
    L = np.array([5, 7, 11])
    assert stream_for(L, 20, 0) is L
    s = stream_for(L, 100, 0)
    assert s.sum() >= 100 and sorted(set(s.tolist())) == [5, 7, 11]
    assert np.array_equal(s, stream_for(L, 100, 0))  # seeded


def test_tiny_cell_end_to_end():
    rng = np.random.default_rng(0)
    files = {"a": np.clip(rng.lognormal(8.0, 1.0, 500), 16, 16000).astype(np.int64)}
    r = run_cell(("qwen05b", 16384, 2, 1, 2), files,
                 SimConfig(steps=1, block_size=64, topk=8))
    c = r["cell"]
    check_cells({"cost_model": "h100-analytic", "cells": [c]})
    assert (c["model"], c["context"], c["pp"], c["dp"], c["cp"]) == ("qwen05b", 16384, 2, 1, 2)
    assert {"megatron", "dp-balanced", "wlb", "dynamic-cp", "sparsebalance+dcp"} <= set(c["arms"])
    # 32 micro-batches per replica: run_cell resamples the file when it is too short
    assert r["tables"]["a"]["arms"]["megatron"]["tokens"] > 0


def _cells():
    out = []
    for m, f in (("qwen05b", 1.0), ("qwen3b", 1.02)):
        for ctx in (32768, 131072):
            out.append(make_cell(m, ctx, 4, 8, 1, {"megatron": 100.0, "wlb": 103.0,
                                                   "sparsebalance": 104.0 * f}))
    out.append(make_cell("qwen3b", 131072, 4, 8, 2, {"megatron": 100.0, "dynamic-cp": 110.0,
                                                     "sparsebalance+dcp": 108.0}))
    return out


def test_figures_and_report(tmp_path):
    cells = _cells()
    scaling_heatmap(str(tmp_path / "h.png"), cells, "h100-analytic")
    scaling_lines(str(tmp_path / "l.png"), cells, "h100-analytic")
    assert (tmp_path / "h.png").stat().st_size > 0 and (tmp_path / "l.png").stat().st_size > 0
    md = scaling_report({"cells": cells, "cost_model": "h100-analytic", "command": "x",
                         "config": {"steps": 1, "topk": 32}})
    med = float(np.median([c["sb_vs_best"] for c in cells]))
    assert f"median cell: {med:.3f}x" in md and "**missed**" in md
    # the 3B-at-128K line compares the best SparseBalance arm with megatron
    assert "qwen3b 128K PP 4 DP 8 CP 2: 1.080x megatron" in md
    assert md.count("| qwen3b |") == 3


def test_make_cell_rejects_missing_sides():
    with pytest.raises(ValueError):
        make_cell("m", 1, 1, 1, 1, {"megatron": 1.0})
