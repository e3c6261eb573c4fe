"""``auto`` on CUDA picks the fastest verified backend: the decision, the per-key JSON
cache, the in-process memo, and CPU's unchanged rule. Measurements are injected, so
this runs without a GPU."""

import json

import pytest
import torch

from sparsebalance.ops import autoselect, override_backend, resolve_backend
from sparsebalance.ops.backends import is_available

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch):
    monkeypatch.setattr(autoselect, "_memo", {})
    monkeypatch.delenv("SPARSEBALANCE_AUTO_MEASURE", raising=False)


def test_choose_fastest_verified_and_says_why():
    times = {"flex": 3.0, "triton": 2.0, "cuda": 1.0}
    verdict = {"flex": (True, "ok"), "triton": (True, "ok"), "cuda": (False, "dq error 0.3 > 2 x 0.01")}
    got = autoselect.choose(["flex", "triton", "cuda"], verdict.get, times.get)
    assert got["backend"] == "triton"  # cuda is faster but failed verification
    assert got["timings_ms"] == {"flex": 3.0, "triton": 2.0}
    assert got["failed"] == {"cuda": "verification: dq error 0.3 > 2 x 0.01"}
    assert got["reason"] == "fastest verified fwd+bwd: triton 2.00 ms, flex 3.00 ms; not verified: cuda"


def test_choose_a_crash_fails_one_candidate_only():
    def measure(name):
        if name == "flex":
            raise RuntimeError("Triton compile error\nlong trace")
        return 5.0

    got = autoselect.choose(["flex", "triton"], lambda n: (True, "ok"), measure)
    assert got["backend"] == "triton"
    assert got["failed"] == {"flex": "RuntimeError: Triton compile error"}
    none = autoselect.choose(["flex"], lambda n: (False, "density 0.3 != reference 0.2"), measure)
    assert none["backend"] is None and "flex: verification: density" in none["reason"]


def test_measured_once_then_cached_per_key(tmp_path):
    path = str(tmp_path / "cache" / "auto_backend.json")
    calls = []

    def measure(name):
        calls.append(name)
        return {"flex": 1.5, "triton": 4.0, "cuda": 3.0}[name]

    kw = dict(path=path, verify=lambda n: (True, "ok"), measure=measure, device_name="NVIDIA H200")
    first = autoselect.auto_choice(CUDA, 128, 128, torch.bfloat16, **kw)
    cands = [n for n in autoselect.CANDIDATES if is_available(n, CUDA)]
    assert "flex" in cands and calls == cands
    assert first["backend"] == "flex" and first["source"] == "measured"
    assert first["key"] == "NVIDIA H200|d128|b128|bfloat16"
    on_disk = json.loads(open(path).read())
    assert on_disk[first["key"]]["backend"] == "flex"
    assert on_disk[first["key"]]["timings_ms"]["flex"] == 1.5
    # Same process: the memo. New process (memo empty): the file; nothing is measured.
    assert autoselect.auto_choice(CUDA, 128, 128, torch.bfloat16, **kw)["source"] == "memo"
    autoselect._memo.clear()
    again = autoselect.auto_choice(CUDA, 128, 128, torch.bfloat16, **kw)
    assert again["source"] == "cache" and again["backend"] == "flex" and calls == cands
    # Another block size is another key: measured, and added beside the first.
    autoselect.auto_choice(CUDA, 128, 64, torch.bfloat16, **kw)
    assert len(calls) == 2 * len(cands)
    assert sorted(json.loads(open(path).read())) == ["NVIDIA H200|d128|b128|bfloat16",
                                                     "NVIDIA H200|d128|b64|bfloat16"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["auto_backend.json"]


def test_damaged_cache_is_measured_again(tmp_path):
    path = tmp_path / "auto_backend.json"
    path.write_text("{not json")
    got = autoselect.auto_choice(CUDA, 64, 64, torch.float32, path=str(path), device_name="GPU X",
                                 verify=lambda n: (True, "ok"), measure=lambda n: 1.0)
    assert got["source"] == "measured"
    assert json.loads(path.read_text())["GPU X|d64|b64|float32"]["backend"] == got["backend"]


def test_nothing_verified_falls_back_to_the_rule_and_caches_nothing(tmp_path):
    path = tmp_path / "auto_backend.json"
    got = autoselect.auto_choice(CUDA, 64, 64, torch.float32, path=str(path), device_name="GPU X",
                                 verify=lambda n: (False, "wrong"), measure=lambda n: 1.0)
    assert got["backend"] == resolve_backend("auto", CUDA)
    assert got["reason"].startswith("rule fallback (no candidate passed")
    assert not path.exists()


def test_cpu_and_measurement_off_keep_the_rule(monkeypatch):
    def boom(name):
        raise AssertionError("must not measure")

    cpu = autoselect.auto_choice(torch.device("cpu"), 64, 64, torch.float32, verify=boom, measure=boom)
    assert cpu["backend"] == resolve_backend("auto", torch.device("cpu")) and cpu["source"] == "rule"
    assert resolve_backend("auto", torch.device("cpu"), 64, 64, torch.float32) == cpu["backend"]
    monkeypatch.setenv("SPARSEBALANCE_AUTO_MEASURE", "0")
    off = autoselect.auto_choice(CUDA, 64, 64, torch.float32, verify=boom, measure=boom)
    assert off["backend"] == resolve_backend("auto", CUDA) and "AUTO_MEASURE=0" in off["reason"]


def test_override_wins_over_measurement(monkeypatch):
    monkeypatch.setattr(autoselect, "auto_choice", lambda *a, **k: pytest.fail("measured"))
    with override_backend("reference"):
        assert resolve_backend("auto", CUDA, 128, 128, torch.bfloat16) == "reference"


def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEBALANCE_CACHE_DIR", str(tmp_path))
    assert autoselect.cache_path() == str(tmp_path / "auto_backend.json")
    monkeypatch.delenv("SPARSEBALANCE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert autoselect.cache_path() == str(tmp_path / "xdg" / "sparsebalance" / "auto_backend.json")


def test_backend_choice_for_the_driver(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    named = autoselect.backend_choice("reference", cpu, 64, 64, torch.float32)
    assert named["backend"] == "reference" and named["reason"] == "--sb-attention-backend reference"
    auto_cpu = autoselect.backend_choice("auto", cpu, 64, 64, torch.float32)
    assert auto_cpu["backend"] == resolve_backend("auto", cpu) and auto_cpu["source"] == "rule"
    with pytest.raises(ValueError, match="nope"):
        autoselect.backend_choice("nope", cpu, 64, 64, torch.float32)
    monkeypatch.setattr(autoselect, "auto_choice", lambda *a, **k: {"backend": "flex", "reason": "fastest"})
    assert autoselect.backend_choice("auto", CUDA, 128, 128, torch.bfloat16)["backend"] == "flex"
    with override_backend("reference"):
        assert autoselect.backend_choice("auto", CUDA, 128, 128, torch.bfloat16)["backend"] == "reference"


def test_real_verify_and_measure_run_on_the_cpu(monkeypatch):
    """The verification and the timing auto uses on CUDA, run on CPU tensors: the
    reference verifies against itself, a backend 1% off fails, timing gives milliseconds."""
    from sparsebalance.ops import backends

    cpu = torch.device("cpu")
    verify = autoselect._verify_on(cpu, 32, 32, torch.float32)
    assert verify("reference") == (True, "ok")
    ref = backends.BACKENDS["reference"]

    def off_by_one_percent(*args):
        out, kept = ref(*args)
        return out * 1.01, kept

    monkeypatch.setitem(backends.BACKENDS, "cpu", off_by_one_percent)
    ok, why = verify("cpu")
    assert not ok and why.startswith("out error")
    monkeypatch.setattr(autoselect, "MEASURE_SHAPE",
                        {"tokens": 512, "heads": 2, "kv_heads": 1, "density": 0.3, "reps": 1})
    ms = autoselect._measure_on(cpu, 32, 32, torch.float32)("reference")
    assert 0.0 < ms < 60_000.0
