"""Profile JSON: round trip, fingerprint mismatch, missing profile."""

import json
import os
import warnings

import numpy as np
import pytest

from sparsebalance.predictor import get_predictor
from sparsebalance.predictor.fitted import FittedPredictor, layer_features
from sparsebalance.predictor.profile import hardware_fingerprint, make_profile, read_profile, save_profile

MODEL = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 4,
         "kv_channels": None, "ffn_hidden_size": 512, "vocab_size": 256, "swiglu": False,
         "block_size": 64, "topk": 8, "attention": "sparse", "attention_backend": "cpu"}
TRUE = np.array([1e-5, 0.0, 2e-3, 0.1, 0.0, 0.5])  # as LAYER_FEATURES (all budgets sparse)


def _samples():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(12):
        lengths = rng.integers(1, 1024, size=int(rng.integers(1, 6))).tolist()
        for phase, s in (("fwd", 1.0), ("bwd", 2.0)):
            ms = s * float(layer_features(lengths, 8, 64) @ TRUE)
            out.append({"kind": "layer", "phase": phase, "lengths": lengths, "topk": 8, "ms": ms})
    for kind in ("embedding", "output"):
        for n in (256, 512, 1024):
            for phase in ("fwd", "bwd"):
                out.append({"kind": kind, "phase": phase, "lengths": [n], "topk": None,
                            "ms": 0.01 * n / 256 + (1.0 if kind == "output" else 0.1)})
    return out


@pytest.fixture
def profile_path(tmp_path):
    path = str(tmp_path / "prof.json")
    save_profile(path, make_profile(hardware_fingerprint(), MODEL, _samples(), "test"))
    return path


def test_round_trip_and_prediction(profile_path):
    p = get_predictor(profile_path)
    assert isinstance(p, FittedPredictor)
    assert p.num_layers == 4 and p.block_size == 64
    lengths = [100, 700]
    want = float(layer_features(lengths, 8, 64) @ TRUE)
    assert p.layer_ms(lengths, 8, "fwd") == pytest.approx(want, rel=1e-6)
    assert p.layer_ms(lengths, 8, "bwd") == pytest.approx(2 * want, rel=1e-6)
    # Extras: embedding only on the first stage, output + loss only on the last.
    T = sum(lengths)
    emb = 0.01 * T / 256 + 0.1
    out = 0.01 * T / 256 + 1.0
    assert p.extras_ms(lengths, 0, 2, "fwd") == pytest.approx(emb, rel=1e-6)
    assert p.extras_ms(lengths, 1, 2, "fwd") == pytest.approx(out, rel=1e-6)
    assert p.extras_ms(lengths, 0, 1, "fwd") == pytest.approx(emb + out, rel=1e-6)
    assert p.extras_ms(lengths, 1, 4, "fwd") == 0.0
    # No temp files left behind by the atomic write.
    assert os.listdir(os.path.dirname(profile_path)) == ["prof.json"]


def test_matching_model_cfg_is_accepted_and_num_layers_may_differ(profile_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = get_predictor(profile_path, hidden_size=128, block_size=64, num_layers=8, topk=16)
    assert p.num_layers == 8 and p.topk == 16


@pytest.mark.parametrize("cfg, field", [
    ({"hidden_size": 256}, "model.hidden_size"),
    ({"block_size": 128}, "model.block_size"),
    ({"vocab_size": 1000}, "model.vocab_size"),
])
def test_model_mismatch_warns_and_refuses(profile_path, cfg, field):
    with pytest.warns(UserWarning, match=field):
        with pytest.raises(ValueError, match=field):
            get_predictor(profile_path, **cfg)
    with pytest.warns(UserWarning, match=field):
        p = get_predictor(profile_path, allow_stale=True, **cfg)
    key = next(iter(cfg))
    assert getattr(p.shape, key) == cfg[key]


def test_expect_checks_extra_fields(profile_path):
    with pytest.warns(UserWarning, match="attention_backend"):
        with pytest.raises(ValueError, match="attention_backend"):
            get_predictor(profile_path, expect={"attention_backend": "triton"})


@pytest.mark.parametrize("key, value", [("threads", 97), ("torch", "0.0.1"),
                                        ("cpu", "Some Other CPU"), ("gpu", "NVIDIA H100")])
def test_hardware_mismatch_warns_and_refuses(tmp_path, key, value):
    hw = hardware_fingerprint()
    hw[key] = value
    path = str(tmp_path / "prof.json")
    save_profile(path, make_profile(hw, MODEL, _samples(), "test"))
    with pytest.warns(UserWarning, match=f"hardware.{key}"):
        with pytest.raises(ValueError, match="--sb-allow-stale-profile"):
            get_predictor(path)
    with pytest.warns(UserWarning):
        assert get_predictor(path, allow_stale=True).layer_ms([10], None, "fwd") > 0


def test_missing_profile_prints_the_command(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError) as e:
        get_predictor(path, hidden_size=128, num_attention_heads=4, block_size=64)
    msg = str(e.value)
    assert "tools/profile_latency.py" in msg and f"--output {path}" in msg
    assert "--hidden-size 128" in msg and "--sb-block-size 64" in msg
    assert "OMP_NUM_THREADS=" in msg


def test_malformed_profile(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_predictor(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a sparsebalance-latency-profile"):
        read_profile(str(bad))


def test_unknown_names_and_keys(profile_path):
    with pytest.raises(ValueError, match="unknown cost model"):
        get_predictor("h200-magic")
    with pytest.raises(ValueError, match="unknown model_cfg keys"):
        get_predictor(profile_path, hiddensize=1)
    with pytest.raises(ValueError, match="allow_stale"):
        get_predictor("h100-analytic", allow_stale=True)


def _profile_tool():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "profile_latency.py")
    spec = importlib.util.spec_from_file_location("profile_latency_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("run", [
    dict(attention="sparse", attention_backend="cpu", seq_length=512, normalization="RMSNorm",
         params_dtype="bf16", swiglu=True),
    dict(attention="sparse", attention_backend="reference", seq_length=4096, normalization="LayerNorm",
         params_dtype="fp32", swiglu=False),
    dict(attention="dense", attention_backend="sdpa", seq_length=2048, normalization="RMSNorm",
         params_dtype="fp32", swiglu=False),
], ids=["sparse-rms-bf16", "sparse-reference", "dense-rms"])
def test_printed_command_writes_the_profile_the_run_accepts(tmp_path, run):
    """Parse the suggested command with the tool's own parser: its model fingerprint
    equals the running model's on every fingerprinted field the run asked for."""
    import shlex

    tool = _profile_tool()
    path = str(tmp_path / "nope.json")
    shape = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=160, vocab_size=512, swiglu=run["swiglu"], block_size=32,
                 topk=4 if run["attention"] == "sparse" else None)
    expect = {k: v for k, v in run.items() if k != "swiglu"}
    with pytest.raises(FileNotFoundError) as e:
        get_predictor(path, expect=expect, **shape)
    words = shlex.split(str(e.value).split("create it with: ", 1)[1])
    argv = words[words.index("tools/profile_latency.py") + 1:]
    args = tool.build_parser().parse_args(argv)
    tool._fill_defaults(args)
    got = tool.model_fingerprint(args)
    assert args.output == path
    want = {**shape, **expect}
    if run["attention"] == "dense":
        want.pop("topk")  # a dense profile serves any budget (topk is not fingerprinted)
    diffs = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    assert not diffs, f"profile written by the printed command differs: {diffs}"


def test_threads_of_the_predicted_run(tmp_path):
    """A tool that launches ranks with N threads predicts with the N-thread profile,
    whatever its own thread count (benchmarks/compare.py runs ranks with one thread)."""
    import torch

    other = torch.get_num_threads() + 1
    path = str(tmp_path / "prof.json")
    save_profile(path, make_profile(hardware_fingerprint(threads=other), MODEL, _samples(), "t"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=f"hardware.threads: profile {other}"):
            get_predictor(path)
    assert get_predictor(path, threads=other).block_size == 64
    with pytest.raises(ValueError, match="threads applies to profiles"):
        get_predictor("h100-analytic", threads=1)
