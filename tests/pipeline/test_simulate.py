"""The longest-path model against an independent step-by-step execution, and its outputs."""

import json

import numpy as np
import pytest

from sparsebalance.pipeline import op_id, rank_order, simulate
from sparsebalance.pipeline.trace import write_chrome_trace, write_gantt

CASES = [("1f1b", 1, 1, 3), ("1f1b", 2, 1, 4), ("1f1b", 4, 1, 3), ("1f1b", 4, 1, 8),
         ("interleaved", 2, 2, 4), ("interleaved", 3, 2, 6), ("interleaved", 4, 3, 8)]


def reference(schedule, pp, vpp, f, b, p2p):
    """Run each rank's op list in order; an op starts when its rank is free and its
    input has arrived (producer end + p2p between ranks). Returns (start, end) dicts."""
    S, M = pp * vpp, f.shape[0]
    orders = [rank_order(schedule, pp, r, M, vpp) for r in range(pp)]
    end, start, free, nxt = {}, {}, [0.0] * pp, [0] * pp
    while any(nxt[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if nxt[r] == len(orders[r]):
                continue
            ph, m, c = orders[r][nxt[r]]
            j = c * pp + r
            src = ("F", m, j - 1) if ph == "F" and j > 0 else \
                ("B", m, j + 1) if ph == "B" and j < S - 1 else \
                ("F", m, j) if ph == "B" else None
            if src is not None and src not in end:
                continue
            ready = 0.0 if src is None else end[src] + (p2p if src[2] % pp != r else 0.0)
            t0 = max(free[r], ready)
            start[(ph, m, j)] = t0
            end[(ph, m, j)] = free[r] = t0 + (f if ph == "F" else b)[m, j]
            nxt[r] += 1
            moved = True
        assert moved, "deadlock"
    return start, end


@pytest.mark.parametrize("schedule,pp,vpp,M", CASES)
@pytest.mark.parametrize("p2p", [0.0, 0.37])
def test_matches_reference_execution(schedule, pp, vpp, M, p2p):
    rng = np.random.default_rng(pp * 100 + M)
    D, S = 3, pp * vpp
    f = rng.uniform(0.5, 3.0, (D, M, S))
    b = f * rng.uniform(1.5, 2.5, (D, M, S))
    res = simulate(f, b, schedule=schedule, vpp=vpp, p2p_ms=p2p)
    ends = []
    for d in range(D):
        st, en = reference(schedule, pp, vpp, f[d], b[d], p2p)
        for (ph, m, j), t in st.items():
            p = 0 if ph == "F" else 1
            assert res.start_ms[d, p, m, j] == pytest.approx(t, abs=1e-9)
            assert res.end_ms[d, p, m, j] == pytest.approx(en[(ph, m, j)], abs=1e-9)
        ends.append(max(en.values()))
    assert np.allclose(res.replica_step_ms, ends)
    assert res.step_ms == pytest.approx(max(ends))
    # Busy + bubble = step on every rank of every replica; busy = own op time.
    assert np.allclose(res.replica_busy_ms + res.replica_bubble_ms, res.step_ms)
    for r in range(pp):
        own = [c * pp + r for c in range(vpp)]
        assert np.allclose(res.replica_busy_ms[:, r], (f + b)[:, :, own].sum(axis=(1, 2)))


@pytest.mark.parametrize("schedule,pp,vpp,M", CASES)
def test_critical_path_and_slack(schedule, pp, vpp, M):
    rng = np.random.default_rng(7 + M)
    D, S, p2p = 2, pp * vpp, 0.2
    f = rng.uniform(0.5, 3.0, (D, M, S))
    b = 2 * f
    res = simulate(f, b, schedule=schedule, vpp=vpp, p2p_ms=p2p)
    assert np.all(res.slack_ms >= -1e-9)
    slow = int(np.argmax(res.replica_step_ms))
    cp = res.critical_path
    assert all(f".d{slow}." in o for o in cp)
    # Consecutive critical ops are back to back (plus the hop latency across ranks),
    # the path starts at 0, ends at the step time and has zero slack.
    parse = {op_id(p, slow, m, s): (p, m, s) for p in range(2) for m in range(M)
             for s in range(S)}
    first, last = parse[cp[0]], parse[cp[-1]]
    assert res.start_ms[(slow, *first)] == pytest.approx(0.0)
    assert res.end_ms[(slow, *last)] == pytest.approx(res.step_ms)
    for a, c in zip(cp, cp[1:]):
        ea, sc = res.end_ms[(slow, *parse[a])], res.start_ms[(slow, *parse[c])]
        gap = sc - ea
        assert gap == pytest.approx(0.0, abs=1e-9) or gap == pytest.approx(p2p)
    for o in cp:
        assert res.slack[o] == pytest.approx(0.0, abs=1e-9)
    # Growing an op by less than its slack leaves the step unchanged; by more, grows it.
    p, m, s = np.unravel_index(np.argmax(res.slack_ms[slow]), res.slack_ms[slow].shape)
    sl = res.slack_ms[slow, p, m, s]
    assert sl > 0
    g = [f.copy(), b.copy()]
    g[p][slow, m, s] += 0.999 * sl
    assert simulate(*g, schedule=schedule, vpp=vpp, p2p_ms=p2p).step_ms == pytest.approx(
        res.step_ms)
    g[p][slow, m, s] += 0.5
    assert simulate(*g, schedule=schedule, vpp=vpp, p2p_ms=p2p).step_ms > res.step_ms + 0.4


@pytest.mark.parametrize("pp,M", [(2, 2), (4, 4), (4, 16), (8, 8)])
def test_uniform_1f1b_closed_form(pp, M):
    f, b = 1.0, 2.0
    res = simulate(np.full((1, M, pp), f), np.full((1, M, pp), b))
    assert res.step_ms == pytest.approx((M + pp - 1) * (f + b))
    assert np.allclose(res.bubble_ms, (pp - 1) * (f + b))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="fwd_ms"):
        simulate([[[1.0, 2.0], [1.0]]], [[[1.0, 2.0], [1.0, 1.0]]])
    with pytest.raises(ValueError, match="shapes differ"):
        simulate(np.ones((1, 2, 2)), np.ones((1, 3, 2)))
    with pytest.raises(ValueError, match=">= 0"):
        simulate(-np.ones((1, 2, 2)), np.ones((1, 2, 2)))
    with pytest.raises(ValueError, match="vpp"):
        simulate(np.ones((1, 4, 3)), np.ones((1, 4, 3)), schedule="interleaved", vpp=2)


def test_trace_and_gantt(tmp_path):
    rng = np.random.default_rng(0)
    f = rng.uniform(1, 2, (2, 4, 4))
    base = simulate(f, 2 * f, schedule="interleaved", vpp=2)
    tuned = simulate(0.9 * f, 1.8 * f, schedule="interleaved", vpp=2)
    tr = tmp_path / "t.json"
    write_chrome_trace(str(tr), {"baseline": base, "tuned": tuned})
    ev = json.loads(tr.read_text())["traceEvents"]
    ops = [e for e in ev if e["ph"] == "X"]
    assert len(ops) == 2 * 2 * 2 * 4 * 4
    assert {e["pid"] for e in ops} == {0, 1, 2, 3}
    assert sum(e["args"]["critical"] for e in ops) == len(base.critical_path) + len(
        tuned.critical_path)
    png = tmp_path / "g.png"
    write_gantt(str(png), {"baseline": base, "tuned": tuned})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
