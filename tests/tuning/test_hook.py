"""The budget hook: each pull from a stage's data iterator attaches that micro-batch's budget."""

import numpy as np
import pytest

from sparsebalance.tuning.hook import BudgetIterator, stage_budgets, wrap_data_iterators


def _plan(D, M, S):
    return np.arange(D * M * S).reshape(D, M, S) + 1


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (2, 2), (3, 3)])
def test_each_pull_sets_its_budget(pp, vpp):
    D, M = 2, 5
    plan = _plan(D, M, pp * vpp)
    for d in range(D):
        for r in range(pp):
            its = wrap_data_iterators([iter([{"x": m} for m in range(M)]) for _ in range(vpp)],
                                      plan, d, r, pp)
            assert len(its) == vpp
            # Pull in an interleaved order across chunks, as the interleaved schedule does.
            for m in range(M):
                for c in reversed(range(vpp)):
                    batch = next(its[c])
                    want = int(plan[d, m, c * pp + r])
                    assert batch == {"x": m, "budget": want, "microbatch": m}


def test_non_dict_batches_and_overrun():
    it = BudgetIterator(iter([{"x": "a"}, {"x": "b"}, {"x": "c"}]), [3, 4])
    assert next(it) == {"x": "a", "budget": 3, "microbatch": 0}
    assert next(it) == {"x": "b", "budget": 4, "microbatch": 1}
    with pytest.raises(RuntimeError, match="pulled one more"):
        next(it)
    assert list(BudgetIterator(iter([]), [1])) == []
    with pytest.raises(TypeError, match="must be dicts"):
        next(BudgetIterator(iter(["a"]), [1]))


def test_bad_plans_raise():
    with pytest.raises(ValueError, match="stages"):
        stage_budgets(np.ones((1, 2, 3)), 0, 0, pp=2)
    with pytest.raises(ValueError, match="outside"):
        stage_budgets(np.ones((1, 2, 2)), 1, 0, pp=2)
    with pytest.raises(ValueError, match=">= 0"):  # checked once, where the table is sliced
        wrap_data_iterators([iter([])], -np.ones((1, 2, 2)), 0, 0, pp=2)
