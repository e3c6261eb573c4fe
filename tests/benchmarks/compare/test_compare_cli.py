"""benchmarks/compare.py: bad input is one line and exit 2; a tiny sim run prints the JSON shape."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.harness.compare.cells import check_cells

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOOL = os.path.join(REPO, "benchmarks", "compare.py")


def _run(*args, world=None):
    """compare.py with ``args``: a process (its exit and message are checked), or a job of
    ``world`` (the session's warm world, tests/_world.py) where its report is."""
    if world is not None:
        return world.launch(TOOL, args, timeout=120)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture(scope="module")
def lengths(tmp_path_factory):
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("len") / "synthetic.json"
    p.write_text(json.dumps(np.clip(rng.lognormal(6.5, 1.0, 3000), 16, 6000).astype(int).tolist()))
    return str(p)


@pytest.mark.parametrize("args", [
    ["--mode", "bogus"],
    ["--lengths", "/nonexistent/x.json"],
    ["--sim-models", "gpt5"],
    ["--pp", "0"],
    ["--seq-lengths", "abc"],
    ["--sim-cp", "0"],
    ["--mode", "real", "--iters", "5"],
    ["--mode", "real", "--arms", "megatron,nope"],
    ["--unknown-flag"],
    ["--mode", "real", "--scaling"],
    ["--routing", "threshold"],  # no --density-study
    ["--routing", "threshold", "--density-study", "/nonexistent/study.json"],
    ["--scaling-models", "smollm2"],  # without --scaling
    ["--mode", "real", "--corpus-lengths", "/nonexistent/mine.json"],
    ["--mode", "real", "--data-path", "/nonexistent/prefix"],
    ["--mode", "real", "--real-micro-batches", "0"],
    ["--mode", "real", "--real-attention", "full"],
])
def test_bad_input_one_line_exit_2(args):
    p = _run(*args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_bad_lengths_content(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{"not": "a list"}')
    p = _run("--lengths", str(f), "--seq-lengths", "4096", "--pp", "2", "--dp", "2",
             "--micro-batches", "4", "--sim-steps", "1")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1


def test_real_corpus_recipe_takes_a_users_length_file(lengths, tmp_path):
    """--corpus-lengths: the real runs' corpus and profile resample the user's lengths (a
    path), the built-in names still resolve in data/lengths."""
    from benchmarks.harness.compare.corpus import CorpusRecipe, length_file, source_lengths

    mine = source_lengths("unused", CorpusRecipe(lengths_file=lengths).lengths_file)
    assert mine.tolist() == json.load(open(lengths))
    assert length_file("data/lengths", "prolong") == "data/lengths/prolong.json"
    assert source_lengths(os.path.join(REPO, "data", "lengths"), "prolong").size == 77932


def test_tiny_sim_json(lengths, tmp_path, world):
    rep = tmp_path / "rep"
    p = _run("--mode", "sim", "--lengths", lengths, "--seq-lengths", "4096", "--pp", "2",
             "--dp", "2", "--micro-batches", "4", "--sim-steps", "1", "--block-size", "64",
             "--topk", "8", "--sim-models", "qwen05b", "--json", "--report", str(rep), world=world)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    check_cells(out)  # the printed shape, best_baseline and sb_vs_best consistent with arms
    assert out["cost_model"] == "h100-analytic"  # no GPU profile committed (auto)
    assert [(c["model"], c["context"], c["pp"], c["dp"], c["cp"]) for c in out["cells"]] == [
        ("qwen05b", 4096, 2, 2, 1), ("qwen05b", 4096, 2, 2, 2)]
    arms = {"megatron", "sab", "dst", "sparsebalance", "sparsebalance-anchor", "wlb",
            "dp-balanced", "dynamic-cp", "sparsebalance+dcp"}
    assert all(set(c["arms"]) == arms for c in out["cells"])
    assert json.loads((rep / "cells.json").read_text()) == out
    # The detailed summary keeps its shape in the report directory.
    s = json.loads((rep / "summary.json").read_text())
    assert set(s) == {"arms", "speedup_vs_megatron", "sim", "validation"}
    cell = s["sim"]["synthetic"]["4096"]
    assert set(cell) == arms
    assert all(v > 0 for v in cell.values())
    assert (rep / "report.md").is_file() and (rep / "sim.json").is_file()
    assert (rep / "sim_frontier_qwen05b.png").stat().st_size > 0
    # cells are the sim tables pooled: one length file here, so tokens/s = 1e3 x tokens/ms
    sim_tab = json.loads((rep / "sim.json").read_text())["models"]["qwen05b"]["cells"]
    for a, v in out["cells"][0]["arms"].items():
        assert v == pytest.approx(1e3 * sim_tab["synthetic"]["4096"]["arms"][a]["tokens_per_ms"])
    # --sim-cp defaults to 1,2: CP=1 stays where it was, CP=2 is added beside it
    sim = json.loads((rep / "sim.json").read_text())
    m = sim["models"]["qwen05b"]
    assert sim["config"]["cp_sizes"] == [1, 2] and list(m["cp"]) == ["2"]
    cp2 = m["cp"]["2"]["cells"]["synthetic"]["4096"]["arms"]
    assert set(cp2) == set(cell) and cp2["megatron"]["step_ms"] < m["cells"]["synthetic"]["4096"][
        "arms"]["megatron"]["step_ms"]
    report = (rep / "report.md").read_text()
    assert "#### Context parallelism" in report and "| synthetic | 4K | 2 |" in report


def test_sim_cp_1_is_todays_simulation(lengths, tmp_path, world):
    rep = tmp_path / "rep"
    p = _run("--mode", "sim", "--lengths", lengths, "--seq-lengths", "4096", "--pp", "2",
             "--dp", "2", "--micro-batches", "4", "--sim-steps", "1", "--block-size", "64",
             "--topk", "8", "--sim-models", "qwen05b", "--sim-cp", "1", "--report", str(rep), world=world)
    assert p.returncode == 0, p.stderr
    sim = json.loads((rep / "sim.json").read_text())
    assert "cp" not in sim["models"]["qwen05b"] and sim["config"]["cp_sizes"] == [1]
    assert "cp2" not in p.stdout and "Context parallelism" not in (rep / "report.md").read_text()


def _compare_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_real_regime_and_dense_attention():
    """--real-micro-batches sets M (global batch at DP 1); --real-attention dense keeps every
    key block (top-k = the context's blocks - sink - diagonal)."""
    tool = _compare_module()
    cfg = tool._real_config(tool.build_parser().parse_args(
        ["--mode", "real", "--real-micro-batches", "2", "--real-attention", "dense"]))
    assert cfg.micro_batches == 2 and cfg.ranks == 2
    r = cfg.recipe
    assert r.topk == r.seq_length // r.block_size - 2 and r.cap == r.seq_length
    sparse = tool._real_config(tool.build_parser().parse_args(["--mode", "real"]))
    assert sparse.micro_batches == 8 and sparse.recipe.topk == 30


def test_real_runs_take_a_users_indexed_dataset(tmp_path):
    """--data-path: the user's dataset is trained as it is (its prefix in the driver command,
    its token ids the vocabulary) and its lengths, cut to the context, feed the profile."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from benchmarks.harness.compare.arms import get_arm
    from benchmarks.harness.compare.campaign import prepare
    from benchmarks.harness.compare.real import driver_command

    prefix = str(tmp_path / "mine_text_document")
    docs = [[5, 900, 17], list(range(40, 40 + 9000)), [1234] * 700]
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in docs:
        b.add_document(torch.tensor(d, dtype=torch.int32), [len(d)])
    b.finalize(prefix + ".idx")
    tool = _compare_module()
    cfg = tool._real_config(tool.build_parser().parse_args(["--mode", "real", "--data-path", prefix]))
    assert cfg.vocab_size == 40 + 9000 and cfg.data_path == prefix
    flags = cfg.model_flags()
    i = flags.index("--tokenizer-type")
    assert flags[i + 1] == "NullTokenizer" and flags[flags.index("--vocab-size") + 1] == "9040"
    assert "ByteTokenizer" not in flags
    info = prepare(REPO, "unused", cfg, str(tmp_path / "work"), log=lambda *_: None, kinds=())
    assert info["corpus_prefix"] == prefix and info["scale"] == 1.0
    S = cfg.recipe.seq_length
    assert json.load(open(info["lengths_json"])) == [3, min(9000, S), 700]
    assert info["stats"]["documents"] == 3 and "the user's dataset" in info["recipe_lines"][0]
    cmd = driver_command("python", REPO, cfg, get_arm("sab"), info["corpus_prefix"], "s.json",
                         "logs", None, None)
    assert cmd[cmd.index("--data-path") + 1] == prefix
    with pytest.raises(tool.UsageError, match="give one"):
        tool._real_config(tool.build_parser().parse_args(
            ["--mode", "real", "--data-path", prefix, "--corpus-lengths", info["lengths_json"]]))
