"""Per-strategy invariants on one step, plus cost model and pipeline-model checks."""

import numpy as np
import pytest
from conftest import SEQ, make_lengths

from sparsebalance.batching import PackingSampler
from sparsebalance.batching.cost import CostModel
from sparsebalance.batching.stream import EpochItems, epoch_permutation
from sparsebalance.pipeline import step_ms

DP, M = 2, 4


def plans(lengths, strategy, predictor=None, n=8, **kw):
    s = PackingSampler(lengths, dp=DP, micro_batches=M, seq_length=SEQ, strategy=strategy,
                       seed=5, predictor=predictor, pp=2, **kw)
    return [s.next_step() for _ in range(n)], s


def flat(plan):
    return [mb for r in plan.ranks for mb in r]


def test_megatron_is_next_fit_in_stream_order(lengths):
    ps, _ = plans(lengths, "megatron")
    items = EpochItems.build(lengths, epoch_permutation(lengths.size, 5, 0, True), SEQ)
    stream = list(zip(items.doc.tolist(), items.offset.tolist(), items.length.tolist()))
    got = [seg for p in ps for mb in flat(p) for seg in mb]
    assert got == stream[:len(got)]
    for p in ps:
        mbs = flat(p)
        for a, b in zip(mbs, mbs[1:]):
            # a micro-batch closes only when the next item does not fit
            assert sum(s[2] for s in a) + b[0][2] > SEQ


def test_concat_fills_every_micro_batch(lengths):
    ps, _ = plans(lengths, "concat")
    for p in ps:
        assert all(sum(s[2] for s in mb) == SEQ for mb in flat(p))


def test_sorted_groups_by_length(lengths):
    ps, _ = plans(lengths, "sorted", max_carry_steps=0)
    for p in ps:
        # first-fit over descending lengths: each bin's longest item opened it
        heads = [max(s[2] for s in mb) for mb in flat(p) if mb]
        assert heads == sorted(heads, reverse=True)


@pytest.mark.parametrize("strategy, key", [("tokens", lambda L: L), ("quadratic", lambda L: L * L)])
def test_greedy_balance_bound(strategy, key):
    """LPT: with room everywhere, loads differ by at most the largest item cost."""
    L = make_lengths(400, seed=7)
    L = np.minimum(L, SEQ // 8)  # small items: capacity never binds
    ps, _ = plans(L, strategy, n=5)
    for p in ps:
        loads = [sum(key(float(s[2])) for s in mb) for mb in flat(p)]
        biggest = max(key(float(s[2])) for mb in flat(p) for s in mb)
        assert max(loads) - min(loads) <= biggest + 1e-9


def test_wlb_releases_outliers_in_rounds_of_dp(lengths, predictor):
    ps, s = plans(lengths, "wlb", predictor, n=40, max_carry_steps=100)
    checked = 0
    last = {p.epoch: p.step for p in ps}
    # the last steps of an epoch flush whatever is held
    for p in [p for p in ps if p.step < last[p.epoch] - 2 and p.epoch < ps[-1].epoch]:
        segs = [seg for mb in flat(p) for seg in mb]
        big = sum(1 for seg in segs if seg[2] >= SEQ // 2)
        mid = sum(1 for seg in segs if SEQ // 4 <= seg[2] < SEQ // 2)
        assert big % DP == 0 and mid % DP == 0
        checked += big > 0
    assert checked >= 3


def test_sab_order_is_locally_optimal_and_balanced(lengths, predictor):
    ps, _ = plans(lengths, "sab", predictor, n=6)
    mega, _ = plans(lengths, "megatron", predictor, n=6)
    for p in ps:
        for r in range(DP):
            f, b = p.stage_fwd_ms[r], p.stage_bwd_ms[r]
            base = step_ms(f, b)
            assert base == pytest.approx(p.rank_ms[r])
            for i in range(M):
                for j in range(i + 1, M):
                    o = np.arange(M)
                    o[i], o[j] = j, i
                    assert step_ms(f[o], b[o]) >= base - 1e-6
    imb = np.mean([p.rank_ms.max() / p.rank_ms.mean() for p in ps])
    imb_mega = np.mean([p.rank_ms.max() / p.rank_ms.mean() for p in mega])
    assert imb <= imb_mega


def test_plan_times_match_predictor_stage_ms(lengths, predictor):
    ps, _ = plans(lengths, "tokens", predictor, n=2)
    for p in ps:
        for r in range(DP):
            for m in range(M):
                segs = p.ranks[r][m]
                if not segs:
                    continue
                Ls = np.array([s[2] for s in segs])
                for st in range(2):
                    for ph, arr in (("fwd", p.stage_fwd_ms), ("bwd", p.stage_bwd_ms)):
                        want = predictor.stage_ms(Ls, 4, st, 2, ph)
                        assert arr[r, m, st] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("M_, pp", [(1, 1), (3, 2), (8, 4), (2, 5), (6, 3)])
def test_batched_step_ms_equals_pipeline_simulate(M_, pp):
    from sparsebalance.pipeline import simulate

    rng = np.random.default_rng(M_ * 10 + pp)
    f = rng.uniform(0.5, 3.0, size=(3, M_, pp))
    b = rng.uniform(1.0, 6.0, size=(3, M_, pp))
    want = simulate(f, b, schedule="1f1b").replica_step_ms
    assert np.allclose(step_ms(f, b), want)


def test_cost_model_sums_whole_model(predictor):
    c = CostModel(predictor, topk=4, pp=2)
    L = np.array([100, 700, 2048])
    f, b = c.stage_times(c.layer_item_ms(L).sum(axis=1)[None, :], np.array([L.sum()]))
    want = sum(predictor.stage_ms(L, 4, s, 2, ph) for s in range(2) for ph in ("fwd", "bwd"))
    assert (f + b).sum() == pytest.approx(want)
    assert (c.stage_item_ms(L).sum() + c.stage_const_ms().sum()) == pytest.approx(want)


def test_sab_with_one_micro_batch_per_step(lengths, predictor):
    """--global-batch-size 1 per replica: nothing to shape, and no crash (it was an
    argmin over no candidate moves)."""
    from sparsebalance.batching.strategies.sab import pipeline_profile

    assert list(pipeline_profile(1, (1.0, 3.0), (2.0, 6.0))) == [1.0]
    s = PackingSampler(lengths, dp=DP, micro_batches=1, seq_length=SEQ, strategy="sab", seed=5,
                       predictor=predictor, pp=2)
    for _ in range(3):
        plan = s.next_step()
        assert all(len(rank) == 1 and rank[0] for rank in plan.ranks)


@pytest.mark.parametrize("strategy", ["sab", "wlb", "tokens", "megatron"])
def test_one_micro_batch_steps_never_stall(predictor, strategy):
    """DP=1, one micro-batch a step (``--global-batch-size 1``), items of 0.9-1x the
    micro-batch: every step holds tokens and the steps take the stream in order until it
    ends (SAB's window budget, 0.9 of the step's tokens, once admitted no such item and
    every later step was empty)."""
    L = np.random.default_rng(3).integers(int(0.9 * SEQ) + 1, SEQ + 1, size=12)
    L[::4] = 300  # some short ones too
    s = PackingSampler(L, dp=1, micro_batches=1, seq_length=SEQ, strategy=strategy, seed=5,
                       predictor=predictor, pp=2)
    seen = []
    for _ in range(L.size):
        plan = s.next_step()
        assert plan.epoch == 0 and plan.ranks[0][0], plan  # not empty
        seen += [seg[0] for seg in plan.ranks[0][0]]
        if len(seen) == L.size:
            break
    assert sorted(seen) == list(range(L.size))  # every document once, none stuck


# Fine-tuning at full context: documents of 1-4K tokens chunked at SEQ = 2048, so most
# items are a large fraction of a micro-batch (SAB's 0.9 window then admits few).
NEAR_SEQ = np.random.default_rng(11).integers(1000, 2 * SEQ + 1, size=160)


def epoch_fill(strategy, dp, M_, predictor):
    """One epoch of NEAR_SEQ: (capacity use, empty micro-batches of each step but the last)."""
    s = PackingSampler(NEAR_SEQ, dp=dp, micro_batches=M_, seq_length=SEQ, strategy=strategy,
                       seed=5, predictor=predictor, pp=2)
    ps = []
    while not ps or ps[-1].epoch == 0:
        ps.append(s.next_step())
    ps = ps[:-1]
    assert len(ps) >= 20  # not a vacuous fixture
    cap = sum(p.tokens for p in ps) / (len(ps) * dp * M_ * SEQ)
    # Items are at most SEQ long, so an empty micro-batch of a step after which the epoch
    # goes on (items wait) could have held the next one.
    return cap, [sum(not mb for r in p.ranks for mb in r) for p in ps[:-1]]


@pytest.mark.parametrize("dp, M_", [(1, 2), (2, 2), (1, 4), (2, 4)])
@pytest.mark.parametrize("strategy", ["sab", "megatron", "tokens"])
def test_no_empty_micro_batch_while_items_wait(predictor, strategy, dp, M_):
    """No step leaves a micro-batch empty while an item that fits is waiting. SAB did:
    its window budget (0.9 x 2 x 2048 = 3,686 tokens at dp 1, M 2) admitted one
    2,048-token item when the next was long too, and its moves emptied a micro-batch
    to shorten the 1F1B fill; 14% of its micro-batches were empty at dp 1, M 2."""
    _, empty = epoch_fill(strategy, dp, M_, predictor)
    assert sum(empty) == 0, f"{sum(empty)} empty micro-batches in {len(empty)} steps"


@pytest.mark.parametrize("dp, M_", [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_sab_capacity_with_items_near_seq_length(predictor, dp, M_):
    """SAB keeps 10% of the step as headroom for balance, so it may train fewer tokens a
    step than the strategies that fill the window to the step (tokens, wlb), but about
    as many as megatron's next-fit. Before empty micro-batches were filled, SAB trained
    0.12 of capacity less than megatron at dp 1, M 2; with them filled, sab - megatron
    was -0.006 to +0.05 over 12 draws of this mix and these shapes."""
    cap = {s: epoch_fill(s, dp, M_, predictor)[0] for s in ("megatron", "tokens", "wlb", "sab")}
    print(f"capacity use dp {dp} M {M_}: " + ", ".join(f"{k} {v:.3f}" for k, v in cap.items()))
    assert cap["sab"] >= cap["megatron"] - 0.02


@pytest.mark.parametrize("max_carry", [0, 2])
def test_sab_filled_steps_keep_sampler_invariants(predictor, max_carry):
    """With empty micro-batches filled from the stream: every token once per epoch, the
    carry bound (nothing carried at max_carry_steps 0), exact resume, and a resume on
    another DP size (2 x 2 -> 1 x 4) that still trains every token once."""
    def make(dp=2, M_=2):
        return PackingSampler(NEAR_SEQ, dp=dp, micro_batches=M_, seq_length=SEQ, strategy="sab",
                              seed=5, predictor=predictor, pp=2, max_carry_steps=max_carry)

    def covered(plans):
        c = {d: np.zeros(int(L), dtype=np.int64) for d, L in enumerate(NEAR_SEQ)}
        for p in plans:
            for d, off, n in (seg for r in p.ranks for mb in r for seg in mb):
                c[d][off:off + n] += 1
        return all(np.all(v == 1) for v in c.values())

    def epoch(s):
        ps = []
        while not ps or ps[-1].epoch == 0:
            ps.append(s.next_step())
            assert len(s.carried) == 0 or max_carry > 0
            assert len(ps) <= NEAR_SEQ.size, "the epoch does not end (empty steps)"
        return ps[:-1]

    a = make()
    head = [a.next_step() for _ in range(5)]
    state = a.state_dict()
    rest = epoch(a)
    # Without the fill a window holds at most 0.9 of the step's tokens (carried tokens
    # included), so a step above that shows the fill at work.
    assert any(p.tokens > 0.9 * 4 * SEQ for p in head + rest)
    assert covered(head + rest)
    b = make()
    b.load_state_dict(state)
    assert [p.ranks for p in epoch(b)] == [p.ranks for p in rest]
    c = make(dp=1, M_=4)
    c.load_state_dict(state)
    assert covered(head + epoch(c))


@pytest.mark.parametrize("strategy", ["megatron", "sorted", "tokens", "quadratic", "wlb", "dp-balanced", "sab"])
def test_no_strategy_stalls_when_nothing_may_wait(predictor, strategy):
    """max_carry_steps 0 with items near seq_length: a greedy packer that left the window's
    first item unplaced had the window cut to nothing, and so on every later step (sorted,
    tokens, quadratic and wlb never ended their epoch); the cut now keeps that first item."""
    s = PackingSampler(NEAR_SEQ, dp=1, micro_batches=2, seq_length=SEQ, strategy=strategy, seed=5,
                       predictor=predictor, pp=2, max_carry_steps=0)
    seen = {d: np.zeros(int(L), dtype=np.int64) for d, L in enumerate(NEAR_SEQ)}
    for _ in range(NEAR_SEQ.size + 1):
        p = s.next_step()
        if p.epoch > 0:
            break
        assert p.tokens > 0, "an empty step while the epoch has items left"
        for d, off, n in (seg for r in p.ranks for mb in r for seg in mb):
            seen[d][off:off + n] += 1
    else:
        pytest.fail("the epoch did not end")
    assert all(np.all(v == 1) for v in seen.values())


@pytest.mark.parametrize("M_, pp", [(4, 2), (8, 4), (6, 3)])
def test_pipeline_profile_beats_equal_micro_batches(M_, pp):
    from sparsebalance.batching.strategies.sab import pipeline_profile

    f = tuple([1.0] * (pp - 1) + [3.0])  # heavier last stage, as with a big vocabulary
    b = tuple(2 * x for x in f)
    x = pipeline_profile(M_, f, b)
    assert x.shape == (M_,) and x.mean() == pytest.approx(1.0) and x.min() >= 0.05 - 1e-9
    t = step_ms(x[:, None] * np.array(f), x[:, None] * np.array(b))
    t_eq = step_ms(np.ones((M_, 1)) * np.array(f), np.ones((M_, 1)) * np.array(b))
    assert t < 0.99 * t_eq  # unequal, ordered micro-batches shorten fill and drain


@pytest.mark.parametrize("profile", ["pipeline", "flat"])
def test_sab_moves_never_slow_the_step(lengths, predictor, profile):
    from sparsebalance.batching.packing import Carried, PackContext
    from sparsebalance.batching.strategies.sab import pack_sab
    from sparsebalance.batching.stream import StreamCursor

    items = EpochItems.build(lengths, epoch_permutation(lengths.size, 0, 0, True), SEQ)
    cost = CostModel(predictor, topk=4, pp=2)
    steps = {}
    for moves in (0, 8):
        ctx = PackContext(dp=DP, micro_batches=M, seq_length=SEQ, max_carry_steps=2, flush=False,
                          carry_cap_tokens=DP * M * SEQ // 2, cost=cost,
                          options={"sab_moves": moves, "sab_profile": profile})
        cur = StreamCursor(items)
        got = []
        for _ in range(4):
            pk = pack_sab(Carried.empty(), cur, ctx)
            got.append(cost.packing_times(pk.bins, DP, M)["rank_ms"].max())
            cur = StreamCursor(items, cur.pos)  # same windows for both settings
        steps[moves] = np.array(got)
    assert np.all(steps[8] <= steps[0] + 1e-9)
    assert np.any(steps[8] < steps[0] - 1e-6)  # the moves did something
