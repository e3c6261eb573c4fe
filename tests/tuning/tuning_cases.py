"""Seeded small planning instances shared by the tuning tests (brute force is feasible)."""

from benchmarks.harness.synthetic_instances import random_instance

LEVELS5 = [14, 17, 20, 23, 26]
LEVELS3 = [17, 20, 23]
# (schedule, pp, vpp, dp, M, levels): at most 5**8 tables per replica for brute force.
SMALL = [("1f1b", 2, 1, 2, 3, LEVELS5), ("1f1b", 3, 1, 2, 2, LEVELS5),
         ("1f1b", 2, 1, 1, 4, LEVELS5), ("1f1b", 3, 1, 2, 3, LEVELS3),
         ("1f1b", 3, 1, 1, 4, LEVELS3), ("1f1b", 2, 1, 2, 4, [14, 20, 26]),
         ("interleaved", 2, 2, 1, 2, LEVELS3), ("interleaved", 2, 2, 2, 2, [14, 20, 26])]
SEEDS = (0, 1, 2)


def make(case, seed):
    """Instance of a SMALL case. Documents are long enough against the 256-token
    block that the budget matters for some micro-batches and not for others."""
    schedule, pp, vpp, dp, M, levels = case
    return random_instance(seed, schedule=schedule, pp=pp, vpp=vpp, dp=dp, microbatches=M,
                           levels=levels, k0=20, seq_length=32768, mean_len=5000)
