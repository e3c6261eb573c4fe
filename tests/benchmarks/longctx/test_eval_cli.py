"""Command lines: benchmarks/make_longctx_data.py, benchmarks/eval_longctx.py (usage errors),
examples/longctx/collect.py (result file shape, refusal on missing runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "examples", "longctx"))

import collect  # noqa: E402  (examples/longctx/collect.py)


def run(*argv, cwd=REPO):
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


def one_line_error(p, code=2):
    assert p.returncode == code, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_make_longctx_data_tiny_run(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 500, 2000, 900, 4000] * 20))
    out = tmp_path / "data"
    p = run("benchmarks/make_longctx_data.py", "--output-dir", str(out), "--num-train-docs", "30",
            "--train-lengths", "1024", "--max-tokens", "1024", "--lengths", str(lengths),
            "--eval-lengths", "1024,2048", "--eval-samples", "2")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["train_docs"] == 30 and summary["eval_samples"] == 5 * 2 * 2
    docs = [json.loads(x)["text"] for x in (out / "train.jsonl").read_text().splitlines()]
    assert len(docs) == 30 and all(len(d) <= 1024 for d in docs)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert {e["length"] for e in evals} == {1024, 2048}
    assert json.loads((out / "manifest.json").read_text())["eval_samples"] == 20


@pytest.mark.parametrize("argv, needle", [
    (["--train-lengths", "9000", "--max-tokens", "4096"], "lengths"),
    (["--eval-tasks", "nope"], "unknown task"),
    (["--train-lengths", "1k"], "integers"),
    (["--value-digits", "0"], "value_digits must be >= 1"),
    (["--filler-share", "2"], "filler_share"),
    (["--lengths", "/nonexistent/x.json"], "not found"),
    (["--bogus"], "unrecognized"),
])
def test_make_longctx_data_bad_input(tmp_path, argv, needle):
    out = tmp_path / "never"
    p = run("benchmarks/make_longctx_data.py", "--output-dir", str(out), *argv)
    assert needle in one_line_error(p)
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("argv, needle", [
    (["--load", "/nonexistent/ckpt", "--lengths", "1024", "--num-samples", "1"], "not a directory"),
    (["--load", "{tmp}", "--data", "{tmp}/missing.jsonl"], "cannot open"),
    (["--load", "{tmp}", "--tasks", "nope"], "task"),
    (["--load", "{tmp}", "--lengths", "100"], "length"),
    (["--load", "{tmp}", "--sb-topk", "4"], "--sparse-attention"),
    (["--load", "{tmp}", "--mode", "beam"], "invalid choice"),
    (["--load", "{tmp}", "--mode", "loglik", "--per-position"], "--per-position needs --mode greedy"),
    (["--lengths", "1024"], "--load"),
])
def test_eval_longctx_bad_input(tmp_path, argv, needle):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert needle in one_line_error(run("benchmarks/eval_longctx.py", *argv))


def _fake_run(root, arm, seed, acc, n=40, token_accuracy=None):
    """A run directory as train_arm.sh / eval_arm.sh leave it (numbers made up for the test);
    ``token_accuracy``: every cell's, if given."""
    d = root / arm / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "train_meta.json").write_text(json.dumps({"arm": arm, "seed": seed, "wall_clock_s": 100.0 + seed}))
    extra = {} if token_accuracy is None else {"token_accuracy": token_accuracy}
    table = {t: {str(L): {"accuracy": a, "correct": round(a * n), "n": n, **extra} for L, a in row.items()}
             for t, row in acc.items()}
    (d / "eval_dense.json").write_text(json.dumps({"attention": "dense", "mode": "greedy",
                                                   "accuracy": table}))


def test_collect_shape_and_arithmetic(tmp_path):
    base = {"niah_single": {1024: 1.0, 4096: 0.9, 8192: 0.5}, "freq_words": {4096: 0.2, 8192: 0.0}}
    worse = {"niah_single": {4096: 0.8, 8192: 0.4}, "freq_words": {4096: 0.2, 8192: 0.0}}
    for seed in (1, 2):
        _fake_run(tmp_path, "dense", seed, base, token_accuracy=0.25 * seed)
        _fake_run(tmp_path, "megatron", seed, worse)
        _fake_run(tmp_path, "sparsebalance", seed, base)
    out = collect.collect(str(tmp_path), ["dense", "megatron", "sparsebalance"], [1, 2])
    d = out["arms"]["dense"]
    assert set(d) >= {"needle_4k", "mean", "per_task", "seeds", "wall_clock_s"}
    assert d["needle_4k"] == pytest.approx(0.9) and d["seeds"] == [1, 2]
    assert d["mean"] == pytest.approx((0.9 + 0.5 + 0.2 + 0.0) / 4)  # 1K cell excluded
    assert d["per_task"]["niah_single"]["mean"] == pytest.approx(0.7)
    assert d["wall_clock_s"] == pytest.approx(101.5)
    assert d["token_accuracy"] == pytest.approx(0.375) and out["arms"]["megatron"]["token_accuracy"] is None
    c = out["checks"]
    assert c["dense_needle_4k_ge_0.9"] is True
    assert c["sparsebalance_vs_megatron"]["diff"] == pytest.approx(0.05)
    assert c["sparsebalance_vs_dense"]["within_2_points"] is True


def test_collect_refuses_missing_runs(tmp_path):
    _fake_run(tmp_path, "dense", 1, {"niah_single": {4096: 1.0, 8192: 1.0}})
    outfile = tmp_path / "res.json"
    p = run(os.path.join("examples", "longctx", "collect.py"), "--runs-dir", str(tmp_path),
            "--arms", "dense", "--seeds", "1", "2", "--output", str(outfile))
    assert "seed2" in one_line_error(p) and not outfile.exists()
