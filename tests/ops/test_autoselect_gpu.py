"""``auto`` on a real GPU (skipped without CUDA): every candidate is verified against the
reference and timed; the pick is one that passed, and it is what sparse_attention runs."""

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

from sparsebalance.ops import autoselect, resolve_backend
from sparsebalance.ops.backends import is_available


def test_auto_picks_a_verified_backend_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(autoselect, "_memo", {})
    monkeypatch.delenv("SPARSEBALANCE_AUTO_MEASURE", raising=False)
    path = str(tmp_path / "auto_backend.json")
    dev = torch.device("cuda")
    got = autoselect.auto_choice(dev, 128, 128, torch.bfloat16, path=path)
    cands = [n for n in autoselect.CANDIDATES if is_available(n, dev)]
    assert got["source"] == "measured" and got["backend"] in got["timings_ms"], got
    assert set(got["timings_ms"]) | set(got["failed"]) == set(cands)
    assert got["timings_ms"][got["backend"]] == min(got["timings_ms"].values())
    assert json.loads(open(path).read())[got["key"]]["backend"] == got["backend"]
    # sparse_attention's "auto" resolves to the same (memoised) choice
    assert resolve_backend("auto", dev, 128, 128, torch.bfloat16) == got["backend"]
    print(got["reason"])
