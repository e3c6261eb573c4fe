"""The WLB-LLM validation table and the regime study on a tiny cluster: JSON shape,
the table's arithmetic, the report and the figure."""

import numpy as np
import pytest

from benchmarks.harness.compare import regime, wlb_validation
from benchmarks.harness.compare.cluster_sim import SimConfig

SMALL = (("num_layers", 2), ("hidden_size", 128), ("num_attention_heads", 2),
         ("num_query_groups", 2), ("ffn_hidden_size", 256), ("vocab_size", 500))


@pytest.fixture(scope="module")
def tiny(monkeypatch_module):
    monkeypatch_module.setitem(regime.MODELS, "tiny", dict(SMALL))
    rng = np.random.default_rng(0)
    files = {f: np.clip(rng.lognormal(7.0, 1.2, 1500), 16, 8000).astype(np.int64) for f in ("a", "b")}
    return files, SimConfig(steps=1, block_size=64, topk=4)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_validation_json_shape(tiny):
    files, base = tiny
    pubs = (wlb_validation.Published("4K", 4096, 1.30, 1.44, 1.05), wlb_validation.Published("8K", 8192, 1.15))
    res = wlb_validation.run(files, base, lambda m: None, published=pubs, pps=(2,), model="tiny", dp=2)
    wlb_validation.check(res)
    assert [(r["name"], r["pp"], r["micro_batches"], r["attention"]) for r in res["rows"]] == [
        ("4K", 2, 2, "dense"), ("8K", 2, 2, "dense")]
    r = res["rows"][0]
    assert r["published"]["imbalance_degree"] == {"baseline": 1.44, "wlb": 1.05}
    assert res["rows"][1]["published"]["imbalance_degree"] is None
    assert res["summary"]["mean_wlb_vs_megatron"]["sim"] == pytest.approx(
        np.mean([x["sim"]["wlb_vs_megatron"] for x in res["rows"]]))
    md = wlb_validation.markdown({**res, "cost_model": "h100-analytic"})
    assert md.count("\n| 4K | 2 | 2 |") == 1 and "1.44 / 1.05" in md
    bad = {**res, "rows": [{**r, "difference": r["difference"] + 0.1}]}
    with pytest.raises(ValueError, match="difference"):
        wlb_validation.check(bad)


def test_regime_cells_report_and_figure(tiny, tmp_path):
    files, base = tiny
    cells = [regime.run_cell(regime.Cell("tiny", 4096, 2, 2, m, a), files, base)
             for a, m in (("dense", 2), ("dense", 4), ("topk", 2))]
    assert cells[0]["topk"] == 4096 // 64 and cells[2]["topk"] == 4
    for c in cells:
        assert list(c["arms"]) == list(regime.ARMS) and set(c["tables"]) == {"a", "b"}
        assert c["arms"]["megatron"]["speedup_vs_megatron"] == pytest.approx(1.0)
        assert all(r["imbalance_degree"] >= 1.0 for r in c["arms"].values())
    regime.figure(str(tmp_path / "f.png"), cells, "h100-analytic", shape=dict(context=4096, pp=2, dp=2))
    assert (tmp_path / "f.png").stat().st_size > 0
    md = regime.report({"cost_model": "h100-analytic", "config": {"steps": 1, "block_size": 64},
                        "files": ["a", "b"], "cells": cells})
    assert md.count("\n| 4K | 2 |") == 3


def test_threshold_cells_need_a_density_study():
    with pytest.raises(ValueError, match="density study"):
        regime.cell_config(regime.Cell("llama7b", 4096, 2, 2, 2, "threshold"), SimConfig())
