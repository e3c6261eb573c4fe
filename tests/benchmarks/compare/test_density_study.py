"""Threshold routing in the simulation: the study contract, how documents draw their density,
the estimator's held-out error on the synthetic study, and one tiny cell end to end."""

import json
import os

import numpy as np
import pytest

from benchmarks.harness.compare.cluster_sim import SimConfig, simulate_cell
from benchmarks.harness.compare.density_study import StudyDocs, assign, cell_content, load_study, synthetic_study
from sparsebalance.batching.sparsity_estimator import (
    LengthOnlyEstimator,
    SparsityEstimator,
    heldout_microbatch_mape,
    length_bucket,
)


def test_load_study_checks_the_contract(tmp_path):
    good = tmp_path / "s.json"
    good.write_text(json.dumps(synthetic_study(n=8)))
    assert len(load_study(str(good))["documents"]) == 8
    for bad in ({"documents": []}, {"documents": [{"source": "a", "length": 10, "density": 1.5}] * 4},
                {"documents": [{"source": 3, "length": 10, "density": 0.5}] * 4}):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            load_study(str(path))


def test_documents_draw_from_their_bucket_and_follow_the_length_trend():
    study = synthetic_study(n=200, seed=1)
    docs = StudyDocs.of(study)
    b = docs.length_exponent()
    assert -0.5 < b < -0.2  # the fixture's trend is -0.35
    L = np.array([1500, 1500, 3000, 100_000])
    got = assign(L, docs, b, seed=0)
    for i in range(3):  # within the study's range: a study document of the same bucket
        assert length_bucket(got.base_length[i]) == length_bucket(L[i])
    assert length_bucket(got.base_length[3]) == length_bucket(docs.length.max())  # nearest: longest
    np.testing.assert_allclose(got.density_at(np.arange(4), L),
                               np.clip(got.base_density * (L / got.base_length) ** b, 1e-6, 1))


def test_bucket_mean_mode_leaves_length_alone():
    docs = StudyDocs.of(synthetic_study(n=200, seed=1), "bucket-mean")
    b = np.array([length_bucket(x) for x in docs.length])
    for k in np.unique(b):
        assert np.ptp(docs.density[b == k]) < 1e-12
    assert len(np.unique(docs.density)) >= 3  # still one mean per bucket, not one overall


def test_simulated_documents_never_draw_the_warm_up_half():
    study = synthetic_study(n=60, seed=2)
    c = cell_content(study, "measured", np.full(500, 2000), warm_tokens=200_000, seed=0)
    key = lambda a: set(zip(a.source.tolist(), a.base_length.tolist(), a.base_density.tolist()))  # noqa: E731
    assert key(c.docs) and key(c.warm) and not key(c.docs) & key(c.warm)
    assert c.warm_lengths.sum() >= 200_000


def test_estimator_beats_length_only_on_the_synthetic_study():
    """Per-micro-batch attention-cost MAPE on held-out documents (the issue's measure) on the
    synthetic study (``synthetic_study``: the source spread and CV at equal length are the
    real model's, the ratio's correlation is assumed). Measured ratios to length-only,
    seeds 0-2: 0.48 / 0.56 / 0.44 with the ratio correlated (rho 0.5), 0.59 / 0.62 / 0.55
    from source and length alone (rho 0)."""
    ratios = {}
    for rho in (0.0, 0.5):
        for seed in range(3):
            docs = synthetic_study(n=400, seed=seed, rho=rho)["documents"]
            r = heldout_microbatch_mape(docs, 16384, {"full": SparsityEstimator(),
                                                      "source_length": SparsityEstimator(use_compression=False),
                                                      "length": LengthOnlyEstimator()})
            assert r["heldout_microbatches"] >= 40  # not a vacuous split
            ratios[rho, seed] = (r["full"] / r["length"], r["source_length"] / r["length"])
    for seed in range(3):
        assert ratios[0.5, seed][0] < 0.6 and ratios[0.0, seed][1] < 0.7
        assert ratios[0.5, seed][0] < ratios[0.5, seed][1]  # the ratio helps when it carries signal
        assert ratios[0.0, seed][0] < 1.05 * ratios[0.0, seed][1]  # and costs little when it does not


def test_tiny_threshold_cell(tmp_path):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(synthetic_study(n=120, seed=0)))
    rng = np.random.default_rng(0)
    L = np.clip(rng.lognormal(7.5, 1.0, 3000), 64, 16000).astype(np.int64)
    cfg = SimConfig(pp=2, dp=2, micro_batches=4, steps=3, block_size=64, topk=8, routing="threshold",
                    density_study=str(path))
    table = simulate_cell(L, 8192, cfg, arms=("megatron", "sab", "sparsebalance", "wlb"), frontier=False).table
    thr = table["threshold"]
    assert 0 < thr["density_mean"] < 1 and thr["estimator_s_per_step"] > 0
    assert table["packer_vs_instance_max_rel_err"] < 1e-6  # SAB's own prediction = its plan's instance
    topk = simulate_cell(L, 8192, SimConfig(pp=2, dp=2, micro_batches=4, steps=3, block_size=64, topk=8),
                         arms=("megatron", "sab"), frontier=False).table
    assert table["arms"]["megatron"]["density"] != topk["arms"]["megatron"]["density"]
    with pytest.raises(ValueError):
        SimConfig(routing="threshold")  # no study


def test_threshold_summary_pairs_the_two_modes():
    from benchmarks.harness.compare.threshold_summary import markdown, summarise

    def run(sab, mode):
        arms = {"megatron": 1.0, "wlb": 1.02, "sab": sab, "sparsebalance": sab}
        cell = {"model": "smollm2", "context": 32768, "pp": 5, "dp": 8, "cp": 1, "arms": arms,
                "best_baseline": "wlb", "sb_vs_best": sab / 1.02}
        th = {"estimator_microbatch_mape": 0.03, "length_bucket_oracle_microbatch_mape": 0.06,
              "estimator_share_of_step": 0.01}
        return {"cost_model": "h100-analytic", "config": {"density_study": "s.json", "density_mode": mode},
                "cells": [cell], "tables": [{"f": {"threshold": th}}], "command": mode}

    s = summarise(run(1.05, "measured"), run(1.03, "bucket-mean"))
    assert s["median_sb_vs_best"] == {"measured": pytest.approx(1.05 / 1.02), "bucket_mean": pytest.approx(1.03 / 1.02)}
    assert s["cells"][0]["measured"]["sab_vs_wlb"] == pytest.approx(1.05 / 1.02)
    assert s["cells"][0]["estimator_mape"] == 0.03 and "| smollm2 | 32K |" in markdown(s)


REAL_STUDY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "results", "real_study.json")


def test_documents_follow_their_own_measured_curve_across_tau():
    """Rule 5: at its study document's length a simulated document's density at a measured TAU
    is that document's measured one; between and beyond, it is monotone in TAU."""
    study = load_study(REAL_STUDY)
    docs = StudyDocs.of(study)
    assert docs.taus == (0.8, 0.9, 0.95) and docs.at_taus.shape == (len(study["documents"]), 3)
    got = assign(docs.length, docs, docs.length_exponent(), seed=0)
    ids = np.arange(docs.length.size)
    for j, tau in enumerate(docs.taus):
        np.testing.assert_allclose(got.density_at(ids, got.base_length, tau), docs.at_taus[got.study_doc, j])
    grid = np.stack([got.density_at(ids, 4 * got.base_length, t) for t in np.arange(0.7, 0.99, 0.01)])
    assert np.all(np.diff(grid, axis=0) >= 0)
    one_tau = StudyDocs.of(synthetic_study(n=20, seed=0))
    assert one_tau.at_taus is None and one_tau.own_curves() is None  # the measured relation stands in


def test_tiny_threshold_cell_plans_tau_levels(tmp_path):
    """The DST arms of a threshold cell plan TAU levels (not caps): at attention slack 0 the
    critical-path plan moves TAUs (retained attention differs from static's) and, planned on the
    estimator's densities, is timed on the true ones."""
    rng = np.random.default_rng(0)
    L = np.clip(rng.lognormal(7.5, 1.0, 3000), 64, 16000).astype(np.int64)
    cfg = SimConfig(pp=2, dp=2, micro_batches=2, steps=2, block_size=64, topk=64, routing="threshold",
                    density_study=REAL_STUDY)
    arms = simulate_cell(L, 8192, cfg, arms=("megatron", "dst", "sab", "sparsebalance"), frontier=False).table["arms"]
    assert arms["megatron"]["retained_vs_static"] == 1.0
    assert arms["dst"]["retained_vs_static"] != 1.0 and arms["sparsebalance"]["retained_vs_static"] != 1.0
    with pytest.raises(ValueError, match="strictly increasing"):
        SimConfig(routing="threshold", density_study=REAL_STUDY, taus=(0.9, 0.8))
