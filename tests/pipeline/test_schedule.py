"""Op-order invariants of the schedule model, over a (pp, vpp, M) grid."""

import itertools

import pytest

from sparsebalance.pipeline import all_rank_orders, rank_order, schedule_table
from sparsebalance.pipeline.graph import build_graph

GRID = [("1f1b", pp, 1, M, None) for pp in (1, 2, 3, 4, 8) for M in (1, 2, 3, 4, 7, 16)]
GRID += [("interleaved", pp, v, M, None) for pp in (2, 3, 4) for v in (1, 2, 3)
         for M in (pp, 2 * pp, 3 * pp)]
# microbatch_group_size_per_vp_stage other than pp (final group 0 or >= pp).
GRID += [("interleaved", 2, 2, 5, 3), ("interleaved", 3, 2, 7, 4), ("interleaved", 2, 3, 8, 8),
         ("interleaved", 4, 2, 12, 8)]


def _stage(pp, rank, chunk):
    return chunk * pp + rank


@pytest.mark.parametrize("schedule,pp,vpp,M,group", GRID)
def test_each_op_once_and_forward_before_backward(schedule, pp, vpp, M, group):
    orders = all_rank_orders(schedule, pp, M, vpp, group)
    assert len(orders) == pp
    for r, ops in enumerate(orders):
        want = {(ph, m, c) for ph in "FB" for m in range(M) for c in range(vpp)}
        assert len(ops) == len(want) and set(ops) == want
        pos = {op: i for i, op in enumerate(ops)}
        for m, c in itertools.product(range(M), range(vpp)):
            assert pos[("F", m, c)] < pos[("B", m, c)]
        # Within a chunk, micro-batches run in order (the data iterator relies on it).
        for ph, c in itertools.product("FB", range(vpp)):
            ms = [m for p, m, cc in ops if p == ph and cc == c]
            assert ms == sorted(ms)


@pytest.mark.parametrize("schedule,pp,vpp,M,group", GRID)
def test_receive_before_send_and_counts_balanced(schedule, pp, vpp, M, group):
    """Executing the ranks' orders with blocking receives never deadlocks, every
    receive matches an earlier send, and sends equal receives on every link."""
    orders = all_rank_orders(schedule, pp, M, vpp, group)
    S = pp * vpp
    done, sent, recv = set(), {}, {}
    nxt = [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            if nxt[r] == len(orders[r]):
                continue
            ph, m, c = orders[r][nxt[r]]
            j = _stage(pp, r, c)
            need = ("F", m, j - 1) if ph == "F" and j > 0 else \
                ("B", m, j + 1) if ph == "B" and j < S - 1 else \
                ("F", m, j) if ph == "B" else None
            if need is not None and need not in done:
                continue
            if need is not None and need[2] != j:
                link = (need[2], j)
                recv[link] = recv.get(link, 0) + 1
                assert recv[link] <= sent.get(link, 0)
            done.add((ph, m, j))
            out = (j, j + 1) if ph == "F" and j < S - 1 else \
                (j, j - 1) if ph == "B" and j > 0 else None
            if out is not None:
                sent[out] = sent.get(out, 0) + 1
            nxt[r] += 1
            progress = True
    assert all(nxt[r] == len(orders[r]) for r in range(pp)), "deadlock"
    assert sent == recv
    assert all(v == M for v in sent.values()) and len(sent) == 2 * (S - 1)
    build_graph(schedule, pp, M, vpp, group)  # the engine's graph is acyclic too


@pytest.mark.parametrize("pp,M", [(1, 3), (2, 1), (4, 2), (4, 8), (8, 32)])
def test_1f1b_warmup(pp, M):
    for r in range(pp):
        ops = rank_order("1f1b", pp, r, M)
        w = min(pp - r - 1, M)
        lead = next((i for i, op in enumerate(ops) if op[0] == "B"), len(ops))
        assert lead == min(w + 1, M)
        assert ops[-w:] == [("B", M - w + i, 0) for i in range(w)] if w else True


def test_interleaved_warmup_and_group():
    # pp=2, vpp=2, M=4: warm-up (pp - r - 1) * 2 + (vpp - 1) * group forwards.
    assert [op for op in rank_order("interleaved", 2, 0, 4, 2)[:5]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0)]
    assert rank_order("interleaved", 2, 0, 4, 2)[5] == ("B", 0, 1)
    assert rank_order("interleaved", 2, 1, 4, 2)[3] == ("B", 0, 1)
    # megatron's documented table for M=5, group=3, vpp=2.
    assert [m for m, _ in schedule_table(5, 2, 3)] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in schedule_table(5, 2, 3)] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    g3 = rank_order("interleaved", 3, 0, 6, 2, group=6)
    assert [op for op in g3 if op[0] == "F"][:7] == [("F", m, 0) for m in range(6)] + [
        ("F", 0, 1)]


@pytest.mark.parametrize("args,msg", [
    (("1f1b", 2, 4, 2), "vpp"), (("interleaved", 1, 4, 2), "pp >= 2"),
    (("interleaved", 4, 2, 2), "group"), (("interleaved", 4, 5, 2), "group"),
    (("interleaved", 3, 7, 2, 3), "M % group"), (("pipedream", 2, 4, 1), "schedule")])
def test_bad_configs_raise(args, msg):
    with pytest.raises(ValueError, match=msg):
        rank_order(args[0], args[1], 0, args[2], *args[3:])
