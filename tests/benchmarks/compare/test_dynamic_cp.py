"""Dynamic CP: power-of-two CP sizes, legal placements, costs through the CP model."""

import numpy as np
import pytest

from benchmarks.harness.compare.dynamic_cp import cp_sizes, dynamic_cp_instance, place
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning.from_predictor import build_instance

S = 32768


def _pred(cp):
    return get_predictor("h100-analytic", block_size=256, topk=32, context_parallel_size=cp)


def test_cp_sizes_powers_of_two_from_the_per_rank_limit():
    # cp 4: per-rank limit 8K tokens
    L = np.array([1, 8192, 8193, 16384, 16385, 30000, 32768])
    assert cp_sizes(L, S, 4).tolist() == [1, 1, 2, 2, 4, 4, 4]
    assert cp_sizes(L, S, 1).tolist() == [1] * 7
    with pytest.raises(ValueError, match="power-of-two"):
        cp_sizes(L, S, 3)


@pytest.mark.parametrize("keep", [True, False])
def test_placement_is_legal(keep):
    rng = np.random.default_rng(0)
    mbs = []
    for _ in range(6):  # micro-batches of at most S tokens, several documents each
        L = np.clip(rng.lognormal(8, 1.2, 12), 16, S).astype(np.int64)
        L = L[np.cumsum(L) <= S]
        mbs.append(L if L.size >= 2 else np.array([S // 2, S // 4]))
    placed = place(mbs, S, 4, keep)
    got = sorted(d[0] for mb in placed for d in mb)
    assert got == sorted(np.concatenate(mbs).tolist())  # every document exactly once
    for m, mb in enumerate(placed):
        tok = np.zeros(4)
        for L, k, g, i in mb:
            assert k in (1, 2, 4) and g % k == 0 and g + k <= 4  # aligned group
            assert np.concatenate(mbs)[i] == L  # the index names the document placed
            tok[g:g + k] += L / k
        assert tok.max() <= S / 4 + 1e-6  # per-rank token limit
        if keep:
            assert sorted(d[0] for d in mb) == sorted(mbs[m].tolist())


def test_all_long_documents_cost_as_static_cp():
    """Documents that need the whole CP group run exactly as under static CP."""
    # cp 2: the per-rank limit is 16K, so every document here needs both GPUs.
    nested_long = [[[20000], [30000]], [[17000], [32768]]]
    cp = 2
    assert (cp_sizes(np.concatenate([np.ravel(m) for r in nested_long for m in r]), S, cp) == 2).all()
    preds = {1: _pred(1), 2: _pred(2)}
    static = build_instance(preds[2], nested_long, pp=2, k0=32)
    dyn = dynamic_cp_instance(preds, nested_long, S, cp, pp=2, k0=32, keep_microbatches=True,
                              static=static)
    np.testing.assert_allclose(dyn.fwd, static.fwd, rtol=1e-3)
    np.testing.assert_allclose(dyn.bwd, static.bwd, rtol=1e-3)
    np.testing.assert_array_equal(dyn.attn, static.attn)


def test_short_documents_run_without_exchange_and_can_win():
    """Two 8K documents: dynamic CP puts one on each GPU (no K/V exchange); static CP
    splits both. The dynamic layout is never slower than static when it is chosen
    (keep_microbatches keeps the faster per micro-batch)."""
    preds = {1: _pred(1), 2: _pred(2)}
    nested = [[[8000, 8000], [8000, 8000]]]
    static = build_instance(preds[2], nested, pp=2, k0=32)
    dyn = dynamic_cp_instance(preds, nested, S, 2, pp=2, k0=32, keep_microbatches=False)
    one = build_instance(preds[1], [[[8000], [8000]]], pp=2, k0=32)
    # each micro-batch costs one 8K document on one GPU
    np.testing.assert_allclose(dyn.fwd, one.fwd, rtol=1e-3)
    assert (dyn.fwd <= static.fwd).all()
    best = dynamic_cp_instance(preds, nested, S, 2, pp=2, k0=32, keep_microbatches=True,
                               static=static)
    assert (best.fwd <= static.fwd + 1e-12).all()
