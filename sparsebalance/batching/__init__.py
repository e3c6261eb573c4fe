"""SparseBalance batching: document packing strategies (SAB and baselines) and the
deterministic, resumable packing sampler."""

from sparsebalance.batching.packing import StepPacking
from sparsebalance.batching.sampler import PackingSampler
from sparsebalance.batching.strategies import STRATEGIES

__all__ = ["PackingSampler", "StepPacking", "STRATEGIES"]
