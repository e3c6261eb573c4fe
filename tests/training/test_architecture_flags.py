"""Megatron-LM's architecture and optimizer flags that megatron-core implements and the
driver wires: ``--apply-layernorm-1p``, ``--qk-layernorm``, ``--attention-output-gate``,
``--rotary-interleaved``, ``--squared-relu``, ``--test-mode`` (TransformerConfig / layer spec, with the
sparse core attention still in its slot) and ``--decoupled-lr`` / ``--decoupled-min-lr`` /
``--apply-wd-to-qk-layernorm`` (optimizer parameter groups)."""

import json
import math
import os
import re
import types

import pytest
import torch
from conftest import TINY, summary_of

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_arch_worker.py")
ARCH = ["--apply-layernorm-1p", "--qk-layernorm", "--attention-output-gate", "--rotary-interleaved",
        "--squared-relu", "--test-mode"]
LR, DLR, DMIN, STEPS = 1e-3, 5e-4, 4.5e-5, 3


def test_flags_reach_the_model_and_the_param_groups(world, corpus, tmp_path):
    dump = tmp_path / "dump.json"
    flags = [*TINY, "--data-path", corpus, "--train-iters", str(STEPS), "--sparse-attention", "--sb-block-size",
             "32", "--sb-topk", "2", *ARCH, "--decoupled-lr", str(DLR), "--decoupled-min-lr", str(DMIN),
             "--apply-wd-to-qk-layernorm", "--weight-decay", "0.1"]
    proc = world.launch(WORKER, flags, extra_env={"SB_TEST_DUMP": str(dump)})
    s = summary_of(proc)
    assert all(math.isfinite(x) for x in s["losses"]) and len(s["losses"]) == STEPS
    d = json.load(open(dump))
    m = d["model"]
    assert m["core_attention"] == "SparseAttention"
    assert m["zero_centered_gamma"] and m["qk_layernorm"] and m["attention_output_gate"] and m["rotary_interleaved"]
    assert m["activation"] == "squared_relu"
    assert m["norms"] == ["_ZeroCenteredLayerNorm"]
    assert m["qkv_out"] == 4 * 64  # query + key + value + the gate (4 heads of 16, no GQA)
    # --test-mode: megatron-core's q/k-norm consistency check ran in every attention forward
    # (4 layers x 4 micro-batches x 3 steps; the forward-only passes of evaluation add none here)
    assert d["realtime_tests"] == 4 * 4 * STEPS
    by_param = {p: g for g in d["groups"] for p in g["params"]}
    outer = ("embedding.word_embeddings.weight", "output_layer.weight")
    for name, g in by_param.items():
        want = (DLR, DMIN) if name in outer else (LR, 0.0)
        assert (g["max_lr"], g["min_lr"]) == pytest.approx(want), name
        # 1-D parameters and biases get no weight decay, except the q/k layernorms' (megatron-core)
        qk = "q_layernorm." in name or "k_layernorm." in name
        flat = name.endswith(".bias") or "layernorm" in name
        assert g["wd_mult"] == (1.0 if qk or not flat else 0.0), name
    for g in d["groups"]:  # cosine from each group's own peak to its own minimum
        want = [g["min_lr"] + (g["max_lr"] - g["min_lr"]) * 0.5 * (1 + math.cos(math.pi * t / STEPS))
                for t in range(1, STEPS + 1)]
        assert g["lrs"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    # the log line's LR is the --lr group's (step 1 applies the peak)
    assert float(re.search(r"iter +1/.*?\| lr ([0-9.e+-]+)", proc.stdout).group(1)) == pytest.approx(LR)


def _cfg(**kw):
    base = dict(normalization="LayerNorm", layernorm_zero_centered_gamma=True, memory_efficient_layer_norm=False,
                sequence_parallel=False)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centered_norm_scales_by_one_plus_weight(normalization):
    from sparsebalance.attention.spec import TorchNorm, TorchQKNorm

    torch.manual_seed(0)
    x = torch.randn(5, 8)
    norm = TorchNorm(_cfg(normalization=normalization), 8, eps=1e-5)
    assert torch.count_nonzero(norm.weight) == 0  # starts as the plain norm
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    plain = torch.nn.functional.layer_norm(x, (8,), norm.weight + 1, norm.bias, 1e-5) \
        if normalization == "LayerNorm" else torch.nn.functional.rms_norm(x, (8,), norm.weight + 1, 1e-5)
    torch.testing.assert_close(norm(x), plain)
    sp = _cfg(normalization=normalization, sequence_parallel=True)
    assert all(p.sequence_parallel for p in TorchNorm(sp, 8).parameters())
    assert not any(getattr(p, "sequence_parallel", False) for p in TorchQKNorm(sp, 8).parameters())


def test_rotary_interleaved_reaches_rope(mp):
    """The driver's TransformerConfig makes megatron-core's RoPE rotate interleaved pairs."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron.training.arguments import parse_args
    from megatron.training.model import transformer_config

    base = [*TINY, "--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer"]
    configs = [transformer_config(parse_args(base + extra, world_size=1), use_cpu=True)
               for extra in ([], ["--rotary-interleaved"])]
    t, freqs = torch.randn(6, 1, 2, 8), torch.rand(6, 1, 1, 8)
    plain, interleaved = (apply_rotary_pos_emb(t, freqs, c) for c in configs)
    assert not torch.allclose(plain, interleaved)
    pairs = t.view(6, 1, 2, 4, 2)  # GPT-J's rotation: (x0, x1) -> (-x1, x0) within each pair
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).view_as(t)
    torch.testing.assert_close(interleaved, t * freqs.cos() + rotated * freqs.sin())
