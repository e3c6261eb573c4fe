"""tools/profile_latency.py: usage errors, and a tiny end-to-end profile that loads."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "profile_latency.py")
TINY = [*PROJECT_RUN_FLAGS, "--seq-length", "256", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-layers", "2", "--sb-block-size", "16", "--sb-topk", "4", "--sparse-attention",
        "--threads", "1", "--clock", "cpu"]


def _run(args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("args, needle", [
    (["--seq-length", "64", "--sb-block-size", "64", "--validate"], "--seq-length"),
    (TINY, "--output is required"),
    (TINY + ["--validate", "--repeats", "0"], "--repeats"),
    (TINY + ["--validate", "--length-files", "/nonexistent.json"], "length files"),
    (TINY + ["--validate", "--no-such-flag"], "unrecognized"),
    (TINY + ["--validate", "--sb-attention-backend", "nope"], "--sb-attention-backend"),
    (TINY + ["--validate", "--length-files", __file__], "cannot read a JSON list"),
])
def test_usage_errors_are_one_line_exit_2(args, needle, tmp_path):
    r = _run(args + ["--output", str(tmp_path / "p.json")] if needle != "--output is required"
             else args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_tiny_profile_validates_and_loads(tmp_path, world):
    """The profile run is a job of the session's warm world (tests/_world.py): what it
    writes and reports is checked, not its process."""
    out = str(tmp_path / "profile.json")
    r = world.launch(TOOL, TINY + ["--quick", "--validate", "--json", "--repeats", "1", "--warmup", "0",
                                   "--heldout", "4", "--stage-checks", "1", "--output", out], timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    for key in ("mape_fwd", "mape_bwd", "mape", "spearman", "n_heldout", "stage_mape"):
        assert key in res
    assert res["n_heldout"] == 4 and res["threads"] == 1
    assert 0 <= res["mape"] < 10 and -1 <= res["spearman"] <= 1  # sanity only: 1 repeat
    prof = json.load(open(out))
    assert prof["hardware"]["threads"] == 1 and prof["timing"]["clock"] == "cpu"
    assert {s["kind"] for s in prof["samples"]} == {"layer", "embedding", "output"}
    assert {s["topk"] for s in prof["samples"] if s["kind"] == "layer"} == {2, 4, None}
    assert prof["model"]["attention"] == "sparse" and prof["model"]["attention_backend"] != "auto"
    assert all(s["ms"] > 0 for s in prof["samples"])

    import torch

    from sparsebalance.predictor import get_predictor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = get_predictor(out, hidden_size=32, num_attention_heads=2, block_size=16)
        assert p.layer_ms([256], None, "bwd") > 0
        with pytest.warns(UserWarning, match="model.hidden_size"):
            with pytest.raises(ValueError):
                get_predictor(out, hidden_size=64)
    finally:
        torch.set_num_threads(threads)
