"""The small-M grid's per-packer epoch run and its table: SAB's planning time is kept as
wall time (the target's measure) beside thread CPU time, with the thread count and load."""

import numpy as np

from benchmarks.harness.compare.cluster_sim import MODELS, SimConfig
from benchmarks.harness.compare.smallm_grid import epoch_run, render


def test_epoch_run_keeps_wall_and_cpu_planning_time():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(600), 1.2, 300).astype(np.int64) + 1, 12000)
    assert (lengths > 4096).sum() >= 3 and lengths.size == 300  # long and short documents
    cfg = SimConfig(pp=2, dp=2, micro_batches=2, topk=16, block_size=256,
                    model=tuple(MODELS["llama7b"].items()))
    sab = epoch_run(lengths, 8192, cfg, "sab")
    assert sab["tokens"] == int(lengths.sum())  # the whole epoch, every token once
    assert 0 < sab["pack_wall_ms"] <= sab["pack_wall_ms_max"]
    assert 0 < sab["pack_wall_share_of_step"] < 1 and 0 < sab["pack_share_of_step"] < 1
    cell = {"file": "f", "pp": 2, "seq_length": 8192, "M": 2, "attention": "sparse",
            "omp_num_threads": "1", "load_avg": [0.5, 0.7],
            "epoch": {"speedup_vs_megatron": {"megatron": 1.0, "sab": 1.1, "wlb": 1.05},
                      "arms": {"sab": sab, "wlb": sab, "megatron": sab}}}
    md = render([cell])
    share = f"{100 * sab['pack_wall_share_of_step']:.2f}%"
    assert f"wall time summed over the epoch {share} (f PP 2 8K M 2 sparse)" in md
    cpu = f"{100 * sab['pack_share_of_step']:.2f}%"
    assert f"CPU time, median x steps {cpu} (f PP 2 8K M 2 sparse)" in md
    assert "OMP_NUM_THREADS 1" in md and "load average during the cells 0.5-0.7" in md


def test_grid_cli_wait_bound_and_m_set(tmp_path):
    import json

    import pytest

    from benchmarks.harness.compare.smallm_grid import main

    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(np.log(600), 1.2, 300).astype(np.int64) + 1, 12000)
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(lengths.tolist()))
    out = tmp_path / "grid.json"
    with pytest.raises(SystemExit, match="--ms takes pp, 2pp, 32"):
        main(["--lengths", str(f), "--ms", "pp,64", "--out", str(out)])
    with pytest.raises(SystemExit, match="--max-carry-steps must be >= 0"):
        main(["--lengths", str(f), "--max-carry-steps", "-1", "--out", str(out)])
    main(["--lengths", str(f), "--pp", "2", "--dp", "2", "--seq-lengths", "8192", "--ms", "pp",
          "--max-carry-steps", "0", "--sim-steps", "1", "--out", str(out)])
    cells = json.loads(out.read_text())
    assert sorted((c["M"], c["attention"]) for c in cells) == [(2, "dense"), (2, "sparse")]
    for c in cells:
        assert c["max_carry_steps"] == 0
        for arm in ("sab", "wlb"):  # nothing may wait: every item placed in its first step
            assert c["epoch"]["arms"][arm]["waits"]["max"] == 0
            assert c["epoch"]["arms"][arm]["tokens"] == int(lengths.sum())
