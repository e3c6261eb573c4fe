"""DST planned ahead: the library's StepPlanner packs one step ahead without moving
checkpoints, a plan made in the background equals the in-line plan made from the same
predictor state, and the driver's data iterators hand each micro-batch its entry."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import balancer_config

from megatron.training.data import PackedDataLoader
from sparsebalance.balancer import Balancer, PlannedStep, check_budget
from sparsebalance.predictor import get_predictor


class _Docs:
    """Just what the loader reads from a megatron IndexedDataset."""

    def __init__(self, lengths):
        self.sequence_lengths = np.asarray(lengths, dtype=np.int32)

    def get(self, idx, offset=0, length=None):
        return (np.arange(offset, offset + length) % 200 + 1).astype(np.int64)


def _loader(balancer=None, strategy="megatron", **kw):
    rng = np.random.default_rng(0)
    docs = _Docs(rng.integers(20, 900, size=400))
    return PackedDataLoader(docs, np.arange(400), dp=1, dp_rank=0, micro_batches=4,
                            seq_length=1024, strategy=strategy, seed=3, pp=2, balancer=balancer, **kw)


def _segments(batches):
    return [[tuple(map(int, s)) for s in mb] for rank in batches.packing.ranks for mb in rank]


def test_a_step_packed_ahead_is_the_next_step_and_checkpoints_stay_before_it():
    plain, ahead = _loader(), _loader(Balancer(_config(), _predictor()))
    want = [_segments(plain.next_step()) for _ in range(4)]
    assert _segments(ahead.next_step(more=False)) == want[0]  # the last step: nothing ahead
    assert ahead.planner._ahead is None
    state_after_1 = ahead.state_dict()
    b2 = ahead.next_step()  # step 3 is packed ahead now
    assert _segments(b2) == want[1]
    packed_ahead = ahead.planner._ahead[1]
    assert ahead.state_dict()["step"] == 2 and ahead.planner.sampler.state_dict()["step"] == 3
    resumed = _loader()
    resumed.load_state_dict(ahead.state_dict())  # a checkpoint now resumes at step 3
    assert _segments(resumed.next_step()) == want[2]
    b3 = ahead.next_step(more=False)
    assert b3.planned is packed_ahead and _segments(b3) == want[2]
    assert ahead.state_dict() == resumed.state_dict()
    ahead.next_step()  # step 5 packed ahead, then dropped on load
    ahead.load_state_dict(state_after_1)
    assert ahead.planner._ahead is None and _segments(ahead.next_step()) == want[1]


def _config(**kw):
    return balancer_config(**{"pp": 2, "topk": 4, "topk_min": 2, "topk_max": 8, **kw})


def _predictor():
    return get_predictor("h100-analytic", num_layers=4, block_size=64, topk=4)


def test_plan_ahead_equals_in_line_plan_with_the_same_correction():
    bal = Balancer(_config(), _predictor())
    ref = Balancer(_config(plan_ahead=False), _predictor())
    assert bal.ahead and not ref.ahead
    loader = _loader(bal)
    first = loader.next_step()  # nothing planned ahead yet: planned in line; step 2 started
    f1 = first.planned.forecast
    assert f1.wait_ms == f1.plan_ms
    nxt = loader.planner._ahead[1]
    want = ref.plan(nxt.lengths)  # the correction both see: the one before this step's observation
    meas = [x * np.array([1.0, 1.7]) for x in (f1.fwd_ms, f1.bwd_ms)]  # stage 1 slower
    bal.observe(f1, *meas)  # waits for the plan ahead before moving the correction
    assert bal.predictor.correction(1, "fwd") > 1.0
    got = loader.next_step(more=False).planned.forecast
    assert np.array_equal(got.budget, want.budget)
    assert got.step_ms == pytest.approx(want.step_ms)
    # The in-line plan after the observation sees the new correction (a different forecast).
    ref.observe(want, *meas)
    assert ref.plan(nxt.lengths).step_ms != pytest.approx(want.step_ms)


def test_a_stale_look_ahead_is_replaced_and_errors_reach_the_caller():
    bal = Balancer(_config(), _predictor())
    loader = _loader(bal)
    b1 = loader.next_step(more=False)
    nxt = _loader().next_step().planned
    bal.plan_ahead(nxt, nxt.lengths)  # a plan for a step the loader does not hand out next
    got = loader.next_step(more=False)  # planned now, for its own lengths
    want = Balancer(_config(plan_ahead=False), _predictor()).plan(got.planned.lengths)
    assert np.array_equal(got.budget, want.budget) and got.budget.shape == (1, 4, 2)
    assert b1.budget is not got.budget
    empty = SimpleNamespace(packing=SimpleNamespace(ranks=[[]]))  # no micro-batch: the thread fails
    bal.plan_ahead(empty, [[]])
    assert bal._pending is not None
    with pytest.raises(ValueError, match="non-empty"):
        loader.next_step()


def test_no_plan_ahead_without_dst():
    bal = Balancer(_config(policy="off"), _predictor())
    assert not bal.ahead
    loader = _loader(bal)
    b = loader.next_step()
    assert loader.planner._ahead is None and bal._pending is None
    assert b.budget is None and b.planned.forecast.step_ms > 0
    assert all(it.budgets is None for it in b.iterators(2))


def test_each_pull_carries_its_index_records_and_budget():
    """Chunk c of pipeline rank r hands micro-batch m the plan's entry [dp_rank, m, c * pp + r]."""
    for pp, vpp in [(1, 1), (2, 1), (2, 2), (3, 3)]:
        D, M = 2, 5
        plan = np.arange(D * M * pp * vpp).reshape(D, M, pp * vpp) + 1
        for d in range(D):
            for r in range(pp):
                from megatron.training.data import StepBatches

                records = []
                b = StepBatches(microbatches=[{"x": m} for m in range(M)], global_tokens=0, global_docs=M,
                                planned=PlannedStep(None, [], forecast=SimpleNamespace(budget=plan)),
                                dp_rank=d, pp_rank=r, pp=pp, records=records)
                its = b.iterators(vpp)
                for m in range(M):  # interleaved across chunks, as the interleaved schedule pulls
                    for c in reversed(range(vpp)):
                        got = next(its[c])
                        assert got == {"x": m, "microbatch": m, "records": records,
                                       "budget": int(plan[d, m, c * pp + r])}
                        assert type(got["budget"]) is int and got["records"] is records
                with pytest.raises(RuntimeError, match="pulled one more"):
                    next(its[0])


def test_each_pull_carries_its_tau_under_threshold_routing():
    """DST's TAU table (threshold routing) rides the same way: chunk c of pipeline rank r hands
    micro-batch m the TAU [dp_rank, m, c * pp + r], and no top-k (the cap stays static)."""
    from megatron.training.data import StepBatches

    D, M, pp, vpp = 2, 3, 2, 2
    taus = np.round(0.8 + 0.01 * np.arange(D * M * pp * vpp).reshape(D, M, pp * vpp), 2)
    for d in range(D):
        for r in range(pp):
            b = StepBatches(microbatches=[{"x": m} for m in range(M)], global_tokens=0, global_docs=M,
                            planned=PlannedStep(None, [], forecast=SimpleNamespace(budget=None, tau=taus)),
                            dp_rank=d, pp_rank=r, pp=pp, records=[])
            its = b.iterators(vpp)
            for m in range(M):
                for c in range(vpp):
                    got = next(its[c])
                    assert "budget" not in got and got["tau"] == taus[d, m, c * pp + r]
                    assert type(got["tau"]) is float


def test_the_budget_table_is_checked_once_where_it_is_planned():
    lengths = [[[10], [20]], [[30], [40]]]  # dp 2, M 2
    assert check_budget([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], lengths, 2).dtype == np.int64
    with pytest.raises(ValueError, match="needs"):
        check_budget(np.ones((2, 2, 3)), lengths, 2)
    with pytest.raises(ValueError, match="needs"):
        check_budget(np.ones((1, 2, 2)), lengths, 2)
    with pytest.raises(ValueError, match=">= 0"):
        check_budget(-np.ones((2, 2, 2)), lengths, 2)


def test_a_step_static_top_k_keeps_whole_is_planned_static_without_the_planner(monkeypatch):
    """Critical-path DST at slack 0: when static top-k already keeps every pair of every
    document (each at most topk + 2 blocks), the plan is the static one and the policy is not
    called; one longer document brings the planner back."""
    from sparsebalance.balancer import stage_tables
    from sparsebalance.pairs import kept_pairs
    from sparsebalance.pipeline import simulate

    b = Balancer(_config(), _predictor())
    calls = []
    policy = b._policy
    b._policy = lambda inst, dst: calls.append(1) or policy(inst, dst)
    short = [[[300, 64], [384], [100, 200, 50], [383]]]  # <= (4 + 2) x 64 tokens each
    assert (kept_pairs([300, 64, 384, 100, 200, 50, 383], 4, 64)
            == kept_pairs([300, 64, 384, 100, 200, 50, 383], None, 64)).all()
    f = b.plan(short)
    assert calls == [] and f.budget.shape == (1, 4, 2) and (f.budget == 4).all()
    fwd, bwd = stage_tables(b.predictor, short, 4, 2)
    assert np.array_equal(f.fwd_ms, fwd) and np.array_equal(f.bwd_ms, bwd)
    assert f.step_ms == f.baseline_step_ms == simulate(fwd, bwd).step_ms
    long_ = [[[300, 64], [900], [100, 200, 50], [383]]]  # 900 tokens: 15 blocks > 6
    b.plan(long_)
    assert calls == [1]
    slack = Balancer(_config(attn_slack=0.1), _predictor())  # slack > 0 may cut dense documents
    assert not slack._nothing_to_trade(short)
