"""The layer split that equalises predicted stage times (sparsebalance/pipeline/split.py) and
tools/propose_layout.py: minimax against brute force, the predictor's own stage times, flags
that megatron-core places as proposed, one-line errors."""

import argparse
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sparsebalance.pipeline.split import (
    StageCosts,
    layout_string,
    megatron_flags,
    near_even_split,
    pack_in_order,
    propose_split,
    stage_costs,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = ["--num-layers", "30", "--hidden-size", "576", "--num-attention-heads", "9", "--num-query-groups", "3",
           "--ffn-hidden-size", "1536", "--vocab-size", "49152"]


def _compositions(n, k):
    for cuts in itertools.combinations(range(n + k - 1), k - 1):
        bounds = (-1, *cuts, n + k - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(k))


@pytest.mark.parametrize("seed", range(12))
def test_proposal_is_the_brute_force_minimax(seed):
    rng = np.random.default_rng(seed)
    pp, layers = int(rng.integers(2, 5)), int(rng.integers(1, 9))
    extra = np.zeros(pp)
    extra[0], extra[-1] = rng.uniform(0, 1), rng.uniform(0, 4)
    costs = StageCosts(layer_ms=float(rng.uniform(0.3, 1.5)), extra_ms=tuple(extra))
    best = min(costs.stage_ms(c).max() for c in _compositions(layers, pp))
    got = propose_split(costs, layers)
    assert sum(got) == layers and len(got) == pp and min(got) >= 0
    assert costs.stage_ms(got).max() == pytest.approx(best, rel=1e-12)
    assert costs.stage_ms(got).max() <= costs.stage_ms(near_even_split(layers, pp)).max() + 1e-12


def test_costs_are_the_predictors_stage_times():
    """Pricing a split from the mean layer and extras equals the predictor's own stage times
    of a model holding that split (linear in the layers: the proposal's premise)."""
    from sparsebalance.predictor import get_predictor

    mbs = pack_in_order([3000, 500, 7000, 1200, 800, 4096, 250, 9000], 8192, 8)
    assert len(mbs) >= 3 and all(sum(mb) <= 8192 for mb in mbs)
    split = (9, 8, 9, 4)
    pred = get_predictor("h100-analytic", num_layers=30, hidden_size=576, num_attention_heads=9,
                         num_query_groups=3, ffn_hidden_size=1536, vocab_size=49152, block_size=64, topk=8,
                         stage_layers=split)
    costs = stage_costs(pred, mbs, 4, topk=8)
    direct = [np.mean([pred.stage_ms(mb, 8, s, 4, "fwd", calibrated=False)
                       + pred.stage_ms(mb, 8, s, 4, "bwd", calibrated=False) for mb in mbs]) for s in range(4)]
    assert costs.stage_ms(split) == pytest.approx(direct, rel=1e-9)
    assert costs.extra_ms[-1] > costs.extra_ms[0] > 0 and costs.extra_ms[1] == 0


@pytest.mark.parametrize("counts", [(8, 9, 9, 4), (9, 9, 9, 3), (4, 5, 5, 4, 4, 4, 4, 0), (0, 12, 12, 0),
                                    (3, 1), (2, 2, 2), (0, 3, 0, 3, 3, 0), (7, 8, 8, 7)])
def test_flags_place_the_proposed_layers(counts):
    """The printed Megatron-LM flags, given to the driver, make megatron-core build the split."""
    from megatron.training import pipeline_layout
    from megatron.training.arg_checks import stage_layers

    flags = megatron_flags(counts)
    ns = argparse.Namespace(num_layers=sum(counts), pipeline_model_parallel_size=len(counts),
                            num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                            **{d: False if d.startswith("account") else None for d in pipeline_layout.FLAGS})
    for flag, value in zip(flags[::2], flags[1::2]):
        dest = next(d for d, f in pipeline_layout.FLAGS.items() if f == flag)
        setattr(ns, dest, int(value) if value.isdigit() else value)
    assert pipeline_layout.validate(ns) is None
    assert tuple(stage_layers(ns)) == tuple(counts)
    if 0 in counts:
        assert flags[0] == "--pipeline-model-parallel-layout" and layout_string(counts) == flags[1]


def _tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "propose_layout.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_tool_prints_flags_that_equalise_the_stages(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([int(x) for x in np.random.default_rng(0).lognormal(7, 1.2, 4000)]))
    proc = _tool(*SMOLLM2, "--seq-length", "8192", "--pp", "4", "--lengths", str(lengths), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["microbatches"] == 256 and sum(out["stage_layers"]) == 30
    assert max(out["stage_ms"]) < max(out["even"]["stage_ms"]) and out["spread"] < out["even"]["spread"]
    assert out["flags"] == megatron_flags(out["stage_layers"])


@pytest.mark.parametrize("args, expect", [
    (["--pp", "4", "--seq-length", "4096"], "give --model-preset or --num-layers"),
    ([*SMOLLM2, "--pp", "4", "--seq-length", "4096", "--lengths", "/nonexistent.json"], "No such file"),
    ([*SMOLLM2, "--pp", "0", "--seq-length", "4096"], "must be >= 1"),
    ([*SMOLLM2, "--pp", "4", "--seq-length", "4096", "--sb-cost-model", "nope"], "nope"),
])
def test_tool_bad_input_is_one_line(args, expect):
    proc = _tool(*args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert proc.returncode == 2 and len(lines) == 1 and expect in lines[0], proc.stderr


def test_tool_help():
    proc = _tool("--help")
    assert proc.returncode == 0 and "--pipeline-model-parallel-size" in proc.stdout and "--lengths" in proc.stdout
