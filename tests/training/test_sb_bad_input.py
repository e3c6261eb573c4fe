"""SparseBalance flags on bad input: exit 2, one clear line on stderr, no traceback,
nothing written (checked before any process group starts)."""

import json
import subprocess

import pytest
from conftest import PRETRAIN, PY, ROOT, TINY, env

SB = ["--sb-block-size", "32", "--sb-topk", "4"]


def _stale_profile(path):
    """A well-formed profile of another model (hidden 4096) on this machine."""
    import sys

    sys.path.insert(0, ROOT)
    from sparsebalance.predictor import profile as prof

    json.dump({"format": prof.FORMAT, "version": prof.VERSION, "created": "2026-01-01T00:00:00Z",
               "command": "tools/profile_latency.py", "hardware": prof.hardware_fingerprint(threads=1),
               "model": {"num_layers": 4, "hidden_size": 4096, "num_attention_heads": 32,
                         "block_size": 32, "topk": 4, "attention": "sparse"},
               "timing": {}, "samples": []}, open(path, "w"))


CASES = {
    # name: (extra args, text the error line must contain)
    "unknown batching": (["--sb-batching", "fastest"], "--sb-batching: invalid choice: 'fastest'"),
    "dst without sparse attention": (["--sb-dst", "critical-path", "--sb-cost-model", "h100-analytic"],
                                     "needs --sparse-attention"),
    "sab without predictor": (["--sb-batching", "sab"], "--sb-profile"),
    "sparse-balance without predictor": (["--sparse-balance", *SB], "--sb-cost-model h100-analytic"),
    "unknown cost model": (["--sparse-balance", *SB, "--sb-cost-model", "a100-magic"], "unknown model"),
    "both predictors": (["--sparse-balance", *SB, "--sb-cost-model", "h100-analytic", "--sb-profile",
                         "{d}/p.json"], "not both"),
    "p out of range": (["--sparse-balance", *SB, "--sb-cost-model", "h100-analytic", "--sb-dst", "anchor",
                        "--sb-p", "1.5"], "--sb-p"),
    "topk bounds": (["--sparse-balance", *SB, "--sb-cost-model", "h100-analytic", "--sb-topk-min", "6"],
                    "--sb-topk-min 6"),
    "missing profile": (["--sparse-balance", *SB, "--sb-profile", "{d}/missing.json"],
                        "tools/profile_latency.py --output {d}/missing.json --sparse-attention"),
    "stale profile": (["--sparse-balance", *SB, "--sb-profile", "{d}/stale.json"],
                      "--sb-allow-stale-profile"),
}


def _check_one_line(code, stderr, expect, tmp_path):
    assert code == 2, (code, stderr[-2000:])
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ") and expect in lines[0], lines[0]
    assert not (tmp_path / "save").exists() and not (tmp_path / "summary.json").exists()
    assert not (tmp_path / "missing.json").exists()


def _argv(name, corpus, tmp_path):
    _stale_profile(str(tmp_path / "stale.json"))
    extra, expect = CASES[name]
    extra = [a.format(d=tmp_path) for a in extra]
    return ([*TINY, "--data-path", corpus, *extra, "--save", str(tmp_path / "save"),
             "--summary-json", str(tmp_path / "summary.json")], expect.format(d=tmp_path))


@pytest.mark.parametrize("name", list(CASES))
def test_sb_bad_input_one_line(name, corpus, tmp_path, capsys, monkeypatch):
    """In-process (one interpreter for all cases): pretrain_gpt.main exits 2 with one line."""
    import sys

    sys.path.insert(0, ROOT)
    import pretrain_gpt

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    argv, expect = _argv(name, corpus, tmp_path)
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(argv)
    _check_one_line(exc.value.code, capsys.readouterr().err, expect, tmp_path)


@pytest.mark.parametrize("name", ["unknown batching", "missing profile"])
def test_sb_bad_input_cli(name, corpus, tmp_path):
    """The same through a real process: exit status and stderr as a user sees them."""
    argv, expect = _argv(name, corpus, tmp_path)
    proc = subprocess.run([PY, PRETRAIN, *argv], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stdout
    _check_one_line(proc.returncode, proc.stderr, expect, tmp_path)


def test_stale_profile_on_a_rank_one_line(corpus, tmp_path):
    """Under torchrun every rank checks the profile before any process group starts: a
    stale one ends each rank with one line naming the rank (exit 2), not a traceback."""
    argv, expect = _argv("stale profile", corpus, tmp_path)
    e = env()
    e.update(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")  # what torchrun sets for rank 1
    proc = subprocess.run([PY, PRETRAIN, *argv], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stdout
    _check_one_line(proc.returncode, proc.stderr, expect, tmp_path)
    assert proc.stderr.startswith("pretrain_gpt.py: error: [rank 1] latency profile "), proc.stderr


def test_help_lists_the_sparsebalance_flags():
    import sys

    sys.path.insert(0, ROOT)
    from megatron.training.arguments import build_parser

    text = build_parser().format_help()
    flags = """--sb-batching --max-carry-steps --sparse-balance --sb-dst --sb-anchor --sb-p
    --sb-topk-min --sb-topk-max --sb-attn-slack --sb-timeline --sb-profile --sb-cost-model
    --sb-allow-stale-profile --sb-dst-sensitivity --sb-sensitivity-study --summary-json""".split()
    assert [f for f in flags if f not in text] == []
    for name in ("megatron", "concat", "sorted", "tokens", "quadratic", "wlb", "sab"):
        assert name in text
