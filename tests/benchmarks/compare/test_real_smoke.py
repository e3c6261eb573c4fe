"""The demo's path end to end at a tiny size: corpus, profile, megatron and sparsebalance
under torchrun (PP=2, gloo) in two interleaved rounds, the ratio table, Gantt and trace.

Timing is not asserted (a smoke run on a shared machine); what must hold is that every
run finished, the ratios and intervals are computed per round, DST's budgets kept at
least the static plan's attention on the same documents, and the pictures exist.
"""

import importlib.util
import os

import pytest

from benchmarks.harness.compare.campaign import prepare, run_arms
from benchmarks.harness.compare.corpus import CorpusRecipe
from benchmarks.harness.compare.real import RealConfig
from benchmarks.harness.compare.report_md import real_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LENGTHS_DIR = os.path.join(REPO, "data", "lengths")


def _compare_tool():
    spec = importlib.util.spec_from_file_location("compare_tool",
                                                  os.path.join(REPO, "benchmarks", "compare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_arms_two_rounds(tmp_path):
    recipe = CorpusRecipe(num_docs=120, seq_length=1024, block_size=32, topk=6)
    cfg = RealConfig(recipe=recipe, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                     micro_batches=2, iters=5, rounds=2, timeout_s=300)
    logs = []
    prep = prepare(REPO, LENGTHS_DIR, cfg, str(tmp_path), logs.append, kinds=("sparse",))
    assert "profile_dense" not in prep  # no dense arm, no dense profile
    res = run_arms(REPO, cfg, ["megatron", "sparsebalance"], str(tmp_path), prep, logs.append)
    assert not res["failed"], res["failed"]
    assert res["order"] == ["megatron#0", "sparsebalance#0", "sparsebalance#1", "megatron#1"]
    sb = res["ratios_vs_megatron"]["sparsebalance"]
    assert len(sb["per_round"]) == 2 and sb["ci95"][0] <= sb["median"] <= sb["ci95"][1]
    arms = res["arms"]
    assert arms["megatron"]["retained_vs_static"] == pytest.approx(1.0)
    assert arms["sparsebalance"]["retained_vs_static"] >= 1.0 - 1e-9
    assert arms["sparsebalance"]["plan_wait_ms"] is not None
    res["config"] = cfg.as_dict()
    text = "\n".join(real_table(res))
    assert "| megatron |" in text and "| sparsebalance |" in text and "[" in text
    figs = {}
    _compare_tool()._real_figures(str(tmp_path), res, figs)
    for key in ("real_gantt", "real_trace"):
        assert os.path.getsize(os.path.join(tmp_path, figs[key])) > 0
