"""The --mode sim --json shape: classification of arms, pooling, consistency checks."""

import copy

import pytest

from benchmarks.harness.compare.cells import check_cells, is_baseline, make_cell, pooled_tokens_per_s

ARMS = {"megatron": 100.0, "dp-balanced": 101.0, "wlb": 104.0, "dynamic-cp": 103.0,
        "sab": 120.0, "dst": 119.0, "sparsebalance": 108.0, "sparsebalance-anchor": 106.0,
        "sparsebalance+dcp": 109.0}


def test_baselines_are_the_peers_not_sparsebalance_or_its_parts():
    assert [a for a in ARMS if is_baseline(a)] == ["megatron", "dp-balanced", "wlb", "dynamic-cp"]


def test_make_cell_picks_best_baseline_and_best_full_method():
    c = make_cell("qwen3b", 131072, 4, 8, 1, ARMS)
    # sab (120) and dst are parts: neither the numerator nor the baseline.
    assert c["best_baseline"] == "wlb" and c["sb_vs_best"] == pytest.approx(109.0 / 104.0)
    check_cells({"cost_model": "h100-analytic", "cells": [c]})


@pytest.mark.parametrize("tamper, msg", [
    (lambda o: o["cells"][0].update(best_baseline="megatron"), "best_baseline"),
    (lambda o: o["cells"][0].update(sb_vs_best=1.2), "sb_vs_best"),
    (lambda o: o["cells"][0].update(context=0), "context"),
    (lambda o: o["cells"][0].update(cp=2.0), "cp"),
    (lambda o: o["cells"][0]["arms"].update(wlb=-1.0), "arms"),
    (lambda o: o["cells"][0].pop("dp"), "keys"),
    (lambda o: o.update(extra=1), "keys"),
    (lambda o: o.update(cost_model=None), "cost_model"),
])
def test_check_cells_rejects_inconsistent_rows(tamper, msg):
    good = {"cost_model": "h100-analytic", "cells": [make_cell("qwen3b", 131072, 4, 8, 1, ARMS)]}
    bad = copy.deepcopy(good)
    tamper(bad)
    with pytest.raises(ValueError, match=msg):
        check_cells(bad)


def test_make_cell_needs_both_sides():
    with pytest.raises(ValueError, match="baseline"):
        make_cell("m", 1, 1, 1, 1, {"sab": 1.0, "sparsebalance": 2.0})


def test_pooling_is_total_tokens_over_total_time():
    t1 = {"arms": {"a": {"tokens": 1000, "tokens_per_ms": 10.0}}}   # 100 ms
    t2 = {"arms": {"a": {"tokens": 3000, "tokens_per_ms": 1.0}}}    # 3000 ms
    assert pooled_tokens_per_s([t1, t2])["a"] == pytest.approx(1e3 * 4000 / 3100)
