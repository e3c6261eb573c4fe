"""The demo's Gantt is on the table's footing: time per 1,000 real tokens."""

import json
import os

import numpy as np
import pytest

from benchmarks.harness.compare.figures import last_timeline
from benchmarks.harness.compare.figures import real_gantt as _real_gantt
from benchmarks.harness.compare.timelines import step_tokens


def _run(root, arm, fwd, tokens, last_iteration=12):
    d = root / f"{arm}-0"
    (d / "timeline").mkdir(parents=True)
    doc = {"schedule": "1f1b", "vpp": 1, "p2p_ms": 0.0, "fwd_ms": fwd.tolist(),
           "bwd_ms": (2 * fwd).tolist()}
    (d / "timeline" / f"step_{last_iteration:07d}.measured.json").write_text(json.dumps(doc))
    (d / "summary.json").write_text(json.dumps({
        "last_iteration": last_iteration, "step_tokens_all": [1] * 11 + [tokens]}))
    return str(d / "timeline")


def test_longer_step_with_more_tokens_is_drawn_faster(tmp_path):
    """SparseBalance's step is 20% longer but holds 40% more tokens: per 1,000 tokens
    it is shorter, as its throughput is higher."""
    base = np.full((1, 4, 2), 10.0)  # [dp, microbatch, stage] ms
    tl = {"megatron": last_timeline(_run(tmp_path, "megatron", base, 10000)),
          "sparsebalance": last_timeline(_run(tmp_path, "sparsebalance", 1.2 * base, 14000))}
    arms = {"megatron": {"tokens_per_s": 1000.0, "step_ms": 10000.0},
            "sparsebalance": {"tokens_per_s": 1166.0, "step_ms": 12000.0}}
    figs = {}
    per_ktok = _real_gantt(str(tmp_path), arms, tl, figs)
    assert per_ktok["megatron"] / per_ktok["sparsebalance"] == pytest.approx(1.4 / 1.2)
    assert os.path.getsize(tmp_path / "real_gantt.png") > 0 and figs["real_gantt"] == "real_gantt.png"


def test_step_tokens_falls_back_to_the_arm_mean(tmp_path):
    tl = last_timeline(_run(tmp_path, "x", np.ones((1, 2, 2)), 500))
    assert step_tokens(tl, 42.0) == (500.0, "step")
    os.remove(tmp_path / "x-0" / "summary.json")
    assert step_tokens(tl, 42.0) == (42.0, "mean")
