"""SparseBalance batching: document packing strategies (SAB and baselines) and the
deterministic, resumable packing sampler."""

from sparsebalance.batching.plan import StepPlan
from sparsebalance.batching.sampler import PackingSampler
from sparsebalance.batching.strategies import STRATEGIES

__all__ = ["PackingSampler", "StepPlan", "STRATEGIES"]
