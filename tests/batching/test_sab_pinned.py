"""SAB's plans pinned: a faster planner must decide exactly as before.

The fingerprints below are SAB's plans (every step's micro-batches and what waits, over
an epoch boundary) as made by the planner before its step-time scoring was rewritten
(commit 399bdca). A change here means SAB decides differently: where that is intended,
show that the small-M grid's tokens/s does not drop (``benchmarks/harness/compare/
smallm_grid.py``) and pin the new plans.
"""

import hashlib

import numpy as np
import pytest
from conftest import make_lengths

from sparsebalance.batching import PackingSampler
from sparsebalance.batching.strategies import sab
from sparsebalance.pipeline import simulate

# Short documents, every 50th one of 30K tokens (the outlier queue holds them: dense
# attention, M = PP), as in test_outlier_queue.
LONG = np.random.default_rng(0).integers(500, 4000, 400)
LONG[::50] = 30000
# Log-normal lengths around 1.5K tokens, up to 40K (chunked at the sequence length).
MID = np.minimum(np.random.default_rng(2).lognormal(np.log(1500), 1.3, 900).astype(np.int64) + 1, 40000)

CASES = {
    # name: (lengths, sampler keyword arguments, steps: epoch 0 and the first of epoch 1)
    "sparse_m8_pp4": (make_lengths(1500), dict(dp=2, micro_batches=8, pp=4, seq_length=2048), 34),
    "dense_m16_pp4": (MID, dict(dp=2, micro_batches=16, pp=4, seq_length=16384, topk=None), 9),
    "dense_m32_pp8": (MID, dict(dp=2, micro_batches=32, pp=8, seq_length=8192, topk=None), 8),
    "held_long_m2_pp2": (LONG, dict(dp=2, micro_batches=2, pp=2, seq_length=32768, topk=None), 11),
}
PINNED = {
    "sparse_m8_pp4": "d693c811ff303b74",
    "dense_m16_pp4": "b21845f3ef280fa6",
    "dense_m32_pp8": "4117c872d055adba",
    "held_long_m2_pp2": "6d299f5e22c1e215",
}


def fingerprint(lengths, kw, steps, predictor):
    s = PackingSampler(lengths, strategy="sab", seed=3, predictor=predictor, max_carry_steps=2, **kw)
    h, epochs, held = hashlib.sha256(), set(), 0
    for _ in range(steps):
        p = s.next_step()
        c = s.carried
        epochs.add(p.epoch)
        held += len(c)
        h.update(repr((p.epoch, p.ranks, c.doc.tolist(), c.offset.tolist(), c.age.tolist())).encode())
    return h.hexdigest()[:16], epochs, held


@pytest.mark.parametrize("name", sorted(CASES))
def test_sab_plans_are_pinned(name, predictor):
    got, epochs, held = fingerprint(*CASES[name], predictor)
    assert epochs == {0, 1}, "the fixture must cross an epoch boundary"
    if name.startswith("held"):
        assert held > 0, "no long document waited: the outlier queue is not exercised"
    assert got == PINNED[name]


def test_sab_plans_equal_with_the_timeline_as_scorer(predictor, monkeypatch):
    """The packer's batched scorer (``step_ms_rows``) against the full timeline model:
    the same plans, step for step."""
    lengths, kw, steps = CASES["dense_m16_pp4"]
    fast = fingerprint(lengths, kw, steps // 2, predictor)[0]

    def timeline(fr, br, seq, **opts):
        return simulate(fr[seq], br[seq], **opts).replica_step_ms

    monkeypatch.setattr(sab, "step_ms_rows", timeline)
    assert fingerprint(lengths, kw, steps // 2, predictor)[0] == fast
