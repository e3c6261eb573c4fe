"""Timeline statistics: replaying measured op times and comparing to the predicted ones."""

import json

import numpy as np
import pytest

from benchmarks.harness.compare.timelines import noise_penalty, paired_ops, timeline_stats
from sparsebalance.pipeline import simulate


def _write(d, it, kind, f, b):
    doc = {"schedule": "1f1b", "vpp": 1, "p2p_ms": 0.0, "fwd_ms": f.tolist(), "bwd_ms": b.tolist()}
    (d / f"step_{it:07d}.{kind}.json").write_text(json.dumps(doc))


def test_replay_and_op_sum(tmp_path):
    rng = np.random.default_rng(0)
    meas = []
    for it in range(1, 6):
        f, b = rng.uniform(5, 10, (1, 4, 2)), rng.uniform(10, 20, (1, 4, 2))
        _write(tmp_path, it, "measured", f, b)
        _write(tmp_path, it, "predicted", 1.1 * f, 1.1 * b)  # predictions 10% high
        meas.append(simulate(f, b).step_ms)
    s = timeline_stats(str(tmp_path), skip=2)
    assert s["steps"] == 3
    assert s["replayed_ms"] == pytest.approx(float(np.median(meas[2:])))
    # Scaling every op by 1.1 scales the whole schedule by 1.1.
    assert s["predicted_ops_ms"] == pytest.approx(1.1 * s["replayed_ms"])
    assert s["op_sum_predicted_ms"] / s["op_sum_measured_ms"] == pytest.approx(1.1)


def test_no_files(tmp_path):
    assert timeline_stats(str(tmp_path), 0) is None


def test_paired_ops_groups_by_budget(tmp_path):
    """A DST run vs the static run on the same packing: cut ops 20% faster, raised ones
    50% slower, ops at k0 identical; predictions 10% high in the DST run."""
    dst, ref = tmp_path / "dst", tmp_path / "ref"
    dst.mkdir(), ref.mkdir()
    budget = np.array([[[2, 4], [8, 4], [4, 2]]])  # k0 = 4: two cut, three same, one raised
    speed = np.where(budget < 4, 0.8, np.where(budget > 4, 1.5, 1.0))
    for it in (1, 2, 3):
        f, b = np.full((1, 3, 2), 10.0 * it), np.full((1, 3, 2), 20.0 * it)
        _write(ref, it, "measured", f, b)
        _write(ref, it, "predicted", f, b)
        _write(dst, it, "measured", f * speed, b * speed)
        _write(dst, it, "predicted", 1.1 * f * speed, 1.1 * b * speed)
        doc = json.loads((dst / f"step_{it:07d}.predicted.json").read_text())
        (dst / f"step_{it:07d}.predicted.json").write_text(json.dumps(dict(doc, budget=budget.tolist())))
    got = paired_ops(str(dst), str(ref), k0=4, skip=1)
    assert got["cut"]["ops"] == 2 * 2 * 2 and got["same"]["ops"] == 3 * 2 * 2
    assert got["raised"]["ops"] == 1 * 2 * 2
    for key, want in (("cut", 0.8), ("same", 1.0), ("raised", 1.5)):
        assert got[key]["measured_ratio"] == pytest.approx(want)
        assert got[key]["predicted_ratio"] == pytest.approx(1.1 * want)
    # Without budgets in the DST run's timeline (DST off) there is nothing to compare.
    assert paired_ops(str(ref), str(ref), k0=4, skip=0) is None


def _noisy_run(d, stage1_ms, factors):
    """Four steps of a PP=2, M=4 plan whose measured op times are the predicted ones
    times ``factors`` (cycled): the same scatter for every plan."""
    d.mkdir()
    for it in range(1, 5):
        f = np.array([[[10.0, stage1_ms]] * 4])
        b = 2 * f
        k = np.resize(np.roll(factors, it), f.size).reshape(f.shape)
        _write(d, it, "predicted", f, b)
        _write(d, it, "measured", f * k, b * k[:, ::-1])


def test_noise_penalty_grows_when_the_plan_has_no_slack(tmp_path):
    factors = np.array([0.8, 1.25, 1.0, 0.9, 1.1, 1.0, 1.3, 0.85])
    _noisy_run(tmp_path / "balanced", 10.0, factors)  # both stages equal: no slack
    _noisy_run(tmp_path / "slack", 5.0, factors)  # stage 1 idles half the time
    _noisy_run(tmp_path / "exact", 10.0, np.ones(8))
    bal = noise_penalty(str(tmp_path / "balanced"), skip=0)
    slack = noise_penalty(str(tmp_path / "slack"), skip=0)
    assert bal["steps"] == 4 and bal["op_scatter"] == pytest.approx(slack["op_scatter"])
    assert bal["op_scatter"] > 0.1
    assert bal["penalty"] > slack["penalty"] + 0.02 and slack["penalty"] >= 0.0
    exact = noise_penalty(str(tmp_path / "exact"), skip=0)
    assert exact["op_scatter"] == 0.0 and exact["penalty"] == pytest.approx(0.0)
    assert noise_penalty(str(tmp_path / "none"), skip=0) is None
