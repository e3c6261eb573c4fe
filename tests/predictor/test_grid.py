"""Profiling compositions: within capacity, seeded, budgets in range."""

import glob
import os

import numpy as np
import pytest

from sparsebalance.predictor.grid import GridSpec, heldout_set, load_length_pool, sample_pack, training_grid

FILES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "data", "lengths", "*.json")))


@pytest.fixture(scope="module")
def pool():
    assert len(FILES) == 2, "the repository's data/lengths/*.json"
    return load_length_pool(FILES)


@pytest.mark.parametrize("capacity, block", [(1024, 64), (2048, 64), (32768, 256)])
def test_grid_and_heldout_respect_capacity(pool, capacity, block):
    spec = GridSpec(capacity=capacity, block_size=block, budgets=(2, 8, None))
    grid = training_grid(pool, spec, np.random.default_rng(0), n_mixes=6)
    assert {k for _, k in grid} == {2, 8, None}
    assert any(len(L) == 1 and L[0] == capacity for L, _ in grid)  # single long doc
    assert any(len(L) >= capacity // block for L, _ in grid)      # many short docs
    held = heldout_set(pool, spec, np.random.default_rng(1), 30, (2, 16))
    for L, k in grid + held:
        assert 1 <= sum(L) <= capacity and min(L) >= 1
        assert k is None or 2 <= k <= 16
    assert len({tuple(L) for L, _ in held}) > 20  # not a degenerate set
    assert any(len(L) > 1 for L, _ in held)


def test_seeded_and_scaled(pool):
    spec = GridSpec(capacity=2048, block_size=64, budgets=(None,))
    a = [sample_pack(pool, spec, np.random.default_rng(5)) for _ in range(3)]
    b = [sample_pack(pool, spec, np.random.default_rng(5)) for _ in range(3)]
    assert a == b
    assert spec.scale == pytest.approx(2048 / 32768)


def test_bad_specs():
    with pytest.raises(ValueError, match="budgets"):
        GridSpec(capacity=100, block_size=4, budgets=())
    with pytest.raises(ValueError, match="k_range"):
        heldout_set(np.array([5]), GridSpec(100, 4, (None,)), np.random.default_rng(0), 1, (3, 1))
