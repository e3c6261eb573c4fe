"""DST under op-time noise: the expected noisy step and the study's accounting."""

import numpy as np
import pytest

from benchmarks.harness.compare.cluster_sim import SimConfig
from benchmarks.harness.compare.noise_study import expected_step_ms, main, study
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning.from_predictor import build_instance


def _inst():
    pred = get_predictor("h100-analytic", block_size=256, topk=32)
    # Equal replicas: noise on any of them shows in the step (a max over replicas).
    nested = [[[8000, 8000]] * 8] * 8  # the step waits for the slowest of 8 replicas
    return build_instance(pred, nested, pp=2, k0=32)


def test_noise_lengthens_the_expected_step():
    inst = _inst()
    k0 = np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index)
    rng = np.random.default_rng(0)
    clean = expected_step_ms(inst, k0, 0.0, 5, rng)
    f, b, _ = inst.at(k0)
    from sparsebalance.pipeline import simulate
    assert clean == pytest.approx(simulate(f, b).step_ms)
    # A step is a max over paths: mean-1 noise on every op makes it longer on average.
    noisy = [expected_step_ms(inst, k0, s, 300, rng) for s in (0.05, 0.3)]
    assert clean < noisy[0] < noisy[1]


def test_study_reports_each_sigma(tmp_path):
    rng = np.random.default_rng(1)
    L = np.clip(rng.lognormal(8.5, 1.0, 4000), 64, 16384).astype(np.int64)
    cfg = SimConfig(pp=2, dp=1, micro_batches=4, steps=2)
    res = study(L, 16384, cfg, [0.0, 0.1], draws=4)
    assert set(res) == {"0", "0.1"}
    for r in res.values():
        assert r["dst_vs_static"] > 0 and 0 <= r["aware_chose_dst"] <= 1
    # Noiseless, the choice is exact: never worse than either plan.
    r0 = res["0"]
    assert r0["aware_vs_static"] >= max(1.0, r0["dst_vs_static"]) - 1e-12


@pytest.mark.parametrize("args", [["--sigmas", "-1"], ["--steps", "0"],
                                  ["--cpu-profile", "/nonexistent.json"],
                                  ["--lengths", "/nonexistent.json"]])
def test_bad_input_exit_2(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]
