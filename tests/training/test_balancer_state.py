"""Checkpointable state of the online correction: Recalibrator / predictor / Balancer
``state_dict`` round trips, and what a resume does with missing or foreign state.
(End to end under PP=2: test_exact_resume.py.)"""

import math
import pickle

import numpy as np
import pytest
from conftest import balancer_config

from sparsebalance.balancer import Balancer
from sparsebalance.predictor import get_predictor
from sparsebalance.predictor.recalibration import Recalibrator

SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4,
             ffn_hidden_size=128, vocab_size=256, swiglu=False, block_size=32, topk=4)


def _observed(seed=0) -> Recalibrator:
    r, rng = Recalibrator(), np.random.default_rng(seed)
    for _ in range(7):
        for s in range(3):
            for ph in ("fwd", "bwd"):
                r.observe(s, ph, 1.0, float(rng.uniform(0.3, 3.0)))
    return r


def test_recalibrator_round_trip_is_bit_identical():
    a = _observed()
    b = Recalibrator()
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))  # as torch.save stores it
    for s in range(3):
        for ph in ("fwd", "bwd"):
            assert b.factor(s, ph) == a.factor(s, ph) and b.count(s, ph) == a.count(s, ph) == 7
    a.observe(1, "fwd", 2.0, 3.0), b.observe(1, "fwd", 2.0, 3.0)  # and continues identically
    assert a.factor(1, "fwd") == b.factor(1, "fwd") != 1.0


@pytest.mark.parametrize("bad, match", [
    ({"alpha": 0.5, "clip": 4.0, "entries": []}, "alpha=0.5"),
    ({"alpha": 0.2, "entries": []}, "malformed"),
    ({"alpha": 0.2, "clip": 4.0, "entries": [[0, "up", 0.1, 1]]}, "malformed entry"),
    ({"alpha": 0.2, "clip": 4.0, "entries": [[0, "fwd", math.nan, 1]]}, "malformed entry"),
])
def test_recalibrator_rejects_bad_state(bad, match):
    r = _observed()
    before = r.state_dict()
    with pytest.raises(ValueError, match=match):
        r.load_state_dict(bad)
    assert r.state_dict() == before  # untouched


def _balancer(pp=2, ahead=True):
    return Balancer(balancer_config(pp=pp, plan_ahead=ahead), get_predictor("h100-analytic", **SHAPE))


def test_balancer_state_keeps_the_correction_before_the_last_step():
    a = _balancer()
    a.predictor.observe(0, "fwd", 1.0, 2.0)
    a._before_last = a.predictor.recalibrator.state_dict()  # what observe() records
    a.predictor.observe(0, "fwd", 1.0, 3.0)
    b = _balancer()
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    assert b.predictor.correction(0, "fwd") == a.predictor.correction(0, "fwd")
    assert b._resume_from == a._before_last  # the first plan after the resume reads this
    c = _balancer(ahead=False)
    c.load_state_dict(a.state_dict())
    assert c._resume_from is None  # planning in line uses the newest correction, as uninterrupted


@pytest.mark.parametrize("state, says", [(None, "no SparseBalance predictor state"),
                                         ({"stages": 4}, "for 4 pipeline stages, this run has 2")])
def test_balancer_missing_or_foreign_state_warns_and_starts_fresh(state, says):
    b, lines = _balancer(), []
    b.load_state_dict(state, warn=lines.append)
    assert len(lines) == 1 and says in lines[0] and "uncalibrated" in lines[0]
    assert b.predictor.correction(1, "bwd") == 1.0 and b._resume_from is None


def test_balancer_malformed_state_is_one_line_error():
    b = _balancer()
    with pytest.raises(ValueError, match="--load: SparseBalance predictor state is malformed"):
        b.load_state_dict({"stages": 2, "predictor": {}, "before_last": {}})
