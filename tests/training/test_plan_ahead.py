"""DST planned ahead: the loader's look-ahead keeps checkpoints exact, and a plan made
in the background equals the in-line plan made from the same predictor state."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import balancer_config

from megatron.training.data import PackedDataLoader
from megatron.training.training import forecast_step
from sparsebalance.balancer import Balancer
from sparsebalance.predictor import get_predictor


class _Docs:
    """Just what the loader reads from a megatron IndexedDataset."""

    def __init__(self, lengths):
        self.sequence_lengths = np.asarray(lengths, dtype=np.int32)

    def get(self, idx, offset=0, length=None):
        return (np.arange(offset, offset + length) % 200 + 1).astype(np.int64)


def _loader(strategy="megatron"):
    rng = np.random.default_rng(0)
    docs = _Docs(rng.integers(20, 900, size=400))
    return PackedDataLoader(docs, np.arange(400), dp=1, dp_rank=0, micro_batches=4,
                            seq_length=1024, strategy=strategy, seed=3, pp=2)


def _segments(batches):
    return [[tuple(map(int, s)) for s in mb] for rank in batches.packing.ranks for mb in rank]


def test_peek_is_the_next_step_and_checkpoints_stay_before_it():
    plain, ahead = _loader(), _loader()
    want = [_segments(plain.next_step()) for _ in range(3)]
    assert _segments(ahead.next_step()) == want[0]
    state_after_1 = ahead.state_dict()
    peeked = ahead.peek()
    assert ahead.peek() is peeked and _segments(peeked) == want[1]
    assert ahead.state_dict() == state_after_1  # a checkpoint now resumes at step 2
    assert ahead.next_step() is peeked
    assert _segments(ahead.next_step()) == want[2]
    resumed = _loader()
    resumed.load_state_dict(state_after_1)
    assert _segments(resumed.next_step()) == want[1]
    ahead.peek()
    ahead.load_state_dict(state_after_1)  # a pending look-ahead is dropped on load
    assert _segments(ahead.next_step()) == want[1]


def _config(**kw):
    return balancer_config(**{"pp": 2, "topk": 4, "topk_min": 2, "topk_max": 8, **kw})


def _predictor():
    return get_predictor("h100-analytic", num_layers=4, block_size=64, topk=4)


def test_plan_ahead_equals_in_line_plan_with_the_same_correction():
    loader = _loader()
    first = loader.next_step()
    bal = Balancer(_config(), _predictor())
    ref = Balancer(_config(plan_ahead=False), _predictor())
    assert bal.ahead and not ref.ahead
    f1 = forecast_step(bal, first)  # nothing planned ahead: planned in line
    assert f1.wait_ms == f1.plan_ms
    nxt = loader.peek()
    bal.plan_ahead(nxt, nxt.lengths)
    want = ref.plan(nxt.lengths)  # the correction both see: the one before this step's observation
    meas = [x * np.array([1.0, 1.7]) for x in (f1.fwd_ms, f1.bwd_ms)]  # stage 1 slower
    bal.observe(f1, *meas)  # waits for the plan ahead before moving the correction
    assert bal.predictor.correction(1, "fwd") > 1.0
    got = forecast_step(bal, loader.next_step())
    assert np.array_equal(got.budget, want.budget)
    assert got.step_ms == pytest.approx(want.step_ms)
    # The in-line plan after the observation sees the new correction (a different forecast).
    ref.observe(want, *meas)
    assert ref.plan(nxt.lengths).step_ms != pytest.approx(want.step_ms)


def test_a_stale_look_ahead_is_replaced_and_errors_reach_the_caller():
    loader = _loader()
    bal = Balancer(_config(), _predictor())
    b1 = loader.next_step()
    nxt = loader.peek()
    bal.plan_ahead(nxt, nxt.lengths)
    got = forecast_step(bal, b1)  # not the batches planned ahead: planned now
    assert got.budget is not None and b1.budget is got.budget
    empty = SimpleNamespace(packing=SimpleNamespace(ranks=[[]]))  # no micro-batch: the thread fails
    bal.plan_ahead(empty, [[]])
    assert bal._pending is not None
    with pytest.raises(ValueError, match="non-empty"):
        forecast_step(bal, loader.next_step())


def test_no_plan_ahead_without_dst():
    bal = Balancer(_config(policy="off"), _predictor())
    assert not bal.ahead
    loader = _loader()
    nxt = loader.peek()
    bal.plan_ahead(nxt, nxt.lengths)
    assert bal._pending is None
    assert forecast_step(bal, loader.next_step()).budget is None
