"""benchmarks/real_accuracy.py's sensitivity-aware DST arm (``--sensitivity estimate``): its plan
keeps slack-only DST's planned step time and kept pairs, moves budget only when the weights
differ, and its report section has the paired interval; the estimator reads the corpus
sidecars, never the scored losses. Planning only (no model): a ``model_flags.txt`` of
SmolLM2-135M's shape is all ``dst_plan`` reads."""

import numpy as np
import pytest

from benchmarks import real_accuracy as R

SMOLLM2_FLAGS = ("--num-layers 30 --hidden-size 576 --ffn-hidden-size 1536 --num-attention-heads 9 "
                 "--group-query-attention --num-query-groups 3 --normalization RMSNorm --swiglu "
                 "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
                 "--vocab-size 49152 --make-vocab-size-divisible-by 1 --max-position-embeddings 8192")
VOCAB = 49152
# The reduced real run's packing at --seq-length 2048 --num-microbatches 12 (where DST has
# freedom at both pipeline depths).
LENGTHS = [[2048], [1901], [2048], [2048], [2048], [1542], [1503], [559, 715], [1017, 553], [760], [2023], [2048]]


def _weights(seed):
    return np.exp(np.random.default_rng(seed).normal(0.0, 1.5, len(LENGTHS)))


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("seed", [0, 2])  # weightings that find a move at both depths (some do not at PP 4)
def test_sens_plan_keeps_step_time_and_pairs_and_moves_budget(args, pp, seed):
    slack = R.dst_plan(args, VOCAB, LENGTHS, pp)
    sp = R.sensitivity_dst_plan(args, VOCAB, LENGTHS, pp, _weights(seed))
    assert np.array_equal(sp["slack_budget"], slack["budget"])
    assert sp["slack_step_ms"] == pytest.approx(slack["step_ms"], rel=1e-9)
    assert sp["step_ms"] <= sp["slack_step_ms"] * (1 + 1e-6)
    assert sp["step_ms"] >= sp["slack_step_ms"] * (1 - 0.01)  # equal planned step time, not a faster plan
    assert abs(sp["planned_attn"] / sp["slack_planned_attn"] - 1) <= R.SENS_PAIRS_TOL + 1e-9
    # not vacuous: the weights move budget, and the moved budget goes up where the weight is high
    assert sp["changed_ops"] > 0 and not np.array_equal(sp["budget"], sp["slack_budget"])
    delta = (np.asarray(sp["budget"]) - np.asarray(sp["slack_budget"])).sum(axis=1)
    w = np.log(_weights(seed))
    assert float((delta * (w - w.mean())).sum()) > 0


def test_sens_plan_follows_the_weights(args):
    """Fails if the weights are ignored: equal weights leave slack-only's plan, and two
    weightings give two plans."""
    equal = R.sensitivity_dst_plan(args, VOCAB, LENGTHS, 4, np.ones(len(LENGTHS)))
    assert np.array_equal(equal["budget"], equal["slack_budget"]) and equal["changed_ops"] == 0
    a, b = (R.sensitivity_dst_plan(args, VOCAB, LENGTHS, 4, _weights(s))["budget"] for s in (0, 2))
    assert not np.array_equal(a, b)


def test_report_section_has_the_paired_interval():
    M = 6
    rng = np.random.default_rng(0)
    per = {"sparsebalance-pp4": {"loss": list(2 + rng.normal(0, 0.1, M)), "tokens": list(range(100, 100 + M)),
                                 "kept_pairs": 1000}}
    per["sparsebalance-pp4-sens"] = {"loss": [x - 0.01 for x in per["sparsebalance-pp4"]["loss"]],
                                     "tokens": per["sparsebalance-pp4"]["tokens"], "kept_pairs": 1001}
    plan = {"slack_step_ms": 10.0, "step_ms": 9.99, "slack_planned_attn": 5.0, "planned_attn": 5.01,
            "changed_ops": 3, "changed_microbatches": 2, "budget": np.full((M, 4), 8), "weight": [1.0] * M}
    out = R.sensitivity_report(per, {"sparsebalance-pp4-sens": plan})["sparsebalance-pp4-sens"]
    lo, med, hi = out["interval"]
    assert lo <= med <= hi and med == pytest.approx(-0.01) and out["mean"] == pytest.approx(-0.01)
    assert out["planned_step_ms"] == {"slack": 10.0, "sens": 9.99}
    assert out["planned_kept_pairs"] == {"slack": 5.0, "sens": 5.01}
    assert out["kept_pairs"] == {"slack": 1000, "sens": 1001} and len(out["per_microbatch"]) == M


def test_sensitivity_flag_needs_a_study_with_documents(tmp_path, args, capsys):
    bad = tmp_path / "study.json"
    bad.write_text('{"documents": [{"source": "code", "length": 4096}]}')
    a = R.build_parser().parse_args(["--load", args.load, "--sensitivity", "estimate",
                                     "--sensitivity-study", str(bad)])
    with pytest.raises(SystemExit) as e:
        R.check_args(a)
    assert e.value.code == 2 and "loss_delta" in capsys.readouterr().err
