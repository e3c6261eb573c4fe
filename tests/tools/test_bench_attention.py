"""tools/bench_attention.py under threshold routing: per-head and per-block counts timed in
one run, on q/k from a ``--qk`` file (with its documents) and on the ``blocks`` inputs."""

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))


def _bench(argv, capsys):
    import bench_attention

    n = torch.get_num_threads()
    try:
        assert bench_attention.main([*argv, "--threads", "1", "--reps", "1", "--warmup", "0", "--json"]) == 0
    finally:
        torch.set_num_threads(n)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_counts(res):
    ph, pb = res["counts"]["per-head"], res["counts"]["per-block"]
    assert 0 < ph["kept_pairs"] < pb["kept_pairs"]  # these inputs' heads differ
    for c in (ph, pb):
        assert c["ms_per_mpair"] == pytest.approx(c["sparse_ms"] / c["kept_pairs"] * 1e6, rel=1e-3)
    ratio = res["per_head_over_per_block"]
    assert ratio["kept_pairs"] == pytest.approx(ph["kept_pairs"] / pb["kept_pairs"], abs=1e-4)
    assert res["density"] == ph["density"] and res["dense_ms"] is None


def test_threshold_bench_on_a_qk_file(tmp_path, capsys):
    from bench_attention import block_inputs

    lens, H, Hkv, D, B = [300, 212], 4, 2, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k = block_inputs(torch.randn(sum(lens), H, D, generator=g), torch.randn(sum(lens), Hkv, D, generator=g),
                        lens, B, g)
    path = tmp_path / "qk.pt"
    torch.save({"q": q, "k": k, "cu_seqlens": torch.tensor([0, 300, 512])}, path)
    res = _bench(["--qk", str(path), "--block-size", str(B), "--topk", "16", "--routing", "threshold",
                  "--no-dense", "--backend", "cpu"], capsys)
    assert (res["seq_len"], res["heads"], res["kv_heads"], res["head_dim"], res["n_docs"]) == (512, H, Hkv, D, 2)
    assert res["inputs"] == str(path) and res["routing"] == "threshold" and res["threshold"] == 0.9
    _check_counts(res)
    cut = _bench(["--qk", str(path), "--seq-len", "400", "--block-size", str(B), "--no-dense"], capsys)
    assert (cut["seq_len"], cut["n_docs"], cut["max_doc_len"]) == (400, 2, 300) and cut["counts"] is None


def test_threshold_bench_on_block_inputs(capsys):
    res = _bench(["--seq-len", "512", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--block-size", "16",
                  "--topk", "16", "--routing", "threshold", "--inputs", "blocks", "--no-dense"], capsys)
    _check_counts(res)
