"""Seeded synthetic planning instances with realistic budget curves.

Each micro-batch packs whole documents (log-normal lengths, heavy tail) up to
``seq_length`` tokens. A stage's forward time is ``layers * (c_attn * kept_pairs +
c_tok * tokens) + extras`` (embedding on the first stage, output layer and loss on
the last), its backward ``bwd_ratio`` times that; its retained attention is
``layers * kept_pairs``. ``kept_pairs`` is the exact count of block top-k routing
(``sparsebalance.pairs``), so curves are non-decreasing and flatten for
micro-batches of short documents, exactly the heterogeneity DST exploits.
Used by the tests, the timing tool and ``benchmarks/simulate.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from sparsebalance.pairs import kept_pairs
from sparsebalance.tuning.instance import Instance


def pack_documents(rng: np.random.Generator, seq_length: int, mean_len: float,
                   sigma: float) -> np.ndarray:
    """Document lengths of one micro-batch: log-normal draws until ``seq_length`` is full."""
    mu = np.log(mean_len) - sigma ** 2 / 2
    out, used = [], 0
    while used < seq_length:
        n = int(min(max(rng.lognormal(mu, sigma), 16), seq_length - used))
        out.append(n)
        used += n
    return np.array(out, dtype=np.int64)


def random_instance(seed: int, *, pp: int, dp: int, microbatches: int,
                    levels: Sequence[int], k0: int, schedule: str = "1f1b", vpp: int = 1,
                    seq_length: int = 16384, block_size: int = 256, mean_len: float = 3000.0,
                    sigma: float = 1.1, p2p_ms: float = 0.05, layers_per_stage: int = 2,
                    bwd_ratio: float = 2.2, group: Optional[int] = None) -> Instance:
    """A seeded random instance; every micro-batch has its own document mix."""
    rng = np.random.default_rng(seed)
    lv = np.array(sorted(set(int(x) for x in levels) | {int(k0)}), dtype=np.int64)
    S, L = pp * vpp, len(lv)
    # Per-pair and per-token costs chosen so attention is ~half of a long micro-batch's time.
    c_attn = 1.0 / (seq_length * block_size * 16)
    c_tok = 1.0 / seq_length
    fwd = np.empty((L, dp, microbatches, S))
    attn = np.empty_like(fwd)
    for d in range(dp):
        for m in range(microbatches):
            lens = pack_documents(rng, seq_length, mean_len, sigma)
            kp = np.array([kept_pairs(lens, int(k), block_size).sum() for k in lv], dtype=float)
            t = layers_per_stage * (c_attn * kp + c_tok * lens.sum())
            fwd[:, d, m, :] = t[:, None]
            attn[:, d, m, :] = layers_per_stage * kp[:, None]
    fwd[:, :, :, 0] += 0.3   # embedding
    fwd[:, :, :, S - 1] += 0.8  # output layer + loss
    return Instance(schedule=schedule, pp=pp, vpp=vpp, dp=dp, microbatches=microbatches,
                    k0=int(k0), kmin=int(lv[0]), kmax=int(lv[-1]), levels=lv, fwd=fwd,
                    bwd=bwd_ratio * fwd, attn=attn, p2p_ms=p2p_ms, group=group)
