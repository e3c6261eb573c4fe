"""tools/induction_check.py: both models learn the easy (fixed-offset) copy; the task varies
the copy distance when asked to; bad input gets one error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import induction_check  # noqa: E402


def run(*argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "tools/induction_check.py", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("model", ("megatron", "reference"))
def test_fixed_offset_copy_is_learned(model, tmp_path):
    # --max-gap 0: the second copy always starts SPAN tokens after the first, so a
    # positional head solves it within a few dozen steps; at initialisation the
    # accuracy is chance (1/26).
    p = run("--model", model, "--max-gap", "0", "--span", "16", "--steps", "150", "--eval-interval", "25",
            "--num-layers", "2", "--hidden-size", "64", "--output", str(tmp_path / "out.json"))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert json.loads((tmp_path / "out.json").read_text()) == out
    assert out["model"] == model and out["threads"] == 1 and out["steps"] == 150
    assert [c["step"] for c in out["curve"]] == list(range(25, 151, 25))
    assert out["curve"][0]["copy_acc"] < out["curve"][-1]["copy_acc"]
    assert out["curve"][-1]["copy_acc"] >= 0.9 and out["steps_to"]["0.9"] is not None


def test_samples_copy_the_span_from_a_varying_distance():
    sample = induction_check.make_sampler(span=12, max_gap=40, seed=3)
    distances = set()
    for _ in range(50):
        seq, start = sample()
        code = seq[start:]
        assert len(code) == 12 and all(65 <= int(c) <= 90 for c in code)
        first = next(i for i in range(len(seq)) if 65 <= int(seq[i]) <= 90)
        assert seq[first:first + 12].tolist() == code.tolist()
        assert all(97 <= int(c) <= 122 for c in seq[first + 12:start])  # lowercase gap only
        distances.add(start - first)
    assert max(distances) - min(distances) > 20


@pytest.mark.parametrize("argv, needle", [
    (["--max-gap", "-1"], "--max-gap must be >= 0"),
    (["--span", "1"], "--span must be >= 2"),
    (["--hidden-size", "60", "--num-attention-heads", "4"], "heads of even size"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--model", "nope"], "invalid choice"),
    (["--qk-conv", "1"], "--qk-conv must be 0 (off) or >= 2"),
    (["--model", "reference", "--qk-conv", "4"], "driver's model only (--model megatron)"),
])
def test_bad_input_one_error_line(argv, needle):
    p = run(*argv)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("induction_check.py: error:"), p.stderr
