"""``step_ms`` and ``step_ms_rows`` (the packers' batched step time) give the very floats of
``simulate``, so a packer scoring candidates with them decides as with the timeline."""

import numpy as np
import pytest

from sparsebalance.pipeline import simulate, step_ms, step_ms_rows, step_ms_scaled

CASES = [("1f1b", 1, 1, 3), ("1f1b", 2, 1, 4), ("1f1b", 4, 1, 3), ("1f1b", 8, 1, 32),
         ("interleaved", 2, 2, 4), ("interleaved", 4, 3, 8)]


def durations(rng, shape, empty):
    """Random fwd/bwd ms; ``empty`` micro-batches cost 0 on every stage (as the packers'
    empty bins do)."""
    f = rng.uniform(0.5, 3.0, shape)
    b = f * rng.uniform(1.5, 2.5, shape)
    if empty:
        f[..., empty, :] = 0.0
        b[..., empty, :] = 0.0
    return f, b


@pytest.mark.parametrize("schedule,pp,vpp,M", CASES)
@pytest.mark.parametrize("p2p", [0.0, 0.37])
def test_step_ms_is_the_timelines_step_time_exactly(schedule, pp, vpp, M, p2p):
    rng = np.random.default_rng(pp * 100 + M)
    f, b = durations(rng, (5, M, pp * vpp), empty=[M - 1])
    want = simulate(f, b, schedule=schedule, vpp=vpp, p2p_ms=p2p).replica_step_ms
    got = step_ms(f, b, schedule=schedule, vpp=vpp, p2p_ms=p2p)
    assert got.shape == (5,) and np.array_equal(got, want)  # equal floats, not approx
    # Leading dimensions are independent instances.
    got2 = step_ms(f.reshape(5, 1, M, -1), b.reshape(5, 1, M, -1), schedule=schedule, vpp=vpp,
                   p2p_ms=p2p)
    assert got2.shape == (5, 1) and np.array_equal(got2[:, 0], want)


@pytest.mark.parametrize("schedule,pp,vpp,M", CASES)
@pytest.mark.parametrize("p2p", [0.0, 0.37])
def test_step_ms_rows_equals_step_ms_of_the_gathered_times(schedule, pp, vpp, M, p2p):
    rng = np.random.default_rng(pp * 7 + M)
    R, B = 3 * M, 40
    fr, br = durations(rng, (R, pp * vpp), empty=[0])
    seq = rng.integers(0, R, (B, M))
    seq[0] = 0  # an instance of empty micro-batches only
    seq[1:, 0] = 1
    want = step_ms(fr[seq], br[seq], schedule=schedule, vpp=vpp, p2p_ms=p2p)
    got = step_ms_rows(fr, br, seq, schedule=schedule, vpp=vpp, p2p_ms=p2p)
    assert np.array_equal(got, want) and np.all(want[1:] > want[0])  # empty: only the hops


@pytest.mark.parametrize("schedule,pp,vpp,M", CASES)
def test_step_ms_scaled_equals_step_ms_of_the_scaled_times(schedule, pp, vpp, M):
    rng = np.random.default_rng(pp * 11 + M)
    f0, b0 = durations(rng, (pp * vpp,), empty=[])
    x = rng.uniform(0.05, 3.0, (30, M))
    want = step_ms(x[:, :, None] * f0, x[:, :, None] * b0, schedule=schedule, vpp=vpp)
    assert np.array_equal(step_ms_scaled(x, f0, b0, schedule=schedule, vpp=vpp), want)


def test_step_ms_rows_bad_shapes():
    with pytest.raises(ValueError, match="seq"):
        step_ms_rows(np.ones((4, 2)), np.ones((4, 3)), np.zeros((2, 3), dtype=int))
    with pytest.raises(ValueError, match="seq"):
        step_ms_rows(np.ones((4, 2)), np.ones((4, 2)), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="x must be"):
        step_ms_scaled(np.ones(3), np.ones(2), np.ones(2))
