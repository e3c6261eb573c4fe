"""The model's per-rank op order equals megatron-core's real schedules (CPU, gloo).

Runs ``megatron_order_worker.py`` (PP=2 and PP=4, 1F1B and interleaved) and
compares, rank by rank, the order in which megatron called each chunk's forward
and backward with :func:`sparsebalance.pipeline.rank_order`. Also checks that
the budget hook handed every forward its planned (micro-batch, stage) budget.
"""

import json
import os
import subprocess
import sys

import pytest

from sparsebalance.pipeline import rank_order

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from megatron_order_worker import plan_budget  # noqa: E402

CASES = {2: [(1, 4), (1, 1), (2, 4), (2, 6)],
         4: [(1, 6), (1, 2), (2, 4), (2, 8)]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """pp -> (the worker recording every case of ``CASES[pp]``, its output JSON, its stderr
    file): both workers start at once, so that one's imports overlap the other's."""
    d = tmp_path_factory.mktemp("order")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = {}
    try:
        for pp in sorted(CASES):
            runs = ",".join(f"{v}:{m}" for v, m in CASES[pp])
            err = open(d / f"pp{pp}.err", "w+")
            procs[pp] = (subprocess.Popen([sys.executable, os.path.join(HERE, "megatron_order_worker.py"),
                                           "--pp", str(pp), "--runs", runs, "--out", str(d / f"pp{pp}.json")],
                                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err),
                         d / f"pp{pp}.json", err)
        yield procs
    finally:
        for proc, _, err in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda p: f"pp{p}")
def recorded(request, launched):
    pp = request.param
    proc, out, err = launched[pp]
    rc = proc.wait(timeout=400)
    err.seek(0)
    assert rc == 0, err.read()[-3000:]
    with open(out) as fh:
        return pp, json.load(fh)


def test_op_order_matches_megatron(recorded):
    pp, results = recorded
    assert len(results) == len(CASES[pp])
    for (vpp, M), res in zip(CASES[pp], results):
        assert sorted(res) == [str(r) for r in range(pp)]
        schedule = "interleaved" if vpp > 1 else "1f1b"
        for r in range(pp):
            real = [tuple(op) for op in res[str(r)]["order"]]
            assert len(real) == 2 * M * vpp, (vpp, M, r)
            model = rank_order(schedule, pp, r, M, vpp)
            assert real == model, f"pp={pp} vpp={vpp} M={M} rank={r}"


def test_budget_hook_delivers_plan(recorded):
    pp, results = recorded
    for (vpp, M), res in zip(CASES[pp], results):
        plan = plan_budget(1, M, pp * vpp)
        for r in range(pp):
            got = res[str(r)]["budgets"]
            assert len(got) == M * vpp
            for m, chunk, batch_mb, budget in got:
                assert batch_mb == m
                assert budget == plan[0][m][chunk * pp + r]
