"""Megatron-LM's pipeline-split flags: per-stage layer counts by upstream's rule, refusals in
one line, PP=2 runs that train with each flag and hold the layers asked for, and the split
recorded in checkpoints (a resume with another split refuses in one line)."""

import argparse
import glob
import os
import re

import numpy as np
import pytest
from conftest import HARNESS, TINY

from megatron.training import pipeline_layout
from megatron.training.arg_checks import stage_layers


def _args(num_layers, pp, first=None, last=None, embedding=False, loss=False, layout=None, vpl=None, vstages=None):
    return argparse.Namespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                              decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                              account_for_embedding_in_pipeline_split=embedding,
                              account_for_loss_in_pipeline_split=loss, pipeline_model_parallel_layout=layout,
                              num_layers_per_virtual_pipeline_stage=vpl, num_virtual_stages_per_pipeline_rank=vstages)


def _upstream_counts(a):
    """Megatron-LM's placement written out from its documentation, independently of the code
    under test: uneven ends take their counts and the middle splits the rest; counted
    embedding / loss are layers of an even split, built as nothing; a layout lists its t's."""
    pp = a.pipeline_model_parallel_size
    if a.pipeline_model_parallel_layout is not None:
        text = a.pipeline_model_parallel_layout.replace(",", "")
        while "(" in text:
            text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        return [stage.count("t") for stage in text.split("|")]
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        ends = [x for x in (first, last) if x is not None]
        middle = (a.num_layers - sum(ends)) // (pp - len(ends)) if pp > len(ends) else 0
        counts = [middle] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    extra = int(a.account_for_embedding_in_pipeline_split) + int(a.account_for_loss_in_pipeline_split)
    counts = [(a.num_layers + extra) // pp] * pp
    counts[0] -= int(a.account_for_embedding_in_pipeline_split)
    counts[-1] -= int(a.account_for_loss_in_pipeline_split)
    return counts


CASES = {
    "even": _args(30, 5),
    "first": _args(30, 4, first=6),
    "last": _args(30, 4, last=6),
    "both ends": _args(30, 4, first=7, last=7),
    "embedding counted": _args(31, 4, embedding=True),
    "loss counted": _args(31, 4, loss=True),
    "both counted": _args(30, 4, embedding=True, loss=True),
    "layout": _args(30, 4, layout="Ettttttt|(tttttttt|)*2,tttttttL"),
    "layout, empty first stage": _args(4, 2, layout="E|ttttL"),
    "layout, SmolLM2 at PP=8": _args(30, 8, layout="Etttt|(tttt|)*6,ttL"),
    "counted at PP=1 (a no-op)": _args(4, 1, embedding=True, loss=True),
    "layout at PP=1": _args(4, 1, layout="EttttL"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stage_layers_follow_upstreams_rule(name):
    a = CASES[name]
    assert pipeline_layout.validate(a) is None
    got = stage_layers(a)
    assert got == _upstream_counts(a)
    assert sum(got) == a.num_layers and len(got) == a.pipeline_model_parallel_size


def _upstream_chunks(a):
    """Megatron-LM's placement of the counted split under the interleaved schedule, written out
    from validate_args and get_num_layers_to_build's documentation: the units (layers plus the
    counted embedding / loss) spread evenly over PP x VPP chunks, virtual stage c * PP + r; the
    first chunk builds one layer fewer for the embedding, the last one fewer for the loss."""
    pp, counted = a.pipeline_model_parallel_size, [a.account_for_embedding_in_pipeline_split,
                                                   a.account_for_loss_in_pipeline_split]
    units = a.num_layers + sum(counted)
    vpp = a.num_virtual_stages_per_pipeline_rank or units // pp // a.num_layers_per_virtual_pipeline_stage
    chunks = [units // (pp * vpp)] * (pp * vpp)
    chunks[0] -= int(counted[0])
    chunks[-1] -= int(counted[1])
    return chunks


INTERLEAVED = {
    # Megatron-LM's functional test gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split
    "functional-test config": _args(6, 4, embedding=True, loss=True, vstages=2),
    "both counted, PP=2": _args(6, 2, embedding=True, loss=True, vstages=2),
    "embedding counted, layers per chunk": _args(7, 2, embedding=True, vpl=2),
    "loss counted, three chunks": _args(5, 2, loss=True, vpl=1),
}


@pytest.mark.parametrize("name", list(INTERLEAVED))
def test_counted_split_with_the_interleaved_schedule_follows_upstream(name):
    a = INTERLEAVED[name]
    assert pipeline_layout.validate(a) is None
    chunks = pipeline_layout.chunk_layers(a)
    assert chunks == _upstream_chunks(a)
    pp = a.pipeline_model_parallel_size
    assert stage_layers(a) == [sum(chunks[r::pp]) for r in range(pp)] and sum(chunks) == a.num_layers


REFUSED = {
    "counted layers must split evenly": (_args(30, 4, embedding=True), "(31) is not divisible by"),
    "uneven and counted together": (_args(30, 4, first=6, loss=True),
                                    "--decoder-first-pipeline-num-layers cannot be set with "
                                    "--account-for-loss-in-pipeline-split"),
    "layout with another split flag": (_args(30, 2, embedding=True, layout="Ettttttttttttttt|tttttttttttttttL"),
                                       "--pipeline-model-parallel-layout cannot be set with"),
    "layout layer count": (_args(30, 2, layout="Ett|tL"),
                           "the layout holds 3 transformer layers (t), --num-layers is 30"),
    "layout stages": (_args(4, 2, layout="Et|t|t|tL"), "4 stages for --pipeline-model-parallel-size 2"),
    "layout embedding placement": (_args(4, 2, layout="tt|EttL"), "the embedding (E) must be on the first stage"),
    "layout grammar": (_args(4, 2, layout="Ett|ttX"), "Invalid layer character: X"),
    "uneven needs a pipeline": (_args(4, 1, last=2), "needs --pipeline-model-parallel-size >= 2"),
    "middle stages hold a layer": (_args(4, 3, first=2, last=2), "leaves 0 layer(s) for the other 1 stage(s)"),
    "counted units per stage into chunks": (_args(6, 4, embedding=True, loss=True, vstages=4),
                                            "the 2 layers per stage (2 of them counted) are not divisible by "
                                            "--num-virtual-stages-per-pipeline-rank 4"),
    "uneven stages with the interleaved schedule": (_args(6, 2, first=2, vstages=2),
                                                    "--decoder-first-pipeline-num-layers with the interleaved "
                                                    "schedule is not supported here"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_in_one_line(name):
    a, expect = REFUSED[name]
    error = pipeline_layout.validate(a)
    assert error is not None and expect in error and "\n" not in error, error


def test_uneven_stages_with_the_interleaved_schedule_refused(capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([*TINY, "--mock-data", "--pipeline-model-parallel-size", "2",
                    "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-last-pipeline-num-layers", "2",
                    "--num-layers", "6"], world_size=2)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "with the interleaved schedule is not supported" in lines[0]


def test_functional_test_config_resolves_as_upstream():
    """Megatron-LM's PP=4 x VP=2 config with the embedding and the loss counted: 2 chunks per
    rank, chunks of 0 and 1 layers as megatron-core builds them, priced so by the predictor and
    accepted by the recompute rule (a chunk of no layer has nothing to recompute)."""
    from megatron.training.arguments import parse_args
    from megatron.training.sb_config import sparsebalance_config
    from sparsebalance.balancer import build_predictor

    flags = ["--mock-data", "--num-layers", "6", "--pipeline-model-parallel-size", "4",
             "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--sb-cost-model", "h100-analytic",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    args = parse_args([*TINY, *flags, "--num-virtual-stages-per-pipeline-rank", "2"], world_size=4)
    want = _upstream_chunks(_args(6, 4, embedding=True, loss=True, vstages=2))
    assert args.virtual_pipeline_model_parallel_size == 2 and want == [0, 1, 1, 1, 1, 1, 1, 0]
    assert stage_layers(args) == [1, 2, 2, 1]
    predictor = build_predictor(sparsebalance_config(args, 1024))
    assert [predictor.shape.layers_of(j, 8) for j in range(8)] == want
    # --num-layers-per-virtual-pipeline-stage counts the units per stage as Megatron-LM does: 2 / 1
    same = parse_args([*TINY, *flags, "--num-layers-per-virtual-pipeline-stage", "1"], world_size=4)
    assert same.virtual_pipeline_model_parallel_size == 2 and stage_layers(same) == [1, 2, 2, 1]


RUNS = {  # flags at PP=2 -> global layer indices each rank trains
    "embedding counted": (["--num-layers", "3", "--account-for-embedding-in-pipeline-split"], [[0], [1, 2]]),
    "loss counted": (["--num-layers", "3", "--account-for-loss-in-pipeline-split"], [[0, 1], [2]]),
    "layout": (["--pipeline-model-parallel-layout", "Ettt|tL"], [[0, 1, 2], [3]]),
    # 8 units over 2 ranks x 2 chunks: chunks [embedding + 0], [1, 2], [3, 4], [5 + loss]
    "interleaved, both counted": (["--num-layers", "6", "--num-virtual-stages-per-pipeline-rank", "2",
                                   "--account-for-embedding-in-pipeline-split",
                                   "--account-for-loss-in-pipeline-split"], [[0, 3, 4], [1, 2, 5]]),
    # 3 layers over 2 stages: the predictor decides which stage takes the extra layer
    "auto layout": (["--num-layers", "3", "--sb-auto-layout", "--sb-cost-model", "h100-analytic"], [[0, 1], [2]]),
}


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    out = {}
    for name, (flags, _) in RUNS.items():
        dump, save = str(root / name.replace(" ", "_")), str(root / (name.replace(" ", "_") + "_ckpt"))
        keep = ["--save", save] if name in ("layout", "auto layout") else []  # the checkpoints read below
        proc = world.launch(HARNESS, [*TINY, "--mock-data", "--pipeline-model-parallel-size", "2", *flags,
                                      "--train-iters", "1", *keep], nproc=2,
                            extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        layers = []
        for f in sorted(glob.glob(os.path.join(dump, "rank*.npz"))):
            with np.load(f) as z:
                assert all(np.isfinite(z[k]).all() for k in z.files)
                layers.append(sorted({int(k.split("layers.")[1].split(".")[0]) for k in z.files if "layers." in k}))
        out[name] = (layers, save)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_pp2_run_trains_the_layers_asked_for(runs, name):
    assert runs[name][0] == RUNS[name][1]


def test_resume_with_another_split_refused_in_one_line(runs):
    from megatron.training.checkpointing import load_checkpoint

    save = runs["layout"][1]
    recorded = pipeline_layout.record(_args(4, 2, layout="Ettt|tL"))
    other = pipeline_layout.record(_args(4, 2, last=1))  # the same layers, other flags: a different split record
    with pytest.raises(ValueError) as e:
        load_checkpoint(save, None, None, None, None, split=other)
    line = str(e.value)
    assert "\n" not in line and "another pipeline split" in line and "--decoder-last-pipeline-num-layers 1" in line
    assert pipeline_layout.mismatch(recorded, recorded) is None
    # two spellings of one layout are one split
    assert pipeline_layout.record(_args(4, 2, layout="Et*3|tL")) == recorded
    from megatron.core import dist_checkpointing

    from megatron.training.checkpointing import iter_dir, read_tracker

    def common(save):
        return dist_checkpointing.load_common_state_dict(iter_dir(save, read_tracker(save)))

    assert common(save)["pipeline_split"] == recorded  # the split the run trained with
    # --sb-auto-layout records the flags it chose: a resume with it chooses them again
    assert common(runs["auto layout"][1])["pipeline_split"] == pipeline_layout.record(_args(3, 2, first=2))


@pytest.mark.parametrize("flags, layers", [(["--decoder-first-pipeline-num-layers", "1"], [1, 3]),
                                           (["--pipeline-model-parallel-layout", "E|ttttL"], [0, 4]),
                                           (["--account-for-loss-in-pipeline-split", "--num-layers", "5"], [3, 2])])
def test_predictor_prices_each_stages_own_layers(flags, layers):
    """SAB's and DST's predictor (built from the run's flags) counts the layers megatron-core builds."""
    from megatron.training.arguments import parse_args
    from megatron.training.sb_config import sparsebalance_config
    from sparsebalance.balancer import build_predictor

    args = parse_args([*TINY, "--mock-data", "--pipeline-model-parallel-size", "2", "--sb-cost-model",
                       "h100-analytic", *flags], world_size=2)
    predictor = build_predictor(sparsebalance_config(args, 1024))
    assert [predictor.shape.layers_of(s, 2) for s in range(2)] == layers == stage_layers(args)
    mb = [200, 56]
    per_layer = predictor.layer_ms(mb, None, "fwd")
    for s in range(2):
        assert predictor.stage_ms(mb, None, s, 2, "fwd") == pytest.approx(
            layers[s] * per_layer + predictor.extras_ms(mb, s, 2, "fwd"))
