"""WLB-LLM's imbalance degree of a simulated step.

WLB-LLM (Wang et al., OSDI'25, arXiv 2503.17924) measures pipeline imbalance as the
slowest micro-batch's latency over the mean micro-batch latency of a pipeline's step:
``max_m T[m] x PP / sum_m T[m]`` with their global batch of ``PP x DP`` sequences, i.e.
``M = PP`` micro-batches per replica. We write it ``max_m T[m] x M / sum_m T[m]``
(= max / mean), which is their number at ``M = PP`` and stays >= 1 (1 = balanced) at
``M > PP``, where ``x PP`` would fall below 1 without any change in balance.

``T[r, m]``: the cost model's predicted forward + backward time of micro-batch ``m`` on
replica ``r`` at one pipeline stage, averaged over the stages (ms). Stages hold equal
layer counts, so the average is the time at any middle stage; it leaves out pipeline
bubbles, P2P and the output layer's share differences between stages. A step's degree
is the mean over its replicas.
"""

from __future__ import annotations

import numpy as np


def imbalance_degree(latency: np.ndarray) -> np.ndarray:
    """Per replica, ``max x M / sum`` of ``latency`` ([dp, M] micro-batch latencies, ms).

    Returns a [dp] array, each >= 1. Raises ValueError for a shape other than 2-D, no
    micro-batch, a negative latency or a replica whose latencies sum to 0.
    """
    t = np.asarray(latency, dtype=np.float64)
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError(f"latency must be [dp, micro-batches] with >= 1 micro-batch, got {t.shape}")
    if (t < 0).any():
        raise ValueError("latency must be >= 0")
    total = t.sum(axis=1)
    if (total <= 0).any():
        raise ValueError("every replica needs a positive total latency")
    return t.max(axis=1) * t.shape[1] / total


def step_imbalance_degree(fwd: np.ndarray, bwd: np.ndarray) -> float:
    """A step's imbalance degree from per-op times ``fwd``, ``bwd`` ([dp, M, stages], ms):
    :func:`imbalance_degree` of the stage-averaged fwd + bwd, averaged over replicas."""
    f, b = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    if f.shape != b.shape or f.ndim != 3:
        raise ValueError(f"fwd and bwd must share a [dp, M, stages] shape, got {f.shape}, {b.shape}")
    return float(imbalance_degree((f + b).mean(axis=2)).mean())
