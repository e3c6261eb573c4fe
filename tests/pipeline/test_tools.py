"""benchmarks/simulate.py and tools/timeline.py: outputs written, bad input -> exit 2."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tool(name, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    folder = "benchmarks" if name == "simulate.py" else "tools"
    return subprocess.run([sys.executable, os.path.join(ROOT, folder, name), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_simulate_synth_and_run(tmp_path):
    inst = tmp_path / "inst.json"
    r = tool("simulate.py", "synth", "--pp", "3", "--dp", "2", "--microbatches", "4",
             "--levels", "16,24,32,40", "--k0", "32", "--out", str(inst))
    assert r.returncode == 0, r.stderr
    trace, png = tmp_path / "s.trace.json", tmp_path / "s.png"
    r = tool("simulate.py", "run", "--instance", str(inst), "--trace", str(trace),
             "--gantt", str(png))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["step_ms"] <= out["baseline_step_ms"] and out["attn"] >= out["baseline_attn"]
    ev = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == 2 * 2 * 2 * 4 * 3  # static + plan
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(out["cut_share"]) == 3 and all(0 <= x <= 1 for x in out["cut_share"])
    assert all(c + r <= 1 for c, r in zip(out["cut_share"], out["raised_share"]))


def test_simulate_stage_layers_and_floor(tmp_path):
    """from-lengths prices the stages a split holds; run plans with the per-stage or the total floor."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([int(x) for x in np.random.default_rng(1).lognormal(7, 1.2, 400)]))
    shape = ["--num-layers", "6", "--seq-length", "4096", "--block-size", "64", "--pp", "2", "--dp", "1",
             "--microbatches", "4", "--k0", "8", "--levels", "4,6,8,10,12"]
    steps = {}
    for split in ("3,3", "5,1"):
        inst = tmp_path / f"{split}.json"
        r = tool("simulate.py", "from-lengths", "--lengths", str(lengths), *shape, "--stage-layers", split,
                 "--out", str(inst))
        assert r.returncode == 0, r.stderr
        for floor in ("stage", "total"):
            r = tool("simulate.py", "run", "--instance", str(inst), "--floor", floor)
            assert r.returncode == 0, r.stderr
            steps[split, floor] = json.loads(r.stdout)
    assert steps["3,3", "stage"]["baseline_step_ms"] != steps["5,1", "stage"]["baseline_step_ms"]
    assert all(len(s["cut_share"]) == 2 for s in steps.values())
    r = tool("simulate.py", "from-lengths", "--lengths", str(lengths), *shape, "--stage-layers", "3,2",
             "--out", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "stage_layers" in r.stderr


def test_timeline_and_errors(tmp_path):
    f = np.random.default_rng(0).uniform(1, 2, (1, 4, 2))
    tl = tmp_path / "m.json"
    tl.write_text(json.dumps({"fwd_ms": f.tolist(), "bwd_ms": (2 * f).tolist()}))
    r = tool("timeline.py", "--timeline", f"measured={tl}", "--gantt", str(tmp_path / "t.png"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["measured"]["step_ms"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fwd_ms": [[[1.0]]]}))
    for name, args in (("timeline.py", ["--timeline", str(bad)]),
                       ("simulate.py", ["run", "--instance", str(bad)]),
                       ("simulate.py", ["run"])):
        r = tool(name, *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
