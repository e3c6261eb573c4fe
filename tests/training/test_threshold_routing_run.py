"""``--sb-routing threshold`` through the driver: the flags resolve (TAU default 0.9, the
budget is the cap, --sb-topk-min the least count), bad values are one line, and a real
SparseBalance run (PP=1, SAB + DST tuning the cap) trains with content-dependent
densities recorded in its summary."""

import pytest
from conftest import PRETRAIN, TINY, summary_of


def _parse(argv, data="unused", world_size=None):
    from megatron.training.arguments import parse_args

    return parse_args([*TINY, "--data-path", data, "--train-iters", "2", *argv], world_size=world_size)


@pytest.mark.parametrize("argv, said", [
    (["--sparse-attention", "--sb-routing", "threshold", "--sb-threshold", "1.5"], "--sb-threshold must be in (0, 1]"),
    (["--sparse-attention", "--sb-threshold", "0.8"], "--sb-threshold needs --sb-routing threshold"),
    (["--sparse-attention", "--sb-threshold-counts", "per-block"],
     "--sb-threshold-counts needs --sb-routing threshold"),
    (["--sparse-attention", "--sb-routing", "threshold", "--sb-threshold-counts", "per-layer"], "invalid choice"),
    (["--sb-routing", "threshold"], "--sb-routing threshold needs --sparse-attention"),
    (["--sparse-attention", "--sb-routing", "window"], "invalid choice"),
    (["--sparse-attention", "--sb-attention-backend", "fa4", "--context-parallel-size", "2"],
     "--sb-attention-backend fa4 does not run with --context-parallel-size > 1"),
])
def test_bad_threshold_flags_are_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(argv, world_size=2 if "--context-parallel-size" in argv else None)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0]


@pytest.mark.parametrize("counts, per_head", [([], True), (["--sb-threshold-counts", "per-head"], True),
                                              (["--sb-threshold-counts", "per-block"], False)])
def test_flags_reach_the_config_and_the_layer_spec(corpus, counts, per_head):
    from megatron.training.model import layer_spec
    from megatron.training.sb_config import attention_config

    args = _parse(["--sparse-attention", "--sb-routing", "threshold", "--sb-topk", "6", "--sb-topk-min", "1",
                   *counts], corpus)
    assert args.sb_threshold == 0.9 and args.sb_threshold_counts == ("per-head" if per_head else "per-block")
    att = attention_config(args)
    assert (att.threshold, att.topk_min, att.topk, att.per_head) == (0.9, 1, 6, per_head)
    params = layer_spec(args).submodules.self_attention.submodules.core_attention.params
    assert params["threshold"] == 0.9 and params["topk_min"] == 1 and params["topk"] == 6
    assert params["per_head"] is per_head
    topk = _parse(["--sparse-attention"], corpus)
    assert layer_spec(topk).submodules.self_attention.submodules.core_attention.params["threshold"] is None
    assert attention_config(topk).threshold is None


def test_sparse_balance_trains_under_threshold_routing(corpus, tmp_path, world):
    flags = [*TINY, "--data-path", corpus, "--train-iters", "4", "--sparse-balance", "--sb-routing", "threshold",
             "--sb-threshold", "0.6", "--sb-block-size", "16", "--sb-topk", "8", "--sb-topk-min", "0",
             "--sb-cost-model", "h100-analytic", "--summary-json", str(tmp_path / "s.json")]
    s = summary_of(world.launch(PRETRAIN, flags))
    assert s["iterations"] == 4 and all(x == x for x in s["losses"])
    assert s["args"]["sb_routing"] == "threshold" and s["args"]["sb_threshold"] == 0.6
    assert 0.0 < s["density_mean"] < 1.0
