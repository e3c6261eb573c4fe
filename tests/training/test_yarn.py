"""YaRN positions (megatron/training/yarn.py): the HF <-> Megatron mapping against both
libraries, the positions a checkpoint records and exports, and a resume that changes them.

* Mapping: for a grid of transformers yarn dicts (defaults, betas, no truncation, both mscales,
  a lone mscale, a given attention_factor, factor left out, a top-level original context),
  megatron-core's ``YarnRotaryEmbedding`` built from the flags :func:`yarn.flags_from_hf` writes
  gives transformers' frequencies and attention factor; and for a grid of Megatron flag values,
  transformers built from :func:`yarn.to_hf` gives megatron-core's.
* Export: :func:`hf_config_positions` writes the YaRN a checkpoint records into ``config.json``
  (either transformers layout), and drops a source yarn a run trained without.
* Resume: a tiny yarn run saves; resuming with another ``--rotary-scaling-factor`` (or plain RoPE)
  is one error line, resuming with its own flags continues.
* Context parallelism: a yarn run (sparse attention) at CP=2 trains as at CP=1 (losses, gradients).
"""

import glob
import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import HARNESS, PRETRAIN, TINY, summary_of

from megatron.training import yarn

HEAD_DIM, THETA, POSITIONS = 16, 10000.0, 200


@pytest.fixture(scope="module", autouse=True)
def cpu_bridge():
    """megatron-core's YaRN moves its frequency tables to the CUDA device at each build."""
    from megatron.training.cpu_bridge import install_cpu_bridge

    install_cpu_bridge(force_cpu=True)


def hf_yarn(rope, **top):
    """(frequencies [POSITIONS, HEAD_DIM / 2], attention factor) transformers builds for ``rope``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=128,
                      rope_parameters={"rope_type": "yarn", "rope_theta": THETA, **rope}, **top)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    return torch.outer(torch.arange(POSITIONS, dtype=torch.float32), inv_freq), factor


def megatron_yarn(values):
    """The same from megatron-core's YarnRotaryEmbedding for Megatron flag values ``values``."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    v = yarn.resolved(values)
    emb = YarnRotaryEmbedding(kv_channels=HEAD_DIM, rotary_base=THETA, use_cpu_initialization=True,
                              scaling_factor=v["rotary_scaling_factor"],
                              original_max_position_embeddings=v["yarn_original_max_position_embeddings"],
                              beta_fast=v["yarn_beta_fast"], beta_slow=v["yarn_beta_slow"], mscale=v["mscale"],
                              mscale_all_dim=v["mscale_all_dim"],
                              correction_range_round_to_int=v["yarn_correction_range_round_to_int"])
    freqs, factor = emb.get_emb(POSITIONS)
    return freqs[:, 0, 0, :HEAD_DIM // 2], factor


def values_of(flags):
    from megatron.training.arguments import build_parser

    args = build_parser("t").parse_args(["--position-embedding-type", "yarn", *flags])
    return yarn.of_args(args)


HF_CASES = {
    "defaults": ({"factor": 4.0, "original_max_position_embeddings": 32}, {}),
    "betas, no truncation": ({"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                              "beta_slow": 2.0, "truncate": False}, {}),
    "both mscales": ({"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.9,
                      "mscale_all_dim": 0.6}, {}),
    "lone mscale (transformers ignores it)": ({"factor": 4.0, "original_max_position_embeddings": 32,
                                               "mscale": 2.0}, {}),
    "attention_factor": ({"factor": 2.5, "original_max_position_embeddings": 48, "attention_factor": 1.25}, {}),
    "factor 1 with attention_factor 1": ({"factor": 1.0, "original_max_position_embeddings": 32,
                                          "attention_factor": 1.0}, {}),
    "top-level original context wins": ({"factor": 4.0, "original_max_position_embeddings": 64},
                                        {"original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("name", HF_CASES)
def test_flags_from_hf_build_transformers_yarn(name):
    rope, top = HF_CASES[name]
    cfg = {"max_position_embeddings": 128, **top}
    ref_freqs, ref_factor = hf_yarn(rope, **top)
    freqs, factor = megatron_yarn(values_of(yarn.flags_from_hf(rope, cfg)))
    assert torch.equal(freqs, ref_freqs), name
    assert factor == pytest.approx(ref_factor, rel=1e-14, abs=0), name
    # the vacuous-pass guard: the scaling really moves the low frequencies and the factor
    if rope["factor"] > 1:
        plain = torch.outer(torch.arange(POSITIONS, dtype=torch.float32),
                            1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        assert (freqs - plain).abs().max() > 1 and ref_factor != 1.0


def test_factor_left_out_is_the_context_ratio():
    rope = {"factor": None, "original_max_position_embeddings": 32}
    values = values_of(yarn.flags_from_hf(rope, {"max_position_embeddings": 128}))
    assert values["rotary_scaling_factor"] == 4.0
    freqs, factor = megatron_yarn(values)
    ref_freqs, ref_factor = hf_yarn(rope)  # transformers: max_position_embeddings / original
    assert torch.equal(freqs, ref_freqs) and factor == pytest.approx(ref_factor, rel=1e-14, abs=0)


MEGATRON_CASES = [
    [],
    ["--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "32"],
    ["--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "32", "--yarn-beta-fast", "8",
     "--yarn-beta-slow", "0.5", "--no-yarn-correction-range-round-to-int"],
    ["--rotary-scaling-factor", "8", "--yarn-original-max-position-embeddings", "20", "--mscale", "0.8",
     "--mscale-all-dim", "0.5"],
    ["--rotary-scaling-factor", "3", "--yarn-original-max-position-embeddings", "40", "--mscale", "0.5"],
    ["--rotary-scaling-factor", "3", "--yarn-original-max-position-embeddings", "40", "--mscale-all-dim", "1"],
]


@pytest.mark.parametrize("flags", MEGATRON_CASES, ids=lambda f: " ".join(f) or "defaults")
def test_to_hf_builds_megatron_yarn(flags):
    values = values_of(flags)
    rope = yarn.to_hf(values)
    freqs, factor = megatron_yarn(values)
    ref_freqs, ref_factor = hf_yarn({k: v for k, v in rope.items() if k != "rope_type"})
    assert torch.equal(freqs, ref_freqs)
    assert ref_factor == pytest.approx(factor, rel=1e-14, abs=0)
    # and back: the flags of that rope dict are the same YaRN
    assert megatron_yarn(values_of(yarn.flags_from_hf(rope, {"max_position_embeddings": 128})))[1] == \
        pytest.approx(factor, rel=1e-14, abs=0)


@pytest.mark.parametrize("rope,says", [
    ({"factor": 2.0, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5 is not supported"),
    ({"factor": 1.0, "original_max_position_embeddings": 32, "attention_factor": 1.2},
     "applies no attention factor without scaling"),
    ({"factor": -2.0, "original_max_position_embeddings": 32}, "factor must be a number > 0"),
])
def test_flags_from_hf_refuses_what_megatron_cannot_build(rope, says):
    with pytest.raises(ValueError, match=says):
        yarn.flags_from_hf(rope, {"max_position_embeddings": 128})


# --- export: the positions a checkpoint records, into config.json ---------------------------------

SAVED_YARN = dict(position_embedding_type="yarn", rotary_scaling_factor=4.0,
                  yarn_original_max_position_embeddings=32768, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                  mscale=1.0, mscale_all_dim=0.0, yarn_correction_range_round_to_int=True)


def test_export_writes_the_recorded_yarn():
    from megatron.training.hf_checkpoint import hf_config_positions

    legacy = {"rope_theta": 1000000.0, "max_position_embeddings": 32768}  # transformers 4.x layout
    out = hf_config_positions(legacy, SAVED_YARN)
    assert out["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                   "beta_fast": 32.0, "beta_slow": 1.0}
    assert out["rope_theta"] == 1000000.0 and "rope_scaling" not in legacy
    v5 = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}  # transformers 5.x layout
    out = hf_config_positions(v5, dict(SAVED_YARN, mscale=0.5, yarn_correction_range_round_to_int=False))
    params = out["rope_parameters"]
    assert params["rope_type"] == "yarn" and params["rope_theta"] == 500000.0 and params["truncate"] is False
    assert params["attention_factor"] == pytest.approx(0.1 * 0.5 * math.log(4) + 1)
    # a run that trained plain RoPE from a yarn config: the export drops the yarn
    out = hf_config_positions({"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}},
                              {"position_embedding_type": "rope"})
    assert out["rope_scaling"] is None
    out = hf_config_positions({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
                              {"position_embedding_type": "rope"})
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    # nothing recorded (an older checkpoint), or plain RoPE on both sides: as it was
    llama3 = {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert hf_config_positions(llama3, {}) is llama3
    assert hf_config_positions(llama3, {"position_embedding_type": "rope"}) is llama3


# --- resume -------------------------------------------------------------------------------

def test_changed_positions():
    from megatron.training.checkpoint_args import changed_positions

    assert changed_positions(SAVED_YARN, dict(SAVED_YARN)) is None
    assert changed_positions(SAVED_YARN, dict(SAVED_YARN, rotary_scaling_factor=8.0)) == \
        "--rotary-scaling-factor 8.0 (the checkpoint's: 4.0)"
    assert changed_positions(SAVED_YARN, {"position_embedding_type": "rope"}) == \
        "--position-embedding-type rope (the checkpoint's: yarn)"
    assert changed_positions({"position_embedding_type": "rope"}, SAVED_YARN) == \
        "--position-embedding-type yarn (the checkpoint's: rope)"
    assert changed_positions({"position_embedding_type": "rope"}, {"position_embedding_type": "none"}) is None
    assert changed_positions({}, SAVED_YARN) is None and changed_positions(None, SAVED_YARN) is None
    # Megatron-LM's namespace leaves the yarn flags None: its defaults
    import argparse

    ns = argparse.Namespace(position_embedding_type="yarn", rotary_scaling_factor=1.0, mscale=1.0,
                            mscale_all_dim=0.0, yarn_beta_fast=None, yarn_beta_slow=None,
                            yarn_original_max_position_embeddings=None, yarn_correction_range_round_to_int=None)
    now = dict(SAVED_YARN, rotary_scaling_factor=1.0, yarn_original_max_position_embeddings=4096)
    assert changed_positions(ns, now) is None


YARN = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "64"]


def test_resume_with_other_positions_is_one_line(world, corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    base = [*TINY, *YARN, "--data-path", corpus, "--split", "1,0,0", "--train-iters", "2"]
    first = world.launch(PRETRAIN, [*base, "--exit-interval", "1", "--save", save])
    assert first.returncode == 0, first.stderr[-3000:]
    for other, says in ((["--rotary-scaling-factor", "8"], "--rotary-scaling-factor 8.0 (the checkpoint's: 4.0)"),
                        (["--position-embedding-type", "rope"], "--position-embedding-type rope (the checkpoint's: "
                                                                "yarn)")):
        p = world.launch(PRETRAIN, [*base, *other, "--load", save])
        lines = [ln for ln in p.stderr.splitlines() if "error" in ln]
        assert p.returncode == 1 and len(lines) == 1, p.stderr[-3000:]
        assert "was trained with other positions: resuming with " + says in lines[0], lines[0]
        assert "Traceback" not in p.stderr
    s = summary_of(world.launch(PRETRAIN, [*base, "--load", save]))
    assert (s["iterations"], s["last_iteration"]) == (1, 2) and math.isfinite(s["losses"][0])
    # --finetune takes only the weights: another YaRN is a context extension, not a resume
    s = summary_of(world.launch(PRETRAIN, [*base, "--rotary-scaling-factor", "8", "--load", save, "--finetune"]))
    assert s["iterations"] == 2 and all(math.isfinite(x) for x in s["losses"])


def test_context_parallel_equals_cp1(world, corpus, tmp_path):
    """megatron-core's THD RoPE takes each CP rank's positions per document under YaRN as under
    RoPE; the CPU bridge's share of YaRN's cos/sin cache keeps its constructor running."""
    runs = {}
    for name, nproc, extra in (("cp1", 1, []), ("cp2", 2, ["--context-parallel-size", "2"])):
        dump = str(tmp_path / name)
        proc = world.launch(HARNESS, [*TINY, *YARN, "--data-path", corpus, "--train-iters", "2", "--sparse-attention",
                                      "--sb-block-size", "16", "--sb-topk", "4", *extra], nproc=nproc,
                            extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        grads = {}
        for f in sorted(glob.glob(os.path.join(dump, "rank*.npz"))):
            with np.load(f) as z:
                grads.update({k: z[k] for k in z.files if k not in grads})
        runs[name] = (json.load(open(os.path.join(dump, "rank0.json"))), grads)
    (ref, ref_grads), (got, got_grads) = runs["cp1"], runs["cp2"]
    assert ref["losses"][0] != ref["losses"][1] and len(ref_grads) > 20
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert sorted(got_grads) == sorted(ref_grads)
    for k, g in ref_grads.items():
        assert np.linalg.norm(got_grads[k] - g) <= 1e-5 * max(np.linalg.norm(g), 1e-30), k
