"""Fixtures for the batching tests: small synthetic length sets and a predictor."""

import numpy as np
import pytest

SEQ = 2048


def make_lengths(n: int = 240, seed: int = 1, seq: int = SEQ) -> np.ndarray:
    """Log-normal document lengths with a long tail: some documents exceed ``seq``
    (so chunking is exercised) and many are short."""
    rng = np.random.default_rng(seed)
    L = np.maximum(1, rng.lognormal(mean=np.log(300), sigma=1.1, size=n)).astype(np.int64)
    L[:: 37] = seq * 2 + 17  # a few multi-chunk documents
    return L


@pytest.fixture(scope="session")
def lengths() -> np.ndarray:
    L = make_lengths()
    assert (L > SEQ).sum() >= 3 and (L < SEQ // 8).sum() >= 50  # not a vacuous fixture
    return L


@pytest.fixture(scope="session")
def predictor():
    from sparsebalance.predictor import get_predictor

    return get_predictor("h100-analytic", num_layers=8, block_size=64, topk=4)
