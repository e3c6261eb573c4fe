"""Seeded small planning instances shared by the tuning tests."""

import pytest

from sparsebalance.tuning.synthetic import random_instance

LEVELS5 = [14, 17, 20, 23, 26]
LEVELS3 = [17, 20, 23]
# (schedule, pp, vpp, dp, M, levels): at most 5**8 tables per replica for brute force.
SMALL = [("1f1b", 2, 1, 2, 3, LEVELS5), ("1f1b", 3, 1, 2, 2, LEVELS5),
         ("1f1b", 2, 1, 1, 4, LEVELS5), ("1f1b", 3, 1, 2, 3, LEVELS3),
         ("1f1b", 3, 1, 1, 4, LEVELS3), ("1f1b", 2, 1, 2, 4, [14, 20, 26]),
         ("interleaved", 2, 2, 1, 2, LEVELS3), ("interleaved", 2, 2, 2, 2, [14, 20, 26])]
SEEDS = (0, 1, 2)


def make(case, seed):
    schedule, pp, vpp, dp, M, levels = case
    # Short-ish documents against a 256-token block: the budget matters for some
    # micro-batches and not for others (dense short documents).
    return random_instance(seed, schedule=schedule, pp=pp, vpp=vpp, dp=dp, microbatches=M,
                           levels=levels, k0=20, seq_length=32768, mean_len=5000)


@pytest.fixture(params=[(c, s) for c in SMALL for s in SEEDS],
                ids=lambda p: f"{p[0][0]}-pp{p[0][1]}v{p[0][2]}d{p[0][3]}m{p[0][4]}"
                              f"L{len(p[0][5])}-s{p[1]}")
def small(request):
    return make(*request.param)
