"""CLI: JSON shape of a tiny run; bad input -> one line on stderr, exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparsebalance.batching.cli import main

SUMMARY_KEYS = {"imbalance_rank", "imbalance_microbatch", "predicted_step_ms", "tokens",
                "capacity_use", "empty_microbatches",
                "predicted_ms_per_ktok", "lower_bound_ms_per_ktok", "carried_docs", "pack_ms"}

TINY = ["--dp", "2", "--micro-batches", "2", "--seq-length", "4096", "--pp", "2",
        "--cost-model", "h100-analytic", "--steps", "3", "--seed", "0"]


@pytest.fixture
def lengths_file(tmp_path):
    p = tmp_path / "lengths.json"
    p.write_text(json.dumps([300, 5000, 1200, 800, 4096, 90, 2500, 3100, 60, 700] * 4))
    return p


@pytest.mark.parametrize("strategy", ["sab", "megatron", "concat"])
def test_pack_json(lengths_file, capsys, strategy):
    argv = ["pack", "--lengths", str(lengths_file), "--strategy", strategy, "--json"] + TINY
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["summary"]) == SUMMARY_KEYS
    assert len(out["steps"]) == 3
    step = out["steps"][0]
    assert len(step["ranks"]) == 2 and len(step["ranks"][0]) == 2
    assert all(sum(s[2] for s in mb) <= 4096 for r in step["ranks"] for mb in r)
    assert len(step["predicted_ms"]["rank"]) == 2
    assert out["summary"]["tokens"] == sum(s[2] for st in out["steps"] for r in st["ranks"]
                                           for mb in r for s in mb)
    assert out["summary"]["capacity_use"] == pytest.approx(
        out["summary"]["tokens"] / (3 * 2 * 2 * 4096))
    assert out["summary"]["empty_microbatches"] == pytest.approx(
        np.mean([sum(not mb for r in st["ranks"] for mb in r) for st in out["steps"]]))


def test_text_lengths_and_compare(tmp_path, capsys):
    p = tmp_path / "l.txt"
    p.write_text("\n".join(str(x) for x in [300, 5000, 1200, 800, 90, 2500] * 5) + "\n")
    assert main(["pack", "--lengths", str(p), "--compare"] + TINY) == 0
    out = capsys.readouterr().out
    for name in ("megatron", "concat", "sorted", "tokens", "quadratic", "wlb", "sab"):
        assert f"| {name}" in out


BAD = [
    ("empty", "", []),
    ("notint", "[1, 2, \"x\"]", []),
    ("floats", "[1.5, 2]", []),
    ("zero", "[5, 0, 3]", []),
    ("negative", "7\n-3\n", []),
    ("garbage", "hello world", []),
    ("ok", "[5, 6]", ["--seq-length", "0"]),
    ("ok", "[5, 6]", ["--dp", "0"]),
    ("ok", "[5, 6]", ["--micro-batches", "0"]),
    ("ok", "[5, 6]", ["--strategy", "bogus"]),
    ("ok", "[5, 6]", ["--cost-model", "nonexistent-model"]),
    ("ok", "[5, 6]", ["--pp", "5"]),  # 24 layers are not divisible by 5
    ("ok", "[5, 6]", ["--dp", "two"]),
    ("ok", "[5, 6]", ["--model-config", "{not json"]),
    ("ok", "[5, 6]", ["--model-config", "{\"hidden_sise\": 7}"]),
]


@pytest.mark.parametrize("name, text, extra", BAD)
def test_bad_input_one_line_exit_2(tmp_path, name, text, extra):
    p = tmp_path / f"{name}.txt"
    p.write_text(text)
    args = ["--lengths", str(p), "--dp", "2", "--micro-batches", "2", "--steps", "1", "--json"]
    cmd = ["pack"] + _merge(args, extra)
    r = subprocess.run([sys.executable, "-m", "sparsebalance.batching"] + cmd,
                       capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr


def test_missing_file_exit_2(tmp_path, capsys):
    assert main(["pack", "--lengths", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.json" in err[0]


def _merge(args, extra):
    out = list(args)
    for flag, val in zip(extra[::2], extra[1::2]):
        if flag in out:
            out[out.index(flag) + 1] = val
        else:
            out += [flag, val]
    return out
