"""Instance parsing and the ``python -m sparsebalance.tuning plan`` CLI."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tuning_cases import SMALL, make

from sparsebalance.pipeline import simulate
from sparsebalance.tuning import instance_from_json, instance_to_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "sparsebalance.tuning", "plan", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.fixture(scope="module")
def inst_json():
    return instance_to_json(make(SMALL[0], 1))


def _bad(d):
    def case(name, mutate, expect):
        a = copy.deepcopy(d)
        mutate(a)
        return (name, a, expect)

    return [
        case("ragged", lambda a: a["ops"][0].pop(), "micro-batches"),
        case("ragged", lambda a: a["ops"][1][0].append(a["ops"][1][0][0]), "stages"),
        case("monotone", lambda a: a["ops"][0][1][0].update(fwd=[[14, 3.0], [20, 2.0]]), "non-decreasing"),
        case("attn", lambda a: a["ops"][0][0][1].pop("attn"), "missing 'attn'"),
        case("k0", lambda a: a.update(k0=40), "outside"),
        case("levels", lambda a: a.update(levels=[10, 20]), "levels"),
        case("missing", lambda a: a.pop("pp"), "missing 'pp'"),
        case("sched", lambda a: a.update(schedule="interleaved"), "pp"),
    ]


def test_round_trip(inst_json):
    inst = instance_from_json(inst_json)
    again = instance_from_json(json.loads(json.dumps(instance_to_json(inst))))
    for n in ("fwd", "bwd", "attn"):
        assert np.array_equal(getattr(inst, n), getattr(again, n))


def test_curves_are_interpolated():
    d = {"pp": 1, "dp": 1, "microbatches": 1, "k0": 4, "kmin": 2, "kmax": 8,
         "ops": [[[{"fwd": [[2, 1.0], [6, 3.0]], "bwd": [[0, 2.0]], "attn": [[4, 10], [8, 30]]}]]]}
    inst = instance_from_json(d)
    assert list(inst.levels) == list(range(2, 9))
    assert np.allclose(inst.fwd[:, 0, 0, 0], [1.0, 1.5, 2.0, 2.5, 3.0, 3.0, 3.0])
    assert np.allclose(inst.bwd[:, 0, 0, 0], 2.0)
    assert np.allclose(inst.attn[:, 0, 0, 0], [10, 10, 10, 15, 20, 25, 30])


@pytest.mark.parametrize("i", range(8))
def test_bad_instances_raise(inst_json, i):
    name, bad, msg = _bad(inst_json)[i]
    with pytest.raises(ValueError, match=msg):
        instance_from_json(bad)


def test_cli_outputs(inst_json, tmp_path):
    f = tmp_path / "inst.json"
    f.write_text(json.dumps(inst_json))
    inst = instance_from_json(inst_json)
    outs = {}
    for policy, extra in (("critical-path", ["--attn-slack", "0.0"]),
                          ("anchor", ["--anchor", "mean", "--p", "0.3"])):
        r = run_cli("--instance", str(f), "--policy", policy, *extra, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert set(out) == {"budget", "step_ms", "baseline_step_ms", "attn", "baseline_attn",
                            "critical_path"}
        b = np.array(out["budget"])
        assert b.shape == (inst.dp, inst.microbatches, inst.stages)
        assert np.isin(b, inst.levels).all() and b.dtype.kind == "i"
        idx = inst.indices(b)
        fw, bw, at = inst.at(idx)
        res = simulate(fw, bw, p2p_ms=inst.p2p_ms)
        assert out["step_ms"] == pytest.approx(res.step_ms)
        assert out["critical_path"] == res.critical_path
        assert out["attn"] == pytest.approx(at.sum())
        assert out["baseline_attn"] == pytest.approx(inst.attn[inst.k0_index].sum())
        outs[policy] = out
    cp = outs["critical-path"]
    assert cp["attn"] >= cp["baseline_attn"] and cp["step_ms"] <= cp["baseline_step_ms"]


def test_cli_errors(inst_json, tmp_path):
    for i, (name, bad, _) in enumerate(_bad(inst_json)[:5]):
        f = tmp_path / f"bad{i}.json"
        f.write_text(json.dumps(bad))
        r = run_cli("--instance", str(f), "--json")
        assert r.returncode == 2, name
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr
    f = tmp_path / "junk.json"
    f.write_text("{not json")
    for args in (["--instance", str(f)], ["--instance", str(tmp_path / "none.json")],
                 ["--instance", str(f), "--policy", "nope"]):
        r = run_cli(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
