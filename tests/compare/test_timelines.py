"""Timeline statistics: replaying measured op times and comparing to the predicted ones."""

import json

import numpy as np
import pytest

from sparsebalance.compare.timelines import timeline_stats
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
