"""The Markdown report states each target as met or missed, with the numbers."""

import numpy as np
import pytest

from benchmarks.harness.compare.cluster_sim import SimConfig, simulate_cell
from benchmarks.harness.compare.real import RunResult, pool
from benchmarks.harness.compare.report_md import build_report

SMALL = (("num_layers", 4), ("hidden_size", 256), ("num_attention_heads", 4),
         ("num_query_groups", 4), ("ffn_hidden_size", 1024), ("vocab_size", 1000))


def _summary(step, tps, pred, density):
    return {"step_ms_all": [9.0, 9.0] + [step] * 20, "warmup_steps_skipped": 2,
            "tokens_per_s": tps, "loss_first": 5.0, "loss_last": 3.0, "density_mean": density,
            "imbalance_mean": 1.2, "bubble_fraction": [0.1, 0.3],
            "predicted_step_ms_median": pred, "plan_ms_median": 1.0, "pack_ms_median": 1.0}


@pytest.fixture(scope="module")
def sim():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.5, 1.0, 3000), 16, 6000).astype(np.int64)
    cfg = SimConfig(pp=2, dp=2, micro_batches=4, steps=1, block_size=64, topk=8, model=SMALL)
    cell = simulate_cell(lengths, 4096, cfg).table
    return {"config": dict(cfg.__dict__), "primary_model": "small", "seconds": 1.0,
            "models": {"small": {"shape": dict(SMALL), "cells": {"syn": {"4096": cell}}}}}


def _real(sb_tps, sb_pred):
    arms = {"megatron": pool([RunResult("megatron", 0, "c", 0, 1.0,
                                        _summary(100.0, 1000.0, 104.0, 0.60))]),
            "sparsebalance": pool([RunResult("sparsebalance", 0, "c", 0, 1.0,
                                             _summary(90.0, sb_tps, sb_pred, 0.61))])}
    return {"arms": arms, "order": ["megatron#0", "sparsebalance#0"], "runs": [],
            "failed": {}, "baseline_drift": 0.01,
            "config": {"num_layers": 2, "layers_per_stage": 1, "hidden_size": 64,
                       "num_attention_heads": 2, "ffn_hidden_size": 256, "ranks": 2,
                       "micro_batches": 8, "recipe": {"seq_length": 8192}, "iters": 22,
                       "threads": 1, "backend": "cpu", "seed": 1, "rounds": 1},
            "prep": {"recipe_lines": ["- recipe"], "commands": {}}}


@pytest.mark.parametrize("sb_tps,sb_pred,met", [(1300.0, 92.0, True), (1050.0, 60.0, False)])
def test_real_targets(sim, sb_tps, sb_pred, met):
    text = build_report(_real(sb_tps, sb_pred), sim, {}, ["header"], ["note"])
    line = next(ln for ln in text.splitlines() if ln.startswith("- real CPU"))
    assert f"{sb_tps / 1000:.3f}x" in line
    assert ("**met**" in line) == met
    val = next(ln for ln in text.splitlines() if ln.startswith("- validation"))
    assert ("**met**" in val) == met  # 92 vs 90 ms is 2%; 60 vs 90 is -33%
    if not met:
        assert "why:" in text and "-33.3%" in val
    assert "## Simulated cluster" in text and "| megatron |" in text


def test_sim_targets_name_every_cell(sim):
    text = build_report(None, sim, {}, [], [])
    lines = [ln for ln in text.splitlines() if ln.startswith("- sim ")]
    assert len(lines) == 1 and "syn 4K" in lines[0] and "frontier" in lines[0]
