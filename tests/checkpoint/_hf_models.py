"""Tiny random Llama / Qwen2 models made locally with transformers (no download)."""

import os

import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            initializer_range=0.1)  # logits of order 1-10, so a layout mix-up is far above 1e-4


def make_hf(out_dir, arch="qwen2", tied=False, vocab=160, shard_kb=None, seed=0, layers=2):
    """Save a random ``arch`` model with ``layers`` layers to ``out_dir`` (sharded when
    ``shard_kb``); returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tiny = dict(TINY, num_hidden_layers=layers)
    if arch == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, tie_word_embeddings=tied, rope_theta=1000000.0, **tiny)
        model = Qwen2ForCausalLM(cfg)
    else:
        # Llama 3.1 RoPE scaling; at head_dim 16 and theta 5e5 it rescales 4 of 8 frequencies.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied, rope_parameters=rope,
                          **dict(tiny, max_position_embeddings=16384))
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    kw = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, **kw)
    return model


PLAIN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 24,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def write_plain_hf(out_dir, drop=(), tensors_of=None, tokens=None, indexed=False, **config):
    """An HF directory written without transformers (fast): ``config.json`` = PLAIN
    updated by ``config``, random tensors of the shapes that config updated by
    ``tensors_of`` implies, minus the names in ``drop``; ``tokens``: a word-level
    ``tokenizer.json`` with that many tokens; ``indexed``: one shard plus a
    ``model.safetensors.index.json`` that still names the dropped tensors."""
    import json

    from safetensors.torch import save_file

    from megatron.training import hf_checkpoint as H

    cfg = dict(PLAIN, **config)
    src = H.read_shape(dict(cfg, **(tensors_of or {}), architectures=PLAIN["architectures"],
                            model_type=PLAIN["model_type"]))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) for n, s in H.hf_shapes(src).items()
               if n in H.hf_names(src) and n not in drop}
    os.makedirs(out_dir, exist_ok=True)
    shard = "model-00001-of-00001.safetensors" if indexed else "model.safetensors"
    save_file(tensors, os.path.join(out_dir, shard))
    if indexed:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {n: shard for n in H.hf_names(src)}}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    if tokens:
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({f"t{i}": i for i in range(tokens)}, unk_token="t0")).save(
            os.path.join(out_dir, "tokenizer.json"))
