"""--sb-dst-sensitivity: flags -> DSTConfig -> the balancer's plan, and the weights of a packed step."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import PRETRAIN, TINY, balancer_config, summary_of

from benchmarks.sensitivity_sim import SMOLLM2, fixture_study
from sparsebalance.balancer import Balancer, SensitivityWeights
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.sensitivity import microbatch_weights

STUDY = fixture_study(seed=1, docs_per_source=4)
LENGTHS = [[[9000, 3000], [12000], [2000, 2000, 2000], [7000, 5000], [300, 11000], [6000]]]
SEGS = [[[(0, 0, 9000), (1, 0, 3000)], [(2, 0, 12000)], [(3, 0, 2000), (4, 0, 2000), (5, 0, 2000)],
         [(6, 0, 7000), (7, 0, 5000)], [(8, 0, 300), (9, 0, 11000)], [(10, 0, 6000)]]]
SOURCES = ["code", "filler", "code", "csv", "csv", "csv", "prose", "prose", "repeat", "filler", "pydoc"]


def _weights():
    return SensitivityWeights.from_study(STUDY, sources=SOURCES)


def test_weights_of_a_packed_step_padding_and_sources():
    sw = _weights()
    packing = SimpleNamespace(ranks=SEGS)
    w = sw(packing, LENGTHS)
    assert w.shape == (1, 6) and np.all(w > 0)
    code, pydoc, filler = sw.documents([2, 10, 1], [6000] * 3)  # by each document's source
    assert code > 1.5 * pydoc > 10 * filler
    sens = [[list(sw.documents([x[0] for x in mb], [x[2] for x in mb])) for mb in SEGS[0]]]
    assert np.allclose(w, microbatch_weights(LENGTHS, sens, 8, 64))
    padded = [[mb + [512] for mb in LENGTHS[0]]]  # the interleaved schedule's padding segment
    assert np.allclose(sw(packing, padded), w)  # 512 tokens drop nothing at top-8 of 64
    with pytest.raises(ValueError, match="loss_delta"):
        SensitivityWeights.from_study({"documents": [{"source": "a", "length": 10}]})


def _plan(sensitivity, weight):
    cfg = balancer_config(pp=2, topk=8, topk_min=4, topk_max=16, plan_ahead=False, sensitivity=sensitivity,
                          sensitivity_study=None if sensitivity == "off" else "study.json")
    pred = get_predictor("h100-analytic", **SMOLLM2, block_size=64, topk=8)
    return Balancer(cfg, pred).plan(LENGTHS, weight)


def test_balancer_refines_at_the_same_step_time():
    w = _weights()(SimpleNamespace(ranks=SEGS), LENGTHS)
    off, on = _plan("off", w), _plan("estimate", w)
    assert np.array_equal(_plan("off", None).budget, off.budget)  # weights unused when off
    assert np.array_equal(_plan("estimate", np.ones((1, 6))).budget, off.budget)  # equal weights
    assert on.step_ms <= off.step_ms * (1 + 1e-9)
    from sparsebalance.tuning.from_predictor import build_instance

    inst = build_instance(get_predictor("h100-analytic", **SMOLLM2, block_size=64, topk=8), LENGTHS,
                          pp=2, k0=8, kmin=4, kmax=16)
    a_off, a_on = objective(inst, inst.indices(off.budget))[1], objective(inst, inst.indices(on.budget))[1]
    assert a_on >= a_off * (1 - 1e-12)


def test_flags(tmp_path):
    from megatron.training.arg_checks import UsageError, validate_balance
    from megatron.training.arguments import build_parser

    def check(*flags):
        args = build_parser().parse_args(["--sparse-balance", "--sb-cost-model", "h100-analytic", *flags])
        validate_balance(args)
        return args

    with pytest.raises(UsageError, match="--sb-sensitivity-study"):
        check("--sb-dst-sensitivity", "estimate")
    with pytest.raises(UsageError, match="needs --sb-dst"):
        check("--sb-dst", "off", "--sb-dst-sensitivity", "estimate", "--sb-sensitivity-study", "x")
    with pytest.raises(UsageError, match="needs --sb-dst-sensitivity"):
        check("--sb-sensitivity-study", "x")
    assert check().sb_dst_sensitivity == "off"  # the default
    args = check("--sb-dst-sensitivity", "estimate", "--sb-sensitivity-study", "s.json")
    assert args.sb_dst_sensitivity == "estimate"
    from sparsebalance.config import DSTConfig

    with pytest.raises(ValueError, match="sensitivity"):
        DSTConfig(policy="critical-path", sensitivity="estimate")  # no study
    with pytest.raises(ValueError, match="sensitivity"):
        DSTConfig(policy="critical-path", sensitivity="oracle", sensitivity_study="s.json")


def test_driver_trains_with_sensitivity_estimate(long_corpus, world, tmp_path):
    """--sb-dst-sensitivity estimate end to end (no source sidecar: the estimator
    falls back to its length buckets, so weights still vary between micro-batches)."""
    study = tmp_path / "study.json"
    study.write_text(json.dumps(fixture_study(seed=2, docs_per_source=4, block_size=32, topk=4)))
    proc = world.launch(PRETRAIN, [*TINY, "--seq-length", "1024",
                                   "--data-path", long_corpus, "--train-iters", "2", "--sparse-balance",
                                   "--sb-block-size", "32", "--sb-topk", "4", "--sb-cost-model", "h100-analytic",
                                   "--sb-dst-sensitivity", "estimate", "--sb-sensitivity-study", str(study)],
                        nproc=1, timeout=300)
    summary = summary_of(proc)
    assert summary["iterations"] == 2
    assert summary["args"]["sb_dst_sensitivity"] == "estimate"
