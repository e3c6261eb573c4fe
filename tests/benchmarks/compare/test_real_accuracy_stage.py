"""benchmarks/real_accuracy.py's stage-aware DST arm (``--sensitivity stage``): the stage profile's
weights reach the plan (corrected for a 30-layer model planned as 32), the plan keeps
slack-only DST's planned step time and kept pairs and moves budget towards the stage the
profile calls sensitive (fails when the weights are ignored). Planning only (no model), as
``test_real_accuracy_sens.py``."""

import json

import numpy as np
import pytest
from test_real_accuracy_sens import LENGTHS, SMOLLM2_FLAGS, VOCAB

from benchmarks import real_accuracy as R


def _profile(hot_last: bool) -> dict:
    def vals(P):
        v = np.ones(P)
        v[-1 if hot_last else 0] = 4.0
        return (v * 1e-8).tolist()
    return {"format": "sb-stage-sensitivity", "version": 1, "num_layers": 30,
            "profiles": [{"stages": 4, "nats_per_pair": vals(4), "layer_ranges": [[1, 8], [9, 16], [17, 23], [24, 30]]},
                         {"stages": 8, "nats_per_pair": vals(8)}]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    (d / "model_flags.txt").write_text(SMOLLM2_FLAGS)
    (d / "x.idx").write_text("")  # passes the corpus check; planning reads no corpus
    for hot in (True, False):
        (d / f"stage_{'last' if hot else 'first'}.json").write_text(json.dumps(_profile(hot)))
    return d


def _args(ckpt, which):
    a = R.build_parser().parse_args(["--load", str(ckpt), "--num-microbatches", "1", "--data-path", str(ckpt / "x"),
                                     "--num-samples", "0", "--sensitivity", "stage",
                                     "--stage-sensitivity", str(ckpt / f"stage_{which}.json")])
    R.check_args(a)
    return a


def test_stage_weight_counts_the_model_layers_of_each_stage(ckpt):
    a = _args(ckpt, "last")
    w = R.stage_weight(a, 4, 30, 32)  # stages of 8/8/7/7 layers planned as 8 each
    base = a.stage_profile.weights(4, 30)
    assert np.allclose(w, base * np.array([8, 8, 7, 7]) / 8)


# (PP=4, first stage hot) has no move: slack-only DST already runs stage 0 at the largest budget
@pytest.mark.parametrize("pp,which", [(4, "last"), (8, "last"), (8, "first")])
def test_stage_plan_keeps_step_time_and_pairs_and_follows_the_profile(ckpt, pp, which):
    a = _args(ckpt, which)
    slack = R.dst_plan(a, VOCAB, LENGTHS, pp)
    w = np.tile(R.stage_weight(a, pp, 30, slack["planned_layers"]), (len(LENGTHS), 1))
    sp = R.sensitivity_dst_plan(a, VOCAB, LENGTHS, pp, w)
    assert np.array_equal(sp["slack_budget"], slack["budget"])
    assert sp["slack_step_ms"] * (1 - 0.01) <= sp["step_ms"] <= sp["slack_step_ms"] * (1 + 1e-6)
    assert abs(sp["planned_attn"] / sp["slack_planned_attn"] - 1) <= R.SENS_PAIRS_TOL + 1e-9
    hot = pp - 1 if which == "last" else 0
    delta = (np.asarray(sp["budget"]) - np.asarray(sp["slack_budget"])).sum(axis=0)  # per stage
    assert sp["changed_ops"] > 0 and delta[hot] > 0, delta
    # levels leave only stages that weigh less than the hot one (PP=8's 3-layer stages weigh
    # 3/4 of the others per planned pair, so they give levels to the 4-layer ones as well)
    assert all(w[0, s] < w[0, hot] for s in range(pp) if delta[s] < 0), delta


def test_stage_flags_go_together(ckpt, capsys):
    a = R.build_parser().parse_args(["--load", str(ckpt), "--num-samples", "0", "--num-microbatches", "0",
                                     "--stage-sensitivity", str(ckpt / "stage_last.json")])
    with pytest.raises(SystemExit) as e:
        R.check_args(a)
    assert e.value.code == 2 and "go together" in capsys.readouterr().err
