"""benchmarks/heldout_loss.py: the budget stop, the held-out split, the seed statistics, and the
smoke comparison end to end (3 arms x 2 seeds, 2 s of training each: ~10 steps/s on 2 cores
even under load, so 20 steps where 8 suffice; start-up dominates the run time)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from benchmarks.harness.compare.heldout import (  # noqa: E402
    heldout_documents,
    interleaved_order,
    mean_interval,
    paired_difference,
    t_quantile,
)


def test_t_interval_on_known_input():
    # Student's t table: 12.706 (df 1), 4.303 (df 2), 2.228 (df 10), 2.042 (df 30).
    for df, want in ((1, 12.706), (2, 4.303), (10, 2.228), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-3)
    r = mean_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, half width 4.3027 / sqrt(3)
    assert r["mean"] == 2.0 and r["sd"] == pytest.approx(1.0)
    assert r["ci95"] == pytest.approx([2 - 2.48414, 2 + 2.48414], abs=1e-4)
    assert mean_interval([5.0])["ci95"] is None


def test_paired_difference_verdicts():
    base = {1: 3.0, 2: 3.5, 3: 2.5}
    shifted = {s: v - 0.1 + 0.001 * s for s, v in base.items()}  # consistently lower
    d = paired_difference(shifted, base)
    assert d["mean"] == pytest.approx(-0.098) and d["verdict"] == "beyond noise"
    assert d["per_seed"] == pytest.approx({"1": -0.099, "2": -0.098, "3": -0.097})
    noisy = {1: 3.2, 2: 3.3, 3: 2.4}  # differences +0.2, -0.2, -0.1
    assert paired_difference(noisy, base)["verdict"] == "within noise"
    assert paired_difference({1: 1.0}, {1: 2.0})["verdict"].startswith("unknown")
    assert paired_difference({1: 1.0}, {2: 2.0}) is None  # no shared seed: nothing paired


def test_interleaved_order_rotates_arms():
    arms = ["dense", "static", "sparsebalance"]
    order = interleaved_order(arms, [7, 8, 9])
    assert [s for _, s in order] == [7] * 3 + [8] * 3 + [9] * 3  # seed-major
    for arm in arms:  # each arm once per seed, and once in each position of a seed's triple
        assert sorted(i % 3 for i, (a, _) in enumerate(order) if a == arm) == [0, 1, 2]


def test_heldout_documents_are_long_and_outside_training():
    lengths = np.array([100, 900, 50, 700, 800, 20, 950, 600])
    train, valid = np.arange(0, 5), np.arange(5, 8)
    assert heldout_documents(lengths, train, valid, 500, 10).tolist() == [6, 7]
    assert heldout_documents(lengths, train, valid, 500, 1).tolist() == [6]
    with pytest.raises(ValueError, match="share"):
        heldout_documents(lengths, np.arange(0, 6), valid, 500, 10)
    with pytest.raises(ValueError, match="longer than 960"):
        heldout_documents(lengths, train, valid, 960, 10)


WORKER = textwrap.dedent("""
    import signal, sys, time
    time.sleep(0.5)  # starts with USR1 ignored (inherited); the handler comes later
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(time.time()))
    while not got:
        time.sleep(0.05)
    time.sleep(3.0)  # a second signal in this window would be counted
    open(sys.argv[1], "w").write(str(len(got)))
""")


def test_budget_stop_signals_each_worker_once(tmp_path):
    from heldout_loss import train_for_budget

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    outs = [tmp_path / f"count{i}" for i in range(2)]
    launcher = (f"import subprocess, sys; ps = [subprocess.Popen([sys.executable, {str(worker)!r}, o]) "
                f"for o in {[str(o) for o in outs]!r}]; sys.exit(max(p.wait() for p in ps))")
    r = train_for_budget([sys.executable, "-c", launcher], 2, 1.0, 1, str(tmp_path))
    assert r["returncode"] == 0 and r["workers_signalled"] == 2
    assert r["start_s"] >= 0.5  # the budget starts once both workers catch USR1
    assert 1.0 <= r["signal_at_s"] - r["start_s"] < 2.0
    assert [o.read_text() for o in outs] == ["1", "1"]  # each worker signalled once
    assert r["wall_s"] >= r["signal_at_s"] + 3.0


def test_arms_option_flags_and_differences():
    """--arms picks arms (report order); the sab arm is SAB with the static top-k; its
    differences split sparsebalance - static into packing and budgets."""
    import heldout_loss as H

    from megatron.training.arguments import build_parser

    p = H.build_parser()
    assert p.parse_args(["--arms", "sparsebalance,sab,static"]).arms == ["static", "sab", "sparsebalance"]
    a = p.parse_args([])
    H.check_args(a)
    assert a.arms == ["dense", "static", "sparsebalance"]
    sab = build_parser().parse_args(H.arm_flags("sab", "prof.json"))
    assert (sab.sparse_attention, sab.sb_batching, sab.sb_dst, sab.sb_profile) == (True, "sab", "off", "prof.json")
    assert not sab.sparse_balance
    runs = [{"arm": arm, "seed": seed, "heldout_loss": loss, "steps": 10, "tokens": 100, "wall_s": 1.0}
            for arm, base in (("static", 1.0), ("sab", 1.2), ("sparsebalance", 1.3))
            for seed, loss in ((1, base), (2, base + 0.1), (3, base - 0.05))]
    out = H.summarize(runs)
    assert list(out["arms"]) == ["static", "sab", "sparsebalance"]
    d = out["differences"]
    assert set(d) == {"sparsebalance - static", "sab - static", "sparsebalance - sab"}
    assert d["sab - static"]["mean"] == pytest.approx(0.2) and d["sparsebalance - sab"]["mean"] == pytest.approx(0.1)


def test_smoke_comparison_end_to_end(tmp_path):
    out, png, work = tmp_path / "hl.json", tmp_path / "hl.png", tmp_path / "work"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "heldout_loss.py"), "--smoke", "--json",
                        "--workdir", str(work), "--out", str(out), "--plot", str(png), "--budget-s", "2"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert json.loads(out.read_text()) == res and png.stat().st_size > 0
    assert "[heldout]" in p.stderr and "Traceback" not in p.stderr
    cfg, runs = res["config"], res["runs"]
    budget = cfg["budget_s"]
    assert budget == 2.0

    # Interleaved seed-major, every arm once per seed.
    assert [f"{r['arm']}#{r['seed']}" for r in runs] == cfg["order"] == \
        [f"{a}#{s}" for a, s in interleaved_order(["dense", "static", "sparsebalance"], cfg["seeds"])]
    flags = {r["arm"]: r["command"] for r in runs}
    assert "--sparse-attention" not in flags["dense"] and "--sparse-balance" not in flags["dense"]
    assert "--sparse-attention" in flags["static"] and "--sb-dst off" in flags["static"]
    assert "--sparse-balance" in flags["sparsebalance"] and "--sb-profile" in flags["sparsebalance"]

    # Each arm was stopped by the signal at its budget: the driver reports the preemption,
    # both workers got USR1 no earlier than the budget after training started, the run
    # ended soon after, and the evaluated checkpoint is the one saved at the stop.
    for r in runs:
        assert r["stopped_by_signal"] and r["workers_signalled"] == 2, r
        assert r["signal_at_s"] >= r["start_s"] + budget and r["train_s"] <= budget + 60, r
        assert r["steps"] >= 1 and r["checkpoint_iteration"] == r["steps"], r
        assert r["tokens"] > 0 and math.isfinite(r["heldout_loss"]), r
    trained = [r for r in runs if r["steps"] >= 8]
    assert trained, "no run trained 8 steps inside the budget"
    init_loss = math.log(256)  # byte vocabulary: ~ln 256 before training
    assert all(r["heldout_loss"] < init_loss - 0.15 for r in trained), trained

    # Held-out documents: from the valid split only, all longer than twice the cap,
    # checked against the corpus the arms trained on.
    from megatron.training import data as D
    from megatron.training.arguments import _split
    from megatron.training.indexed_io import open_dataset

    ho = res["heldout"]
    dataset = open_dataset(str(work / "corpus"))
    lengths = np.array(dataset.sequence_lengths, dtype=np.int64)  # a copy: the index is memory-mapped
    train_ids, valid_ids, _ = D.split_documents(len(lengths), _split(ho["split"]))
    assert "--split " + ho["split"] in flags["dense"]
    assert ho["doc_ids"] and not set(ho["doc_ids"]) & set(train_ids.tolist())
    assert set(ho["doc_ids"]) <= set(valid_ids.tolist())
    assert all(lengths[i] > ho["min_length"] for i in ho["doc_ids"])
    assert ho["min_length"] == 2 * (cfg["recipe"]["topk"] + 2) * cfg["recipe"]["block_size"]
    assert ho["tokens_scored"] == sum(int(lengths[i]) - 1 for i in ho["doc_ids"])

    # The summary is the per-seed numbers' statistics.
    for name, a in res["arms"].items():
        mine = {str(r["seed"]): r["heldout_loss"] for r in runs if r["arm"] == name}
        assert a["per_seed"] == mine
        assert a["mean"] == pytest.approx(np.mean(list(mine.values())))
        assert a["ci95"][0] <= a["mean"] <= a["ci95"][1]
    d = res["differences"]["sparsebalance - static"]
    assert d["per_seed"] == pytest.approx({s: res["arms"]["sparsebalance"]["per_seed"][s]
                                           - res["arms"]["static"]["per_seed"][s] for s in d["per_seed"]})
    assert d["verdict"] in ("beyond noise", "within noise")
    assert "sparsebalance - dense" in res["differences"] and res["notes"]
