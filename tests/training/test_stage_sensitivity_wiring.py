"""--sb-stage-sensitivity: profile file -> flags -> DSTConfig.stage_weight -> the balancer's plan."""

import json

import numpy as np
import pytest
from conftest import PRETRAIN, TINY, balancer_config, summary_of

from benchmarks.sensitivity_sim import SMOLLM2
from sparsebalance.balancer import Balancer
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.from_predictor import build_instance

# The reduced real run's packing (tests/benchmarks/compare/test_real_accuracy_sens.py).
LENGTHS = [[[2048], [1901], [2048], [2048], [2048], [1542], [1503], [559, 715], [1017, 553], [760], [2023], [2048]]]


def _plan(pp, stage_weight):
    cfg = balancer_config(pp=pp, topk=8, topk_min=4, topk_max=16, plan_ahead=False, stage_weight=stage_weight)
    return Balancer(cfg, get_predictor("h100-analytic", **SMOLLM2, block_size=64, topk=8)).plan(LENGTHS)


def test_balancer_refines_by_stage_at_the_same_step_time():
    """PP=8, a profile that calls stage 0 sensitive: the plan changes (more budget on stage 0),
    never slower and never fewer kept pairs than slack-only DST's; equal weights change nothing."""
    off = _plan(8, None)
    assert np.array_equal(_plan(8, (0.5,) * 8).budget, off.budget)
    on = _plan(8, (4.0,) + (1.0,) * 7)
    assert on.step_ms <= off.step_ms * (1 + 1e-9)
    inst = build_instance(get_predictor("h100-analytic", **SMOLLM2, block_size=64, topk=8), LENGTHS,
                          pp=8, k0=8, kmin=4, kmax=16)
    a_off, a_on = (objective(inst, inst.indices(p.budget))[1] for p in (off, on))
    assert a_on >= a_off * (1 - 1e-12)
    assert on.budget[0, :, 0].sum() > off.budget[0, :, 0].sum()


def _profile(path, stages=(1, 2), num_layers=4):
    prof = [{"stages": P, "nats_per_pair": [1.0 + s for s in range(P)]} for P in stages]
    path.write_text(json.dumps({"format": "sb-stage-sensitivity", "version": 1, "num_layers": num_layers,
                                "profiles": prof}))
    return str(path)


def test_flags(tmp_path):
    from megatron.training.arg_checks import UsageError, validate_balance
    from megatron.training.arguments import build_parser
    from megatron.training.sb_config import sparsebalance_config

    def check(*flags):
        args = build_parser().parse_args(["--sparse-balance", "--sb-cost-model", "h100-analytic", "--num-layers", "4",
                                          "--hidden-size", "64", "--num-attention-heads", "4", *flags])
        validate_balance(args)
        return args

    good = _profile(tmp_path / "p.json")
    args = check("--sb-stage-sensitivity", good, "--pipeline-model-parallel-size", "2")
    assert args.sb_stage_weight == pytest.approx((2 / 3, 4 / 3))  # [1, 2] scaled to mean 1
    assert sparsebalance_config(args, 256).dst.stage_weight == args.sb_stage_weight
    assert check().sb_stage_weight is None  # the default: slack-only DST
    with pytest.raises(UsageError, match="needs --sb-dst"):
        check("--sb-dst", "off", "--sb-stage-sensitivity", good)
    with pytest.raises(UsageError, match="no 4-stage split"):
        check("--sb-stage-sensitivity", good, "--pipeline-model-parallel-size", "4")
    with pytest.raises(UsageError, match="4-layer model, this one has 8"):
        check("--sb-stage-sensitivity", good, "--num-layers", "8")
    with pytest.raises(UsageError, match=r"none\.json: cannot read"):
        check("--sb-stage-sensitivity", str(tmp_path / "none.json"))
    from sparsebalance.config import DSTConfig

    with pytest.raises(ValueError, match="stage_weight"):
        DSTConfig(policy="critical-path", stage_weight=(0.0, -1.0))
    with pytest.raises(ValueError, match="one weight per stage"):
        balancer_config(pp=2, stage_weight=(1.0, 2.0, 3.0))


def test_driver_trains_with_a_stage_profile(long_corpus, world, tmp_path):
    """--sb-stage-sensitivity end to end at PP=2 (the profile read, checked against the run's
    depth and split, and handed to the planner every step)."""
    profile = _profile(tmp_path / "p.json", stages=(2,), num_layers=4)
    proc = world.launch(PRETRAIN, [*TINY, "--seq-length", "1024", "--data-path", long_corpus, "--train-iters", "2",
                                   "--pipeline-model-parallel-size", "2", "--sparse-balance", "--sb-block-size", "32",
                                   "--sb-topk", "4", "--sb-cost-model", "h100-analytic",
                                   "--sb-stage-sensitivity", profile], nproc=2, timeout=300)
    summary = summary_of(proc)
    assert summary["iterations"] == 2
    assert summary["args"]["sb_stage_sensitivity"] == profile
