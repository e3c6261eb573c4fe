"""SAB in steps set by one long document (dense attention, M = PP): the moves off the slow
replicas (``sab_moves_uneven``) and the slack fill (``strategies/slack_fill.py``) never
raise a step's predicted time, the fill only adds the next stream items, and every token
is still trained exactly once per epoch."""

import numpy as np

from sparsebalance.batching import PackingSampler

SEQ = 65536
# Short documents and, every 40th, one of 64K tokens (a whole micro-batch); nothing may wait (max_carry_steps 0),
# so steps with a long document are uneven: one replica runs it, the other idles.
LENGTHS = np.random.default_rng(5).integers(500, 4000, 1200)
LENGTHS[::40] = 65536


def make(predictor, **options):
    return PackingSampler(LENGTHS, dp=4, micro_batches=2, seq_length=SEQ, strategy="sab", seed=1,
                          predictor=predictor, topk=None, pp=2, max_carry_steps=0, options=options)


def items(p):
    return {(d, o, n) for r in p.ranks for mb in r for d, o, n in mb}


def paired_steps(predictor, on: dict, off: dict):
    """Each step of an epoch planned with ``on`` and, from the same sampler state, with ``off``."""
    a = make(predictor, **on)
    out = []
    while True:
        state = a.state_dict()
        p = a.next_step()
        if p.epoch > 0:
            return out
        b = make(predictor, **off)
        b.load_state_dict(state)
        out.append((p, b.next_step()))


def test_slack_fill_adds_stream_items_without_raising_the_step(predictor):
    pairs = paired_steps(predictor, {"sab_moves_uneven": 0}, {"sab_moves_uneven": 0, "sab_slack_items": 0})
    filled = 0
    for p, q in pairs:
        assert p.step_ms <= q.step_ms * (1 + 1e-9)
        assert items(q) <= items(p)  # the fill only adds
        added = items(p) - items(q)
        filled += bool(added)
        # ... and what it adds is stream items (never a carried one: nothing may wait here)
        assert all(o == 0 or n < SEQ for _, o, n in added)
    assert filled >= 3, f"the fill added items in {filled} steps: vacuous fixture"
    # Exactly once per epoch with the fill on.
    seen = {}
    for p, _ in pairs:
        for d, o, n in items(p):
            assert (d, o) not in seen
            seen[(d, o)] = n
    assert sum(seen.values()) == int(LENGTHS.sum())


def test_moves_off_the_slow_replicas_never_raise_the_step(predictor):
    pairs = paired_steps(predictor, {"sab_slack_items": 0}, {"sab_slack_items": 0, "sab_moves_uneven": 0})
    lower = 0
    for p, q in pairs:
        assert items(p) == items(q)  # the moves re-place the same items
        assert p.step_ms <= q.step_ms * (1 + 1e-9)
        lower += p.step_ms < q.step_ms * (1 - 1e-6)
    assert lower >= 1, "no step got faster: vacuous fixture"
