"""`make gpu-check`'s logic that needs no GPU: the no-CUDA exit, part order, isolation and
time budgets, pass/fail/skip aggregation, the report files and their merging, the targets,
the benchmark grid (target point first) and FLOP accounting, the per-backend bench worker
(finished points kept when it dies, time shares), the tests part's no-autotune switch and
junit summary, --bench-reps, the train / profile / accuracy parts with a fake runner, and
a dry run of the chain on the CPU."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


gc = _tool()
from benchmarks.harness.gpu import bench as gb  # noqa: E402  (gpu_check put the repository on sys.path)
from benchmarks.harness.gpu import checks as gk  # noqa: E402
from benchmarks.harness.gpu import proc as gp  # noqa: E402
from benchmarks.harness.gpu import report as gr  # noqa: E402


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_one_line_exit_0_nothing_written(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh")], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PY=sys.executable, GPU_CHECK_OUT=str(out)))
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
               fwd_tflops=300.0, fwd_bwd_tflops=250.0, dense_backend="flash")
    flex_row = dict(row, backend="flex", gate_share=0.178,
                    gate_parts_ms={"plan": 3.04, "layout": 1.0, "block_mask": 4.5})
    fa4_row = dict(row, backend="fa4", seq_len=131072, gate_share=0.03, gate_ms=0.31, route="fused",
                   gate_torch_ms=4.2)
    parts = [gc.Part("tests", True, 12.0, "10 passed"),
             gc.Part("bench", False, 30.0, "1 points, 1 failed", {"rows": [row, flex_row, fa4_row], "failed": ["x"]})]
    gc.write_report(str(tmp_path), parts, "NVIDIA H100")
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["device"] == "NVIDIA H100" and doc["passed"] is False
    assert [p["name"] for p in doc["parts"]] == ["tests", "bench"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| bench | **FAIL** | 30 | 1 points, 1 failed |" in md
    assert "| cuda | 65536 | 128 | 0.052 | 1.00 (10.00) | 5.00 (40.00) | flash | 250 | 0.52 | 0.42 | 2.0% |" in md
    assert "| 0.42 | 17.8% (plan 3.0, layout 1.0, mask 4.5 ms) |" in md
    assert "| 0.42 | 3.0% (gate 0.3 fused vs 4.2 torch ms) |" in md
    assert "- x" in md  # the failed point is listed
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_bench_grid_and_flops():
    pts = gb.bench_points([16384, 65536])
    # fa4 runs block 128 only, and adds the 0.5B preset's shape after the target
    assert len(pts) == 3 * 2 * 2 * 3 + 2 * 3 + 1
    assert pts[0]["backend"] == "fa4" and pts[-1]["backend"] == "cuda"
    assert {p["block"] for p in pts if p["backend"] == "fa4"} == {128}
    preset = [p for p in pts if p.get("shape")]
    assert [p["backend"] for p in preset] == ["fa4"] and pts[1] == preset[0]
    assert all((p["heads"], p["kv_heads"], p["head_dim"], p["seq_len"], p["block"], p["density"])
               == (14, 2, 64, 65536, 128, 0.12) for p in preset)
    pts = [p for p in pts if not p.get("shape") and p["backend"] != "fa4"]
    # inside a backend: the target point first, then its length at block 128, its length
    # at block 64, then the other lengths
    key = lambda p: (p["seq_len"], p["block"], p["density"])
    assert [key(p) for p in pts[:7]] == [(65536, 128, 0.12), (65536, 128, 0.05), (65536, 128, 0.25),
                                         (65536, 64, 0.12), (65536, 64, 0.05), (65536, 64, 0.25),
                                         (16384, 128, 0.12)]
    assert sorted(map(key, pts[:12])) == sorted(map(key, pts[12:24]))  # same grid per backend
    assert [p["backend"] for p in gb.bench_points([16384], ["cuda"])] == ["cuda"] * 6
    from sparsebalance.pairs import density

    for p in pts:  # the chosen top-k lands near the density asked for
        got = density([p["seq_len"]], p["topk"], p["block"])
        assert abs(got - p["density"]) < 0.15 * p["density"], (p, got)
    res = {"density": 0.5, "seq_len": 1000, "heads": 2, "head_dim": 64,
           "sparse_fwd_ms": 1.0, "sparse_ms": 3.5}
    pairs = 0.5 * 1000 * 1001 / 2 * 2
    f = gb.kept_tflops(res)
    assert f["fwd_tflops"] == pytest.approx(4 * pairs * 64 / 1e-3 / 1e12)
    assert f["fwd_bwd_tflops"] == pytest.approx(f["fwd_tflops"])  # 3.5x the work in 3.5x the time


def test_cuda_test_modules_are_found():
    mods = gk.cuda_test_modules()
    assert os.path.join("tests", "ops", "test_gpu_backends.py") in mods
    assert os.path.join("tests", "ops", "test_flex_gpu.py") in mods
    assert os.path.join("tests", "ops", "test_flex_backend.py") not in mods  # CPU tests
    assert os.path.join("tests", "deploy", "test_gpu_check.py") not in mods


def test_train_verdict():
    from benchmarks.harness.gpu import stages as st

    def summ(losses, tps, dens=None):
        return {"losses": losses, "tokens_per_s": tps, "peak_memory_mb_max": 9000.0, "step_ms_median": 900.0,
                "density_mean": dens, "plan_ms_median": 3.0, "attention_backend": "flex" if dens else None}

    down = [5.6 - 0.1 * i for i in range(8)]
    runs = [st.train_run_record("dense 65536", summ(down, 1e4)),
            st.train_run_record("sparse 65536", summ(down, 2.5e4, 0.08))]
    assert runs[0]["loss_first"] == pytest.approx(5.55) and runs[0]["loss_last"] == pytest.approx(4.95)
    ok, detail, data = st.train_verdict(runs, [65536])
    assert ok and data["speedup_64k"] == pytest.approx(2.5) and data["density_64k"] == 0.08
    assert detail.startswith("2/2 runs ok; sparse/dense tokens/s: speedup_64k 2.50x")
    flat = [runs[0], st.train_run_record("sparse 65536", summ([5.0] * 8, 2e4, 0.1))]
    ok, detail, _ = st.train_verdict(flat, [65536])
    assert not ok and "sparse 65536: loss did not decrease" in detail
    ok, detail, data = st.train_verdict([runs[0], {"name": "sparse 65536", "error": "CUDA out of memory"}], [65536])
    assert not ok and "speedup_64k" not in data and "sparse 65536: CUDA out of memory" in detail
    assert not st.train_verdict([], [65536])[0]
    # steps that compiled (two slow ones after the skipped warm-up) weigh on tokens/s but
    # not on the median step; both are reported
    d = {**summ(down, 1e4), "step_ms_all": [9e3] * 8, "step_tokens_all": [131072] * 8, "warmup_steps_skipped": 2}
    sp = {**summ(down, 1.6e4, 0.17), "step_ms_all": [40e3, 30e3, 2.6e3, 25e3, 2.6e3, 20e3, 2.6e3, 2.6e3],
          "step_tokens_all": [131072] * 8, "warmup_steps_skipped": 2, "flex_compiles": 6,
          "routing": "fused", "kernel_compiles_after_step_2": 0, "kernel_compiles_all": [5, 7, 7, 7, 7, 7, 7, 7],
          "kernel_compiles_by_kind": {"fa4": 5, "flex": 0, "route_kernels": 2}}
    runs = [st.train_run_record("dense 65536", d), st.train_run_record("sparse 65536", sp)]
    assert runs[1]["ms_per_1k_tokens_median"] == pytest.approx(2.6e3 / 131.072)
    assert runs[1]["flex_compiles"] == 6 and runs[0]["flex_compiles"] is None
    assert runs[1]["routing"] == "fused" and runs[0]["routing"] is None
    assert runs[1]["compiles_after_step_2"] == 0 and runs[1]["compiles_all"][:2] == [5, 7]
    assert runs[1]["compiles_by_kind"] == {"fa4": 5, "flex": 0, "route_kernels": 2}
    ok, detail, data = st.train_verdict(runs, [65536])
    assert data["median_step_speedup_64k"] == pytest.approx(9e3 / 2.6e3) and data["speedup_64k"] == 1.6
    assert "median_step_speedup_64k 3.46x" in detail and "; sparse compilations after step 2: 64k 0" in detail
    assert data["compiles_after_step_2_64k"] == 0
    # a profiled step (the last) is left out of the median step; its kernel split is kept
    prof = {**sp, "step_ms_all": sp["step_ms_all"] + [1e5], "step_tokens_all": [131072] * 9,
            "step_profiled_all": [False] * 8 + [True],
            "profile": {"attention_share": 0.25, "attention_ms": 500.0, "kernel_ms": 2000.0, "top_kernels": []}}
    rec = st.train_run_record("sparse 65536", prof)
    assert rec["ms_per_1k_tokens_median"] == pytest.approx(2.6e3 / 131.072)
    assert rec["attention_kernel_share"] == 0.25 and rec["kernel_ms"] == 2000.0


def test_part_budgets_argument():
    a = gc.parse_args(["--part-budgets", "profile=240,train=300"])
    assert a.part_budgets["profile"] == 240.0 and a.part_budgets["train"] == 300.0
    assert a.part_budgets["bench"] == gc.PART_BUDGET_S["bench"]
    for bad in ("profile", "nope=3", "train=-1", "train=x"):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(["--part-budgets", bad])
        assert e.value.code == 2


def _res(pt, dense_ms=40.0, sparse_ms=5.0):
    """A bench_attention.py result for one point."""
    return {"density": pt["density"], "seq_len": pt["seq_len"], "heads": 16, "head_dim": 128,
            "dense_fwd_ms": dense_ms / 4, "sparse_fwd_ms": sparse_ms / 4, "dense_ms": dense_ms,
            "sparse_ms": sparse_ms, "speedup": dense_ms / sparse_ms,
            "efficiency": dense_ms / sparse_ms * pt["density"], "gate_share": 0.02}


def test_bench_reps_argument():
    assert gc.parse_args([]).bench_reps == 3
    assert gc.parse_args(["--bench-reps", "7"]).bench_reps == 7
    assert gc.parse_args([]).bench_worker is None
    with pytest.raises(SystemExit) as e:
        gc.parse_args(["--bench-reps", "0"])
    assert e.value.code == 2
    helptext = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--help"],
                              capture_output=True, text=True, timeout=60).stdout
    assert "--bench-reps" in helptext and "--bench-worker" not in helptext


def test_bench_worker_keeps_going_after_a_failed_point(tmp_path, capsys):
    pts = gb.bench_points([16384], ["cuda"])[:4]
    (tmp_path / "pts.json").write_text(json.dumps(pts))
    out = tmp_path / "out.jsonl"
    calls = []

    def fake_main(argv):
        calls.append(argv)
        i = len(calls) - 1
        if i == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 8 GiB\nmore")
        if i == 2:
            sys.stderr.write("bench_attention.py: error: backend 'cuda' needs the extension\n")
            return 2
        target = argv[argv.index("--out") + 1]
        assert not os.path.exists(target)  # no stale result from the point before
        with open(target, "w") as fh:
            json.dump(_res(pts[i]), fh)
        return 0

    assert gb.bench_worker(str(tmp_path / "pts.json"), str(out), reps=5, bench_main=fake_main) == 0
    assert len(calls) == 4
    assert calls[0][:calls[0].index("--out")] == [
        "--seq-len", "16384", "--heads", "16", "--kv-heads", "2", "--head-dim", "128",
        "--block-size", "128", "--topk", str(pts[0]["topk"]), "--backend", "cuda", "--dtype", "bf16",
        "--reps", "5", "--json"]
    lines = gb.read_worker_lines(str(out))
    assert [x["point"] for x in lines] == pts
    assert lines[0]["result"] == _res(pts[0]) and lines[3]["result"] == _res(pts[3])
    assert lines[1]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 8 GiB"
    assert lines[2]["error"] == ("bench_attention.py exit code 2: bench_attention.py: error: "
                                 "backend 'cuda' needs the extension")
    assert "needs the extension" in capsys.readouterr().err  # still shown in the worker's log
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "pts.json"]  # the per-point file is gone


def test_bench_worker_runs_bench_attention_in_one_process(tmp_path):
    """The real worker process on CPU: bench_attention.py's main per point (the dry run's
    small layer, which the points name), a bad point recorded as an error and the next one
    still run."""
    pts = [dict(backend="cpu", seq_len=1024, block=64, density=0.4, topk=2, **gb.DRY_RUN_BENCH_SHAPE),
           dict(backend="cpu", seq_len=1024, block=0, density=0.4, topk=2, **gb.DRY_RUN_BENCH_SHAPE),
           dict(backend="cpu", seq_len=1024, block=128, density=0.5, topk=1, **gb.DRY_RUN_BENCH_SHAPE)]
    (tmp_path / "pts.json").write_text(json.dumps(pts))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--bench-worker",
                           str(tmp_path / "pts.json"), str(out), "--bench-reps", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr
    lines = gb.read_worker_lines(str(out))
    assert [x["point"] for x in lines] == pts
    assert lines[0]["result"]["block_size"] == 64 and lines[0]["result"]["reps"] == 1
    assert lines[0]["result"]["dtype"] == "bf16" and lines[0]["result"]["kv_heads"] == 2
    assert (lines[0]["result"]["heads"], lines[0]["result"]["head_dim"]) == (4, 64)  # the points' own shape
    assert "exit code 2" in lines[1]["error"] and "block-size" in lines[1]["error"]
    assert lines[2]["result"]["block_size"] == 128
    rows, failed = gb.collect_backend(pts, lines, subprocess.CompletedProcess([], 0, "", ""))
    assert [r["block"] for r in rows] == [64, 128] and len(failed) == 1


def test_bench_keeps_finished_points_when_a_worker_dies(monkeypatch):
    """One worker per backend with a fair share of the time left: the first is killed at
    its cap after two points (and a half-written line), the second crashes at once. The
    finished points are rows; every other point is failed with the worker's reason."""
    a = SimpleNamespace(seq_lens=[16384], backends=["triton", "cuda"], bench_reps=4)
    seen = []

    def fake_run(cmd, timeout, env=None):
        i = cmd.index("--bench-worker")
        pts_file, out_file = cmd[i + 1], cmd[i + 2]
        assert cmd[cmd.index("--bench-reps") + 1] == "4"
        with open(pts_file) as fh:
            pts = json.load(fh)
        seen.append((pts[0]["backend"], len(pts), timeout))
        if pts[0]["backend"] == "triton":
            with open(out_file, "w") as fh:
                for pt in pts[:2]:
                    fh.write(json.dumps({"point": pt, "result": _res(pt)}) + "\n")
                fh.write(json.dumps({"point": pts[2], "error": "RuntimeError: x"}) + "\n")
                fh.write('{"point": {"backend": "tri')  # killed mid-write
            return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout:.0f} s")
        return subprocess.CompletedProcess(cmd, -11, "", "warming up\nFatal Python error: Segmentation fault")

    monkeypatch.setattr(gp, "run", fake_run)
    part = gb.part_bench(a, 300.0)
    assert [(b, n) for b, n, _ in seen] == [("triton", 6), ("cuda", 6)]
    assert seen[0][2] == pytest.approx(150.0, abs=1.0)  # half of what is left, two backends to go
    assert seen[1][2] == pytest.approx(300.0, abs=1.0)  # the first gave its time back at once
    assert not part.passed
    assert [(r["backend"], r["block"], r["density"]) for r in part.data["rows"]] == [
        ("triton", 128, 0.12), ("triton", 128, 0.05)]
    assert part.data["rows"][0]["speedup"] == 8.0 and part.data["rows"][0]["fwd_bwd_tflops"] > 0
    failed = part.data["failed"]
    assert len(failed) == 10
    assert failed[0] == "triton 16384/128/0.25: RuntimeError: x"
    assert failed[1] == "triton 16384/64/0.12: not run: timed out after 150 s"
    assert failed[4] == ("cuda 16384/128/0.12: not run: worker exit code -11: "
                         "Fatal Python error: Segmentation fault")
    assert part.data["best_efficiency_64k_b128"] == {}
    assert part.detail.startswith("2 points, 10 failed")


def test_bench_no_time_left_and_all_points_passing(monkeypatch):
    a = SimpleNamespace(seq_lens=[65536], backends=["cuda", "triton"], bench_reps=3)

    def fake_run(cmd, timeout, env=None):
        i = cmd.index("--bench-worker")
        with open(cmd[i + 1]) as fh:
            pts = json.load(fh)
        with open(cmd[i + 2], "w") as fh:
            for pt in pts:
                fh.write(json.dumps({"point": pt, "result": _res(pt, sparse_ms=20.0 * pt["density"])}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gp, "run", fake_run)
    part = gb.part_bench(a, 100.0)
    assert part.passed and len(part.data["rows"]) == 12 and part.data["failed"] == []
    assert part.data["best_efficiency_64k_b128"] == {"cuda": pytest.approx(2.0), "triton": pytest.approx(2.0)}
    assert "64K block 128 density 0.12 (fwd+bwd): cuda 2.00, triton 2.00" in part.detail
    # 64K / block 128 of both backends first, then the rest (block 64) of both
    assert [(r["backend"], r["block"]) for r in part.data["rows"]][::3] == [
        ("cuda", 128), ("triton", 128), ("cuda", 64), ("triton", 64)]
    # 30 s left: the first-tier shares (10 s, then 15 s) and cuda's second-tier share
    # (15 s) are below the 20 s a worker needs; the last worker gets all 30 s.
    short = gb.part_bench(a, 30.0)
    assert not short.passed and [(r["backend"], r["block"]) for r in short.data["rows"]] == [("triton", 64)] * 3
    assert short.data["failed"][0] == "cuda 65536/128/0.12: no time left" and len(short.data["failed"]) == 9
    assert short.detail.startswith("3 points, 9 failed")


def test_bench_first_tier_shares_leave_one_share_to_the_second(monkeypatch):
    """Three backends at 64K: each first-tier worker gets what is left over the first-tier
    workers to come plus one share for the whole second tier; second-tier workers split
    what is left evenly; time a worker does not use goes to the next."""
    a = SimpleNamespace(seq_lens=[65536], backends=["flex", "triton", "cuda"], bench_reps=3)
    seen = []

    def fake_run(cmd, timeout, env=None):
        i = cmd.index("--bench-worker")
        with open(cmd[i + 1]) as fh:
            pts = json.load(fh)
        seen.append((pts[0]["backend"], pts[0]["block"], len(pts), round(timeout)))
        with open(cmd[i + 2], "w") as fh:
            for pt in pts:
                fh.write(json.dumps({"point": pt, "result": _res(pt)}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gp, "run", fake_run)
    part = gb.part_bench(a, 240.0)
    assert part.passed
    assert seen == [("flex", 128, 3, 60), ("triton", 128, 3, 80), ("cuda", 128, 3, 120),
                    ("flex", 64, 3, 80), ("triton", 64, 3, 120), ("cuda", 64, 3, 240)]
    workers = gb.bench_workers(gb.bench_points([16384, 65536], ["flex"]), ["flex"])
    assert [(t, len(p)) for t, p in workers] == [(True, 3), (False, 9)]
    assert workers[0][1][0]["density"] == 0.12  # the target point first


def test_tests_part_turns_triton_autotuning_off(monkeypatch, tmp_path):
    """One pytest per CUDA module, autotuning off, a slow module cut at its share while
    the next still runs, counts summed from each module's junit file."""
    calls = []

    def fake_run(cmd, timeout, env=None):
        calls.append((cmd, timeout, env))
        junit = next(c for c in cmd if c.startswith("--junitxml="))[len("--junitxml="):]
        mod = cmd[-1]
        if len(calls) == 1:  # the first module is killed after two tests: no junit file
            said = (f"{mod}::test_a[x] PASSED   [ 10%]\n{mod}::test_b FAILED   [ 20%]\n"
                    f"{mod}::test_c SKIPPED (no)   [ 30%]\n")
            return subprocess.CompletedProcess(cmd, 124, said, f"timed out after {timeout:.0f} s")
        with open(junit, "w") as fh:
            fh.write(f'<testsuite><testcase classname="{mod}" name="t1"/>'
                     f'<testcase classname="{mod}" name="t2"/></testsuite>')
        return subprocess.CompletedProcess(cmd, 0, "2 passed in 1.0s\n", "")

    monkeypatch.setattr(gp, "run", fake_run)
    mods = gk.cuda_test_modules()
    part = gk.part_tests(SimpleNamespace(work=str(tmp_path)), 300.0)
    assert [c[0][-1] for c in calls] == mods and len(mods) >= 3
    assert all(c[2] == {"SPARSEBALANCE_TRITON_AUTOTUNE": "0"} and "pytest" in c[0] for c in calls)
    assert calls[0][1] == pytest.approx(300.0 - 45.0 * (len(mods) - 1), abs=1.0)
    assert calls[-1][1] == pytest.approx(300.0, abs=2.0)  # the last may use all that is left
    assert not part.passed  # the hung module fails the part
    # the killed module's finished tests count, from its -v lines
    assert "-v" in calls[0][0]
    assert part.detail == f"{2 * (len(mods) - 1) + 1} passed, 1 failed, 1 skipped"
    first = mods[0][:-3].replace("/", ".")
    assert part.data["by_module"][first] == {"passed": 1, "failed": 1, "skipped": 1}
    assert part.data["failed_tests"][0] == f"{first}::test_b"
    assert part.data["per_module"][0].endswith(f"timed out after {calls[0][1]:.0f} s (1 passed, 1 failed "
                                               "before the cut)")
    assert part.data["per_module"][1].endswith(": 2 passed in 1.0s")
    assert gk.stdout_summary("no tests ran\n", "m") == {}



def test_parts_run_in_chain_order_with_their_own_budgets():
    seen = []

    def runner(name):
        def fn(a, left):
            seen.append((name, left))
            return gc.Part(name, True, detail="ok")
        return fn

    a = SimpleNamespace(parts=["profile", "tests", "deps"], budget_s=100.0,
                        part_budgets={"deps": 3.0, "tests": 40.0, "profile": 500.0})
    parts = gc.run_parts(a, {n: runner(n) for n in gc.PARTS})
    assert [p.name for p in parts] == ["deps", "tests", "profile"]  # the chain's order
    assert seen[0] == ("deps", 3.0) and seen[1] == ("tests", 40.0)
    assert 99.0 < seen[2][1] <= 100.0  # capped by what is left of the whole budget
    assert gc.PARTS == ("deps", "build", "tests", "bench", "train", "profile", "accuracy")


def test_optional_part_is_skipped_not_failed(tmp_path):
    def ok(a, left):
        return gc.Part("tests", True, detail="5 passed")

    a = SimpleNamespace(parts=["tests", "accuracy"], budget_s=5.5)

    def slow(a, left):
        import time
        time.sleep(0.6)
        return gc.Part("tests", True, detail="5 passed")

    parts = gc.run_parts(a, {"tests": slow, "accuracy": ok})
    assert [p.status for p in parts] == ["pass", "skip"]
    assert parts[1].detail.startswith("not started")
    doc = gc.write_report(str(tmp_path), parts, "NVIDIA H200")
    assert doc["passed"] is True  # a skipped optional part does not fail the check
    assert "| accuracy | skipped |" in (tmp_path / "gpu_check.md").read_text()


def _row(backend, eff, share, density=0.12, seq=65536, block=128):
    return dict(backend=backend, seq_len=seq, block=block, density=density, topk=40,
                density_measured=density, dense_fwd_ms=10.0, sparse_fwd_ms=2.0, dense_ms=40.0,
                sparse_ms=10.0, speedup_fwd=5.0, speedup=4.0, efficiency_fwd=0.6, efficiency=eff,
                gate_share=share, fwd_tflops=300.0, fwd_bwd_tflops=250.0, dense_backend="cudnn")


def test_targets_met_not_met_and_not_measured():
    from benchmarks.harness.gpu import report as gr

    def p(name, status="pass", detail="", data=None):
        return {"name": name, "status": status, "seconds": 1.0, "detail": detail, "data": data or {}}

    rows = [_row("flex", 0.62, 0.03), _row("triton", 0.40, 0.02), _row("cuda", 0.30, 0.02),
            _row("cuda", 0.99, 0.0, density=0.05),  # not the target point: ignored
            dict(_row("fa4", 0.48, 0.08), shape="qwen2.5-0.5b")]  # the 0.5B shape's own target only
    runs = [{"name": "sparse 65536", "device_busy_ms": 870.0, "profile_wall_ms": 1000.0, "compiles_after_step_2": 0},
            {"name": "sparse 131072", "device_busy_ms": 950.0, "profile_wall_ms": 1000.0, "compiles_after_step_2": 1,
             "compiles_late_by_kind": {"fa4": 0, "flex": 0, "route_kernels": 1}},
            {"name": "dense 131072", "device_busy_ms": 100.0, "profile_wall_ms": 1000.0, "compiles_after_step_2": 3}]
    parts = [p("tests", "fail", "1 failed, 30 passed",
               {"per_module": ["test_fa4_gpu.py: timed out after 56 s (4 passed)", "test_route_gpu.py: 7 passed"]}),
             p("bench", data={"rows": rows}),
             p("train", data={"speedup_64k": 1.6, "density_64k": 0.09, "speedup_128k": 1.82,
                              "density_128k": 0.05, "runs": runs}), p("profile", data={"mape": 0.07})]
    t = {x["target"]: x for x in gr.evaluate_targets(parts)}
    assert t["every GPU test passes"]["met"] is False
    assert t["every GPU test passes"]["note"] == "cut at its time share: test_fa4_gpu.py"
    assert t["best backend efficiency"]["value"] == 0.62 and t["best backend efficiency"]["met"] is True
    note = t["best backend efficiency"]["note"]
    assert note.startswith("flex at 64K") and "cudnn" in note
    assert t["efficiency at the 0.5B shape"]["value"] == 0.48 and t["efficiency at the 0.5B shape"]["met"] is False
    assert t["own kernel efficiency"]["value"] == 0.4 and t["own kernel efficiency"]["met"] is False
    assert t["routing + plan share"]["value"] == 0.03 and t["routing + plan share"]["met"] is True
    assert t["training 64K sparse / dense tokens/s"]["met"] is True  # 1.6 >= 1.5
    assert t["training 128K sparse / dense tokens/s"]["met"] is False  # 1.82 < 2.0
    busy = t["sparse step device busy / wall"]  # the lowest sparse run; the dense one is not judged
    assert busy["value"] == 0.87 and busy["met"] is False and "sparse 131072 95.0%" in busy["note"]
    late = t["sparse compilations after step 2"]
    assert late["value"] == 1 and late["met"] is False
    assert late["note"] == "sparse 65536: 0; sparse 131072: 1 (route_kernels 1)"
    assert t["latency predictor held-out MAPE"]["met"] is False
    skipped = [p("tests", data={"by_module": {"tests.ops.test_flex_gpu": {"passed": 0, "failed": 0, "skipped": 9}}})]
    t1 = {x["target"]: x for x in gr.evaluate_targets(skipped)}
    assert t1["every GPU test passes"]["met"] is None and t1["every GPU test passes"]["note"] == "no test ran"
    ran = [p("tests", data={"by_module": {"tests.ops.test_flex_gpu": {"passed": 9, "failed": 0, "skipped": 0}}})]
    assert gr.evaluate_targets(ran)[0]["met"] is True
    dense_too = [p("train", data={"speedup_128k": 2.4, "density_128k": 0.2})]
    t2 = {x["target"]: x for x in gr.evaluate_targets(dense_too)}
    assert t2["training 128K sparse / dense tokens/s"]["met"] is False  # density above 12%
    assert all(t2[n]["met"] is None for n in ("every GPU test passes", "best backend efficiency",
                                              "training 64K sparse / dense tokens/s", "sparse step device busy / wall",
                                              "sparse compilations after step 2", "latency predictor held-out MAPE"))


def test_report_merges_parts_of_earlier_runs_on_the_same_device(tmp_path):
    first = [gc.Part("deps", True, 1.0, "ok"), gc.Part("tests", False, 9.0, "2 failed")]
    gc.write_report(str(tmp_path), first, "NVIDIA H200")
    second = [gc.Part("tests", True, 8.0, "40 passed"), gc.Part("bench", True, 300.0, "72 points",
                                                                 {"rows": [_row("flex", 0.5, 0.03)]})]
    doc = gc.write_report(str(tmp_path), second, "NVIDIA H200")
    assert [(p["name"], p["status"]) for p in doc["parts"]] == [("deps", "pass"), ("tests", "pass"),
                                                                 ("bench", "pass")]
    assert doc["passed"] is True and json.loads((tmp_path / "gpu_check.json").read_text()) == doc
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| best backend efficiency | 0.5 | >= 0.6 (moonshot 0.8) | **not met** |" in md
    other = gc.write_report(str(tmp_path), [gc.Part("deps", True, 1.0, "ok")], "NVIDIA H100")
    assert [p["name"] for p in other["parts"]] == ["deps"]  # another device: a new report
    (tmp_path / "gpu_check.json").write_text("{broken")
    assert [p["name"] for p in gc.write_report(str(tmp_path), second, "NVIDIA H100")["parts"]] == [
        "tests", "bench"]


def test_report_keeps_earlier_bench_rows_and_test_modules_not_redone(tmp_path):
    # a lease: the fa4 bench and tests in one invocation, flex's in the next
    mods = lambda name, p, f: {name: {"passed": p, "failed": f, "skipped": 0}}
    first = [gc.Part("tests", True, 9.0, "4 passed", {"by_module": mods("tests.ops.test_fa4_gpu", 4, 0),
                                                      "failed_tests": []}),
             gc.Part("bench", True, 100.0, "7 points", {"rows": [_row("fa4", 0.55, 0.14)], "failed": [],
                                                       "best_efficiency_64k_b128": {"fa4": 0.55}})]
    gc.write_report(str(tmp_path), first, "NVIDIA H200")
    second = [gc.Part("tests", False, 9.0, "1 failed", {"by_module": mods("tests.ops.test_flex_gpu", 0, 1),
                                                        "failed_tests": ["tests.ops.test_flex_gpu::test_a"]}),
              gc.Part("bench", True, 100.0, "6 points", {"rows": [_row("flex", 0.30, 0.09)], "failed": [],
                                                        "best_efficiency_64k_b128": {"flex": 0.30}})]
    doc = gc.write_report(str(tmp_path), second, "NVIDIA H200")
    bench = next(p for p in doc["parts"] if p["name"] == "bench")
    assert [r["backend"] for r in bench["data"]["rows"]] == ["fa4", "flex"]
    assert bench["data"]["best_efficiency_64k_b128"] == {"fa4": 0.55, "flex": 0.30}
    tests = next(p for p in doc["parts"] if p["name"] == "tests")
    assert set(tests["data"]["by_module"]) == {"tests.ops.test_fa4_gpu", "tests.ops.test_flex_gpu"}
    assert tests["data"]["passed"] == 4 and tests["data"]["failed"] == 1 and tests["status"] == "fail"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| best backend efficiency | 0.55 | >= 0.6 (moonshot 0.8) | **not met** |" in md  # fa4's row is still there
    # the same backend redone replaces its rows
    third = [gc.Part("bench", True, 100.0, "1 point", {"rows": [_row("fa4", 0.60, 0.10)], "failed": [],
                                                      "best_efficiency_64k_b128": {"fa4": 0.60}})]
    bench = next(p for p in gc.write_report(str(tmp_path), third, "NVIDIA H200")["parts"] if p["name"] == "bench")
    assert sorted((r["backend"], r["efficiency"]) for r in bench["data"]["rows"]) == [("fa4", 0.60), ("flex", 0.30)]


def test_junit_summary(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.ops.test_flex_gpu" name="test_a"/>'
                   '<testcase classname="tests.ops.test_flex_gpu" name="test_b">'
                   '<failure message="\nAssertionError: out: 0.5 vs 0.1&#10;more"/></testcase>'
                   '<testcase classname="tests.ops.test_gpu_backends" name="test_c"><skipped/></testcase>'
                   '<testcase classname="tests.ops.test_gpu_backends" name="test_d"><error>RuntimeError: '
                   + "y" * 400 + '</error></testcase>'
                   '<testcase classname="" name="tests/ops/test_x.py"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    got = gk.junit_summary(str(xml), "tests/ops/test_x.py")
    assert got["by_module"] == {"tests.ops.test_flex_gpu": {"passed": 1, "failed": 1, "skipped": 0},
                                "tests.ops.test_gpu_backends": {"passed": 0, "failed": 1, "skipped": 1},
                                "tests/ops/test_x.py": {"passed": 0, "failed": 0, "skipped": 1}}
    assert got["failed_tests"] == ["tests.ops.test_flex_gpu::test_b", "tests.ops.test_gpu_backends::test_d"]
    # why each failed: the message's first line, capped (the report is read after the lease)
    why = got["failures"]
    assert why["tests.ops.test_flex_gpu::test_b"] == "AssertionError: out: 0.5 vs 0.1"
    assert why["tests.ops.test_gpu_backends::test_d"].startswith("RuntimeError: yyy")
    assert len(why["tests.ops.test_gpu_backends::test_d"]) == 300
    md = gr.render_markdown({"device": "X", "targets": [], "parts": [
        {"name": "tests", "status": "fail", "seconds": 1.0, "detail": "d", "data": got}]})
    assert "- `tests.ops.test_flex_gpu::test_b`: AssertionError: out: 0.5 vs 0.1" in md
    assert gk.junit_summary(str(tmp_path / "none.xml")) == {}


def _fake_driver(calls, tps, mape=0.03):
    """A runner standing in for make_corpus.py / pretrain_gpt.py / profile_latency.py /
    compare.py: records the command, writes what the real tool would."""

    def run(cmd, timeout, env=None):
        calls.append(cmd)
        tool = os.path.basename(cmd[1])
        if tool == "make_corpus.py":
            open(cmd[cmd.index("--output-prefix") + 1] + ".idx", "w").close()
        elif tool == "pretrain_gpt.py":
            sparse = "--sparse-balance" in cmd
            n = int(cmd[cmd.index("--seq-length") + 1])
            s = {"losses": [6.0 - 0.2 * i for i in range(8)], "tokens_per_s": tps(sparse, n),
                 "peak_memory_mb_max": 50000.0, "step_ms_median": 1000.0,
                 "density_mean": 0.07 if sparse else None, "plan_ms_median": 2.0 if sparse else None,
                 "attention_backend": cmd[cmd.index("--sb-attention-backend") + 1] if sparse else None}
            with open(cmd[cmd.index("--summary-json") + 1], "w") as fh:
                json.dump(s, fh)
        elif tool == "profile_latency.py":
            with open(cmd[cmd.index("--output") + 1], "w") as fh:
                fh.write("{}")
            return subprocess.CompletedProcess(cmd, 0, "log line\n" + json.dumps({"mape": mape, "n_heldout": 12}), "")
        elif tool == "compare.py":
            return subprocess.CompletedProcess(cmd, 0, json.dumps({"sab_speedup": 1.3}), "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_train_and_profile_use_the_bench_best_backend(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(gp, "run", _fake_driver(calls, lambda sparse, n: (3e4 if sparse else 1e4) * 32768 / n))
    a = SimpleNamespace(out=str(tmp_path), work=str(tmp_path / "work"), repo=REPO, dry_run=False,
                        lengths="gpudata/prolong.json",
                        train_seq_lens=[32768, 65536], parts=["train", "profile"], budget_s=900.0,
                        done=[gc.Part("bench", True, data={"rows": [_row("triton", 0.3, 0.02),
                                                                     _row("flex", 0.5, 0.03)]})])
    train = gc.RUNNERS["train"](a, 600.0)
    assert train.passed and train.data["speedup_64k"] == pytest.approx(3.0)
    runs = [c for c in calls if c[1] == "pretrain_gpt.py"]
    # sparse first: a lease cut short has run the arm that carries the claim
    assert [("--sparse-balance" in c, c[c.index("--seq-length") + 1]) for c in runs] == [
        (True, "32768"), (False, "32768"), (True, "65536"), (False, "65536")]
    for c in runs:
        assert c[c.index("--model-preset") + 1] == "qwen2.5-0.5b" and "--bf16" in c and "--cpu" not in c
        # the last step profiled: the attention kernels' share of a step
        assert "--use-pytorch-profiler" in c and c[c.index("--profile-step-end") + 1] == c[c.index("--train-iters") + 1]
    assert runs[0][runs[0].index("--sb-attention-backend") + 1] == "flex"  # the bench's best
    # the corpus: the long-document mix (make_corpus's --quantile), recorded with each run
    corpora = [c for c in calls if c[1] == "tools/make_corpus.py"]
    assert corpora and {c[c.index("--quantile") + 1] for c in corpora} == {str(gc.TRAIN_QUANTILE)}
    assert train.data["runs"][0]["corpus"] == {"lengths": "prolong.json", "quantile": gc.TRAIN_QUANTILE}
    a.train_backend = "fa4"  # --train-backend overrides the bench's choice
    calls.clear()
    gc.RUNNERS["train"](a, 600.0)
    sparse = [c for c in calls if c[1] == "pretrain_gpt.py" and "--sparse-balance" in c]
    assert {c[c.index("--sb-attention-backend") + 1] for c in sparse} == {"fa4"}
    a.train_backend = None
    profile = gc.RUNNERS["profile"](a, 200.0)
    assert profile.passed and profile.data["mape"] == 0.03 and profile.data["compare_sim"] == {"sab_speedup": 1.3}
    prof_cmd = next(c for c in calls if c[1] == "tools/profile_latency.py")
    assert "--validate" in prof_cmd and prof_cmd[prof_cmd.index("--sb-attention-backend") + 1] == "flex"
    sim = next(c for c in calls if c[1] == "benchmarks/compare.py")
    assert sim[sim.index("--mode") + 1] == "sim"
    assert sim[sim.index("--cost-model") + 1] == prof_cmd[prof_cmd.index("--output") + 1]


@pytest.mark.parametrize("stdout, passed", [
    ("OUT", True),  # the whole result, naming this profile, then no exit before the limit
    ('{"mape": 0.04, "output": "OUT"', False),  # cut while printing
    ('{"mape": 0.04, "output": "elsewhere.json"}', False),  # not this run's profile
    ("", False),  # cut while measuring
])
def test_profile_printed_then_held_up_is_kept_and_said(monkeypatch, tmp_path, stdout, passed):
    """Runs 5-7: profile_latency.py wrote its profile and (as far as is known) its result,
    then ran into its limit; a whole result naming this run's profile is kept, the late exit
    said, and the tool's output kept in the work folder."""
    calls = []
    fake = _fake_driver(calls, lambda sparse, n: 1e4)

    def run(cmd, timeout, env=None):
        proc = fake(cmd, timeout, env)
        if os.path.basename(cmd[1]) != "profile_latency.py":
            return proc
        prof = cmd[cmd.index("--output") + 1]
        out = stdout.replace("OUT", prof) if stdout != "OUT" else json.dumps({"mape": 0.04, "output": prof})
        return subprocess.CompletedProcess(cmd, 124, out, "timed out after 160 s")

    monkeypatch.setattr(gp, "run", run)
    a = SimpleNamespace(out=str(tmp_path), work=str(tmp_path / "work"), repo=REPO, dry_run=False,
                        lengths="gpudata/prolong.json", parts=["profile"], budget_s=900.0, done=[])
    part = gc.RUNNERS["profile"](a, 200.0)
    assert part.passed is passed
    if passed:
        assert part.data["mape"] == 0.04 and part.data["exited"] is False
        assert "did not exit before its limit" in part.detail
    else:
        assert part.detail == "profile_latency.py: timed out after 160 s"
    assert (tmp_path / "work" / "profile_latency.log").read_text().startswith("exit 124\n")


def test_train_fuses_the_loss_in_both_arms_from_64k(monkeypatch, tmp_path):
    """From 64K tokens both arms get Megatron-LM's linear fusion (the loss fused, in chunks),
    below it neither; each run's record says which."""
    calls = []
    monkeypatch.setattr(gp, "run", _fake_driver(calls, lambda sparse, n: (2e4 if sparse else 1e4) * 65536 / n))
    a = SimpleNamespace(out=str(tmp_path), work=str(tmp_path / "work"), repo=REPO, dry_run=False, lengths="prolong",
                        train_seq_lens=[32768, 65536, 131072], done=[])
    train = gc.RUNNERS["train"](a, 600.0)
    assert train.passed and train.data["speedup_128k"] == pytest.approx(2.0)
    runs = [c for c in calls if c[1] == "pretrain_gpt.py"]
    chunked = {("--sparse-balance" in c, c[c.index("--seq-length") + 1]):
               c[c.index("--sb-loss-chunk-tokens") + 1] if "--sb-loss-chunk-tokens" in c else None for c in runs}
    assert chunked == {(True, "32768"): None, (False, "32768"): None, (True, "65536"): "4096",
                       (False, "65536"): "4096", (True, "131072"): "4096", (False, "131072"): "4096"}
    for c in runs:
        linear = "--cross-entropy-fusion-impl" in c
        assert linear == (c[c.index("--seq-length") + 1] != "32768")
        assert not linear or ("--cross-entropy-loss-fusion" in c and c[c.index("--cross-entropy-fusion-impl") + 1]
                              == "linear")
    assert {r["name"]: r["loss_chunk_tokens"] for r in train.data["runs"]} == {
        "sparse 32768": 0, "dense 32768": 0, "sparse 65536": 4096, "dense 65536": 4096,
        "sparse 131072": 4096, "dense 131072": 4096}


def test_train_runs_only_the_arms_asked_for(monkeypatch, tmp_path):
    """--train-arms sparse (a lease too short for both arms): the sparse run alone, no ratio."""
    calls = []
    monkeypatch.setattr(gp, "run", _fake_driver(calls, lambda sparse, n: 2e4))
    a = gc.parse_args(["--out", str(tmp_path), "--parts", "train", "--train-seq-lens", "131072",
                       "--train-arms", "dense,sparse"])
    assert a.train_arms == ["sparse", "dense"]  # sparse first, whatever the order given
    a.train_arms = gc.parse_args(["--train-arms", "sparse"]).train_arms
    a.done = []
    train = gc.RUNNERS["train"](a, 600.0)
    runs = [c for c in calls if c[1] == "pretrain_gpt.py"]
    assert len(runs) == 1 and "--sparse-balance" in runs[0]
    assert train.passed and [r["name"] for r in train.data["runs"]] == ["sparse 131072"]
    assert "speedup_128k" not in train.data and "sparse/dense tokens/s: n/a" in train.detail


def test_train_fails_when_a_run_breaks_and_accuracy_needs_time(monkeypatch, tmp_path):
    calls = []
    good = _fake_driver(calls, lambda sparse, n: 1e4)

    def run(cmd, timeout, env=None):
        if "--sparse-balance" in cmd and "65536" in cmd:
            calls.append(cmd)
            return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory")
        return good(cmd, timeout, env)

    monkeypatch.setattr(gp, "run", run)
    a = SimpleNamespace(out=str(tmp_path), work=str(tmp_path / "work"), repo=REPO, dry_run=False, lengths="prolong",
                        train_seq_lens=[65536], done=[])
    part = gc.RUNNERS["train"](a, 600.0)
    assert not part.passed and "sparse 65536: pretrain_gpt.py: torch.OutOfMemoryError" in part.detail
    sparse = next(c for c in calls if "--sparse-balance" in c)
    assert sparse[sparse.index("--sb-attention-backend") + 1] == "auto"  # no bench: auto
    acc = gc.RUNNERS["accuracy"](a, 300.0)
    assert acc.status == "skip" and "300 s left" in acc.detail


def test_dry_run_on_the_cpu_writes_the_report(tmp_path):
    """The real chain's code paths with tiny sizes on the CPU: deps, build probe, bench with
    the cpu kernel at 1K tokens on a small layer (gpu_check.DRY_RUN_BENCH_SHAPE), accuracy
    skipped."""
    out = tmp_path / "dry"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--dry-run",
                           "--parts", "deps,build,bench,accuracy", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] is True and doc["device"] == "cpu (dry run)"
    assert [(p["name"], p["status"]) for p in doc["parts"]] == [
        ("deps", "pass"), ("build", "pass"), ("bench", "pass"), ("accuracy", "skip")]
    rows = doc["parts"][2]["data"]["rows"]
    assert len(rows) == 6 and {r["backend"] for r in rows} == {"cpu"} and all(r["seq_len"] == 1024 for r in rows)
    assert all({k: r[k] for k in gb.DRY_RUN_BENCH_SHAPE} == gb.DRY_RUN_BENCH_SHAPE for r in rows)
    assert [t["target"] for t in doc["targets"]][:2] == ["every GPU test passes", "best backend efficiency"]
    md = (out / "gpu_check.md").read_text()
    assert "**Dry run**" in md and "## Targets" in md and "| cpu | 1024 |" in md
    assert "gpu-check: target best backend efficiency" in proc.stdout


def test_last_json_reads_one_line_and_indented_objects():
    from benchmarks.harness.gpu import stages as st

    assert st.last_json('noise\n{"a": 1}\n') == {"a": 1}
    assert st.last_json('warn\n{\n "mape": 0.03,\n "b": [\n  1\n ]\n}\n') == {"mape": 0.03, "b": [1]}
    assert st.last_json('{"a": 1}\nnot json') == {"a": 1}
    assert st.last_json("nothing here") is None


def test_report_is_written_after_every_part(tmp_path):
    """A chain killed from outside (a 10-minute command limit) keeps its finished parts."""
    seen = []

    def ok(name):
        return lambda a, left: gc.Part(name, True, detail="ok")

    def killed(a, left):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))
        raise KeyboardInterrupt  # the kill: nothing after this line runs

    a = SimpleNamespace(parts=["deps", "build", "tests"], budget_s=100.0)
    with pytest.raises(KeyboardInterrupt):
        gc.run_parts(a, {"deps": ok("deps"), "build": ok("build"), "tests": killed},
                     on_part=lambda done: gc.write_report(str(tmp_path), done, "NVIDIA H200"))
    assert [p["name"] for p in seen[0]["parts"]] == ["deps", "build"]
    assert [p["name"] for p in json.loads((tmp_path / "gpu_check.json").read_text())["parts"]] == ["deps", "build"]


def test_bench_attention_picks_the_fastest_dense_kernel_that_runs(tmp_path):
    """--dense-backends: each SDPA kernel is timed, one that cannot run here (cuDNN on the
    CPU) is named with its error, the fastest is the baseline. flex cannot be benched on the CPU (no
    backward) and says so in one line."""
    bench = gb._bench_main()
    out = tmp_path / "b.json"
    rc = bench(["--seq-len", "512", "--heads", "2", "--head-dim", "32", "--block-size", "64",
                "--topk", "2", "--backend", "cpu", "--reps", "1", "--json", "--out", str(out),
                "--dense-backends", "math,cudnn"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["dense_backend"] == "math" and list(res["dense_ms_by_backend"]) == ["math"]
    assert "cudnn" in res["dense_failed"] and res["padding_ratio"] == 1.0
    assert res["dense_ms"] == res["dense_ms_by_backend"]["math"][1]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_attention.py"), "--seq-len", "512",
                           "--dense-backends", "flash,nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dense-backends" in proc.stderr and "Traceback" not in proc.stderr
    if not __import__("torch").cuda.is_available():
        proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_attention.py"), "--seq-len",
                               "512", "--backend", "flex"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "flex has no CPU backward" in proc.stderr


def test_best_backend_comes_from_this_run_or_an_earlier_piece(tmp_path):
    from benchmarks.harness.gpu import report as gr

    bench = gc.Part("bench", True, data={"rows": [_row("triton", 0.3, 0.02), _row("flex", 0.5, 0.03),
                                                   _row("cuda", 0.9, 0.01, density=0.05)]})
    assert gb.best_backend([bench]) == "flex"  # read at the target point, not the best anywhere
    assert gb.best_backend([]) == "auto"
    gc.write_report(str(tmp_path), [bench], "NVIDIA H200")
    earlier = gr.read_report(str(tmp_path), "NVIDIA H200")
    assert gb.best_backend([gc.Part("deps", True)], earlier) == "flex"
    assert gr.read_report(str(tmp_path), "NVIDIA H100") is None


def test_flex_gate_parts_times_plan_layout_and_mask():
    """bench_attention's breakdown of flex's gate, on the CPU's eager path: three timings,
    each of the function it names (the timer sees the plan, the layout, the mask)."""
    import torch

    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(REPO, "tools", "bench_attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from sparsebalance.ops.flex import FlexLayout
    from sparsebalance.ops.plan import RoutingPlan

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(650, 4, 32, generator=g), torch.randn(650, 2, 32, generator=g)
    cu = torch.tensor([0, 300, 400, 650], dtype=torch.int32)
    seen = []

    def timed(fn):
        out = fn()
        seen.append(type(out).__name__)
        return out, float(len(seen))

    got = mod.flex_gate_parts(q, k, cu, 2, 32, 32 ** -0.5, False, timed)
    assert got == (1.0, 2.0, 3.0)
    assert seen[:2] == [RoutingPlan.__name__, FlexLayout.__name__] and seen[2] == "BlockMask"


def test_profile_cv_leaves_each_mix_out_and_finds_the_one_the_features_miss(tmp_path, capsys):
    """benchmarks/harness/gpu/profile_cv.py: samples made exactly linear in the layer features are
    predicted to 1e-6 with each mix left out; one mix timed 30% slower than the features
    say shows up as that mix's error only, and in the MAPE."""
    from benchmarks.harness.gpu import profile_cv
    from sparsebalance.predictor.fitted import layer_features

    mixes = [[4096], [2048, 2048], [1024] * 4, [512] * 8, [3000, 1096], [256] * 16, [8192], [6000, 2192]]
    truth = {"fwd": np.array([2e-6, 1e-6, 3e-4, 0.05, 0.02, 0.4]), "bwd": np.array([5e-6, 2e-6, 6e-4, 0.1, 0.04, 0.9])}

    def samples(slow=None):
        out = []
        for mix in mixes:
            for topk in (2, 4, None):
                for ph in ("fwd", "bwd"):
                    ms = float(layer_features(mix, topk, 64) @ truth[ph]) * (1.3 if mix == slow else 1.0)
                    out.append({"kind": "layer", "phase": ph, "lengths": mix, "topk": topk, "ms": ms})
        return out + [{"kind": "output", "phase": ph, "lengths": [n], "topk": None, "ms": 1e-4 * n + 1}
                      for n in (2048, 8192) for ph in ("fwd", "bwd")]

    from sparsebalance.predictor.profile import FORMAT, VERSION

    def profile(s):
        return {"format": FORMAT, "version": VERSION, "model": {"block_size": 64},
                "hardware": {"gpu": "NVIDIA H200"}, "samples": s}

    exact = profile_cv.leave_one_mix_out(profile(samples()))
    assert exact["mixes"] == 8 and exact["items"] == 24 and exact["mape"] < 1e-6
    off = profile_cv.leave_one_mix_out(profile(samples(slow=[8192])))
    errs = {(r["max_len"], r["docs"]): abs(r["predicted_ms"] / r["measured_ms"] - 1) for r in off["heldout"]}
    assert errs[(8192, 1)] > 0.2 and off["mape"] > 0.02  # the slow mix, left out, is predicted by the others
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile(samples())))
    assert profile_cv.main(["--profile", str(prof)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["hardware"] == "NVIDIA H200" and printed["items"] == 24 and printed["mape"] < 1e-6
    with pytest.raises(ValueError, match="2 or more mixes"):
        profile_cv.leave_one_mix_out(profile(samples()[:6]))


def test_train_mix_estimate_reproduces_the_profiled_run_and_grows_with_document_length(tmp_path, capsys):
    """benchmarks/harness/gpu/train_mix.py: at the profiled run's own corpus the estimate is the
    measured kernel-time ratio; longer documents raise dense attention work and lower density."""
    from benchmarks.harness.gpu import train_mix

    runs = [{"name": "dense 4096", "kernel_ms": 300.0, "attention_kernel_ms": 100.0},
            {"name": "sparse 4096", "kernel_ms": 240.0, "attention_kernel_ms": 20.0}]
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"parts": [{"name": "train", "data": {"runs": runs}}]}))
    lengths = tmp_path / "l.json"
    lengths.write_text(json.dumps(list(range(50, 5000, 7))))
    assert train_mix.main(["--report", str(report), "--lengths", str(lengths), "--run-quantile", "0.999",
                           "--quantiles", "0.999,0.5", "--seq-len", "4096", "--block-size", "64",
                           "--num-docs", "300"]) == 0
    out = json.loads(capsys.readouterr().out)
    same, longer = out["estimates"]
    assert same["speedup_estimate"] == pytest.approx(300 / 240, abs=1e-3)
    assert same["speedup_if_sparse_attention_were_free"] == pytest.approx(300 / 220, abs=1e-3)
    assert longer["median_length"] > same["median_length"] and longer["density"] < same["density"]
    assert longer["dense_kernel_ms"] > same["dense_kernel_ms"]
    assert longer["speedup_estimate"] > same["speedup_estimate"]
    causal, kept = train_mix.pairs_per_token(np.array([4096, 10]), 8, 64)
    assert causal == pytest.approx((4096 * 4097 / 2 + 55) / 4106) and kept < causal
    assert train_mix.pairs_per_token(np.array([64, 10]), 8, 64) == pytest.approx(((64 * 65 / 2 + 55) / 74,) * 2)


def test_bench_detail_names_the_target_points_efficiency(monkeypatch):
    """Run 6 printed the 25%-density row's efficiency (0.83) as the 64K / block 128 figure;
    the detail and best_efficiency_64k_b128 hold the ~12% target point's (here 8 x 0.12)."""
    a = SimpleNamespace(seq_lens=[65536], backends=["fa4"], bench_reps=3)

    def fake_run(cmd, timeout, env=None):
        i = cmd.index("--bench-worker")
        with open(cmd[i + 1]) as fh:
            pts = json.load(fh)
        with open(cmd[i + 2], "w") as fh:
            for pt in pts:  # the same sparse time at every density: efficiency grows with it
                fh.write(json.dumps({"point": pt, "result": _res(pt, sparse_ms=5.0)}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gp, "run", fake_run)
    part = gb.part_bench(a, 100.0)
    assert max(r["efficiency"] for r in part.data["rows"]) == pytest.approx(2.0)
    assert part.data["best_efficiency_64k_b128"] == {"fa4": pytest.approx(0.96)}
    assert part.detail.endswith("density 0.12 (fwd+bwd): fa4 0.96")


def test_train_report_shows_where_each_profiled_step_goes():
    """The profile's kernel classes reach the run record and the report's breakdown table."""
    from benchmarks.harness.gpu.stages import train_run_record

    classes = {"weight_gemm": 1800.0, "attention": 325.0, "routing": 20.0, "loss": 400.0, "norm_elementwise": 700.0,
               "optimizer": 90.0, "communication": 0.0, "memory": 50.0, "other": 11.0}
    s = {"tokens_per_s": 1000.0, "losses": [2.0, 1.0],
         "profile": {"classes_ms": classes, "idle_ms": 250.0, "wall_ms": 3976.0, "kernel_ms": 3396.0,
                     "attention_ms": 325.0, "attention_share": 325 / 3396, "device_busy_ms": 3726.0}}
    rec = train_run_record("sparse-128k", s, device="NVIDIA H200")
    assert rec["kernel_classes_ms"] == classes and rec["profile_idle_ms"] == 250.0
    md = gr.render_markdown({"device": "X", "targets": [], "parts": [
        {"name": "train", "status": "pass", "seconds": 1.0, "detail": "d", "data": {"runs": [rec]}}]})
    row = next(line for line in md.splitlines() if line.startswith("| sparse-128k | 1800 |"))
    assert row.split(" | ")[1:3] == ["1800", "325"] and row.rstrip(" |").endswith("250 | 3976")
