"""`make gpu-check`'s logic that needs no GPU: the no-CUDA exit, part isolation and the
time budget, the report files, the benchmark grid and FLOP accounting, the train verdict."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "tools", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


gc = _tool()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_one_line_exit_0_nothing_written(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_check.sh")], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PY=sys.executable, OUT=str(out)))
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: no CUDA device")
    assert not out.exists()


def test_parts_are_isolated_and_budgeted(tmp_path, capsys):
    def ok(a, left):
        return gc.Part("deps", True, detail="fine")

    def boom(a, left):
        raise RuntimeError("kernel exploded\nsecond line")

    def slow(a, left):
        import time
        time.sleep(0.3)
        return gc.Part("tests", False, detail="2 failed")

    a = SimpleNamespace(parts=["deps", "build", "tests", "bench"], budget_s=5.25)
    parts = gc.run_parts(a, {"deps": ok, "build": boom, "tests": slow, "bench": ok})
    assert [p.name for p in parts] == ["deps", "build", "tests", "bench"]
    assert [p.passed for p in parts] == [True, False, False, False]
    assert parts[1].detail == "RuntimeError: kernel exploded"
    assert parts[3].detail.startswith("not started")  # 5.25 s budget, < 5 s left after tests
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("gpu-check: build: FAIL")


def test_report_files(tmp_path):
    row = dict(backend="cuda", seq_len=65536, block=128, density=0.05, topk=49, density_measured=0.052,
               dense_fwd_ms=10.0, sparse_fwd_ms=1.0, dense_ms=40.0, sparse_ms=5.0, speedup_fwd=10.0,
               speedup=8.0, efficiency_fwd=0.52, efficiency=0.416, gate_share=0.02,
               fwd_tflops=300.0, fwd_bwd_tflops=250.0)
    parts = [gc.Part("tests", True, 12.0, "10 passed"),
             gc.Part("bench", False, 30.0, "1 points, 1 failed", {"rows": [row], "failed": ["x"]})]
    gc.write_report(str(tmp_path), parts, "NVIDIA H100")
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["device"] == "NVIDIA H100" and doc["passed"] is False
    assert [p["name"] for p in doc["parts"]] == ["tests", "bench"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| bench | **FAIL** | 30 | 1 points, 1 failed |" in md
    assert "| cuda | 65536 | 128 | 0.052 | 1.00 (10.00) | 5.00 (40.00) | 250 | 0.52 | 0.42 | 2.0% |" in md
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_bench_grid_and_flops():
    pts = gc.bench_points([16384, 65536])
    assert len(pts) == 2 * 2 * 2 * 3
    assert pts[0]["backend"] == "cuda" and pts[-1]["backend"] == "triton"
    from sparsebalance.attention.routing import density

    for p in pts:  # the chosen top-k lands near the density asked for
        got = density([p["seq_len"]], p["topk"], p["block"])
        assert abs(got - p["density"]) < 0.15 * p["density"], (p, got)
    res = {"density": 0.5, "seq_len": 1000, "heads": 2, "head_dim": 64,
           "sparse_fwd_ms": 1.0, "sparse_ms": 3.5}
    pairs = 0.5 * 1000 * 1001 / 2 * 2
    f = gc.kept_tflops(res)
    assert f["fwd_tflops"] == pytest.approx(4 * pairs * 64 / 1e-3 / 1e12)
    assert f["fwd_bwd_tflops"] == pytest.approx(f["fwd_tflops"])  # 3.5x the work in 3.5x the time


def test_cuda_test_modules_are_found():
    mods = gc.cuda_test_modules()
    assert os.path.join("tests", "ops", "test_gpu_backends.py") in mods
    assert os.path.join("tests", "deploy", "test_gpu_check.py") not in mods


def test_train_verdict():
    base = {"tokens_per_s": 1e5, "step_ms_median": 900.0, "density_mean": 0.2, "plan_ms_median": 3.0}
    good = gc.check_train_summary(dict(base, losses=[5.6 - 0.1 * i for i in range(20)]))
    assert good.passed and "loss 5.400 -> 3.900" in good.detail
    flat = gc.check_train_summary(dict(base, losses=[5.0] * 20))
    assert not flat.passed
    missing = gc.check_train_summary({"losses": [5.0] * 20})
    assert not missing.passed and "lacks" in missing.detail
