"""muP (``--use-mup``, megatron/training/mup.py) against a hand computation of Megatron-LM main's
rules (its ``TransformerConfig.__post_init__`` and ``get_mup_config_overrides``, read, not copied).

The tiny GPT (hidden 64, 4 heads of 16, 4 layers, ``--init-method-std`` 0.02) with
``--mup-base-hidden-size 16``: width multiplier m = 4, so hidden weights N(0, 0.02 / 2), the
attention and MLP output projections N(0, 0.02 / (sqrt(8) x 2)), embeddings and the untied
output layer N(0, 0.02); softmax scale 1 / 16; logits x 1/4; matrix-like hidden parameters at
LR / 4 and Adam epsilon / 4, everything else at the base values.
"""

import json
import math
import os

import pytest
import torch
from conftest import TINY, parsed, refused_line, summary_of

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_mup_worker.py")
QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local", "--lr", "1e-3",
         "--train-iters", "2", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128"]
MUP = ["--use-mup", "--mup-base-hidden-size", "16"]


def test_width_and_output_multipliers_resolve_as_upstream():
    args = parsed(QUIET, *MUP)
    assert args.mup_width_mult == 4.0 and args.mup_output_mult == 0.25
    base = parsed(QUIET, "--use-mup")  # base model: m = 1, nothing rescaled
    assert base.mup_base_hidden_size == 64 and base.mup_width_mult == 1.0 and base.mup_output_mult == 1.0
    given = parsed(QUIET, *MUP, "--mup-output-mult", "0.5", "--mup-width-mult", "7")  # upstream recomputes m
    assert given.mup_output_mult == 0.5 and given.mup_width_mult == 4.0


def test_softmax_scale_and_init_fields():
    from megatron.training import mup
    from megatron.training.model import transformer_config

    config = transformer_config(parsed(QUIET, *MUP), use_cpu=True)
    assert config.softmax_scale == pytest.approx(1 / 16)
    # sqrt(--mup-base-head-dim) / kv ** power: standard scaling at the base head size
    assert mup.softmax_scale(parsed(QUIET, *MUP, "--mup-base-head-dim", "16", "--mup-attn-scale-power",
                                    "0.5")) == pytest.approx(1.0)
    assert config.init_method.keywords["std"] == pytest.approx(0.01)
    assert config.output_layer_init_method.keywords["std"] == pytest.approx(0.02 / (math.sqrt(8) * 2))
    assert config.embedding_init_method.keywords["std"] == pytest.approx(0.02)


def test_without_use_mup_the_mup_flags_change_nothing():
    from megatron.training import mup

    args = parsed(QUIET, "--mup-base-hidden-size", "16", "--mup-embedding-mult", "3")
    assert mup.config_fields(args) == {} and mup.optimizer_overrides(args, None) is None


def test_mup_with_multi_latent_attention_is_refused(capsys):
    line = refused_line(capsys, QUIET, *MUP, "--multi-latent-attention")
    assert "--use-mup with --multi-latent-attention is not supported" in line


class _Chunk(torch.nn.Module):
    """A stand-in for a GPTModel chunk: an embedding and an output layer returning (logits, bias)."""

    class _Out(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((5, 3), 0.5))

        def forward(self, x):
            return x @ self.weight.t(), None

    def __init__(self):
        super().__init__()
        self.pre_process = self.post_process = True
        self.embedding = torch.nn.Embedding(5, 3)
        self.output_layer = self._Out()


def test_multipliers_and_untied_output_init_on_a_chunk():
    from megatron.training import mup

    args = parsed(QUIET, *MUP, "--mup-embedding-mult", "2.5", "--untie-embeddings-and-output-weights")
    chunk = _Chunk()
    tokens = torch.tensor([1, 2])
    emb, x = chunk.embedding(tokens), torch.ones(2, 3)
    mup.apply_to_chunk(args, chunk)
    assert torch.equal(chunk.embedding(tokens), emb * 2.5)
    assert torch.allclose(chunk.output_layer.weight, torch.full((5, 3), 1.0))
    logits, bias = chunk.output_layer(x)  # weight now 0.5 x sqrt(4); logits x 1/4
    assert bias is None and torch.allclose(logits, torch.full((2, 5), 3 * 1.0 * 0.25))
    assert chunk.embedding.weight.is_embedding_parameter and chunk.output_layer.weight.is_embedding_parameter


def test_mup_trains_with_upstreams_init_groups_and_checkpoint(world, corpus, tmp_path):
    from megatron.training.checkpoint_args import read_checkpoint_args

    dump, save = tmp_path / "dump.json", str(tmp_path / "ckpt")
    s = summary_of(world.launch(WORKER, [*TINY, *MUP, "--data-path", corpus, "--train-iters", "2", "--save", save],
                                extra_env={"SB_TEST_DUMP": str(dump)}))
    assert s["iterations"] == 2 and all(math.isfinite(x) for x in s["losses"])
    d = json.load(open(dump))
    want = {"qkv": 0.01, "proj": 0.02 / (math.sqrt(8) * 2), "fc2": 0.02 / (math.sqrt(8) * 2),
            "embedding": 0.02, "output": 0.02}
    for name, std in want.items():
        assert d["std"][name] == pytest.approx(std, rel=0.05), name
    assert d["softmax_scale"] == pytest.approx(1 / 16)
    hidden = [g for g in d["groups"] if any(".linear_qkv.weight" in p for p in g["params"])]
    assert len(hidden) == 1 and hidden[0]["max_lr"] == pytest.approx(1e-3 / 4)
    assert hidden[0]["eps"] == pytest.approx(1e-8 / 4) and hidden[0]["min_lr"] == pytest.approx(0.0)
    assert all(".weight" in p and "layernorm" not in p and "embedding" not in p and "output_layer" not in p
               for p in hidden[0]["params"])
    base = [g for g in d["groups"] if g is not hidden[0]]
    assert {p for g in base for p in g["params"]} >= {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert all(g["max_lr"] == pytest.approx(1e-3) and g["eps"] == pytest.approx(1e-8) for g in base)
    saved = read_checkpoint_args(save)
    assert saved["use_mup"] and saved["mup_base_hidden_size"] == 16 and saved["mup_output_mult"] == 0.25
