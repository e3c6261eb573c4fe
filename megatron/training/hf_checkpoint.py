"""Hugging Face Llama / Qwen2 checkpoints <-> this driver's GPTModel weights.

Pure mapping, no I/O of our checkpoint format (``tools/checkpoint/convert.py``
does that through megatron's own sharded state dict):

* :func:`flags_from_hf_config` — ``config.json`` -> ``pretrain_gpt.py`` flags of the
  same architecture (RoPE scaling: yarn, :mod:`megatron.training.yarn`, and Llama 3.1's);
  anything this model cannot express is a :class:`ConversionError`.
* :func:`hf_config_positions` — the other way for positions: a checkpoint's recorded YaRN
  back into ``config.json``.
* :func:`megatron_from_hf` / :func:`hf_from_megatron` — per-tensor name and layout
  mapping. Megatron fuses the attention input projection per query group:
  ``linear_qkv`` rows are, for each of the G groups, the ``N/G`` query heads of
  that group, then its key head, then its value head (each ``head_dim`` rows). The
  gated MLP's ``linear_fc1`` is ``[gate; up]`` stacked along rows.

Names are those of megatron-core's local (non-Transformer-Engine) layer spec,
which is what the driver builds on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from megatron.training import yarn

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
"""``config.json`` architectures this converter knows -> their ``model_type``."""


class ConversionError(ValueError):
    """Input the converter cannot take (reported as one ``error:`` line, exit 2)."""


@dataclass(frozen=True)
class Shape:
    """The dimensions the tensor mapping needs, read from ``config.json``."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Model width."""
    heads: int
    """Query heads N."""
    groups: int
    """Key/value heads G (N % G == 0)."""
    ffn: int
    """MLP width (gate and up each)."""
    vocab: int
    """Embedding rows."""
    qkv_bias: bool
    """Query/key/value projections carry a bias (Qwen2)."""
    tied: bool
    """``tie_word_embeddings``: no ``lm_head.weight`` in the HF files."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _rope(cfg: dict) -> Tuple[float, dict]:
    """(theta, scaling dict or {}) from a transformers 4.x or 5.x config."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = dict(cfg.get("rope_scaling") or {})
    if params.get("rope_type", "default") != "default":
        scaling = dict(params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), ({} if kind == "default" else scaling)


def read_shape(cfg: dict) -> Shape:
    """Validate ``config.json`` for this converter and return its :class:`Shape`."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ConversionError(f"config.json: architecture {arch!r} is not supported "
                              f"(known: {', '.join(ARCHITECTURES)})")
    if cfg.get("model_type", ARCHITECTURES[arch]) != ARCHITECTURES[arch]:
        # e.g. a Mistral config with a Qwen2 architectures line: which one is meant is unknown
        raise ConversionError(f"config.json: model_type {cfg['model_type']!r} disagrees with architectures "
                              f"{cfg['architectures']} (a {arch} has model_type {ARCHITECTURES[arch]!r}); "
                              "fix the one that is wrong")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise ConversionError(f"config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    groups = cfg.get("num_key_value_heads") or heads
    if hidden % heads or heads % groups:
        raise ConversionError(f"config.json: hidden_size {hidden}, {heads} heads and {groups} key/value "
                              "heads do not divide evenly")
    if cfg.get("head_dim") not in (None, hidden // heads):
        raise ConversionError(f"config.json: head_dim {cfg['head_dim']} != hidden_size / heads "
                              f"({hidden // heads}) is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise ConversionError("config.json: mlp_bias is not supported")
    if arch == "LlamaForCausalLM" and cfg.get("attention_bias"):
        raise ConversionError("config.json: Llama attention_bias (bias on q, k, v and o) is not supported")
    if cfg.get("use_sliding_window"):
        raise ConversionError("config.json: use_sliding_window is not supported")
    return Shape(layers=cfg["num_hidden_layers"], hidden=hidden, heads=heads, groups=groups,
                 ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                 qkv_bias=arch == "Qwen2ForCausalLM", tied=bool(cfg.get("tie_word_embeddings", False)))


def flags_from_hf_config(cfg: dict) -> List[str]:
    """``pretrain_gpt.py`` flags that build the model of ``config.json``."""
    s = read_shape(cfg)
    theta, scaling = _rope(cfg)
    if theta != int(theta):
        raise ConversionError(f"config.json: rope_theta {theta} is not an integer (--rotary-base takes one)")
    kind = scaling.get("rope_type", scaling.get("type"))
    flags = ["--num-layers", str(s.layers), "--hidden-size", str(s.hidden), "--ffn-hidden-size", str(s.ffn),
             "--num-attention-heads", str(s.heads), "--group-query-attention", "--num-query-groups", str(s.groups),
             "--normalization", "RMSNorm", "--norm-epsilon", repr(float(cfg.get("rms_norm_eps", 1e-6))),
             "--swiglu", "--position-embedding-type", "yarn" if kind == "yarn" else "rope",
             "--untie-embeddings-and-output-weights", "--rotary-base", str(int(theta)),
             "--disable-bias-linear", "--vocab-size", str(s.vocab), "--make-vocab-size-divisible-by", "1",
             "--init-method-std", repr(float(cfg.get("initializer_range", 0.02))),
             "--max-position-embeddings", str(int(cfg.get("max_position_embeddings", 4096))),
             # these models train without hidden dropout; Megatron-LM's defaults are 0.1
             "--hidden-dropout", "0", "--attention-dropout", repr(float(cfg.get("attention_dropout", 0.0)))]
    if s.qkv_bias:
        flags.append("--add-qkv-bias")
    if kind == "yarn":  # megatron-core's YarnRotaryEmbedding (yarn.flags_from_hf says what maps to what)
        try:
            flags += yarn.flags_from_hf(scaling, cfg)
        except ValueError as e:
            raise ConversionError(f"config.json: {e}") from None
    elif scaling:
        want = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        if kind != "llama3" or any(float(scaling.get(k, -1)) != v for k, v in want.items()):
            raise ConversionError(f"config.json: rope scaling {scaling} is not supported (only yarn, and llama3 "
                                  "with low/high frequency factors 1/4 and original context 8192)")
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(scaling["factor"]))]
    return flags


def hf_config_positions(cfg: dict, saved: dict) -> dict:
    """``config.json`` ``cfg`` with the RoPE scaling a checkpoint's saved model flags ``saved``
    were trained with: yarn written from them (:func:`yarn.to_hf`; into ``rope_parameters``
    where ``cfg`` has them, transformers 5's place, else into ``rope_scaling``), a source yarn
    dropped when the run trained plain RoPE; otherwise ``cfg`` as it is (older checkpoints record
    no positions; the Llama 3.1 scaling is not recorded)."""
    kind = saved.get("position_embedding_type")
    theta, scaling = _rope(cfg)
    source_yarn = scaling.get("rope_type", scaling.get("type")) == "yarn"
    if kind != "yarn" and not (kind == "rope" and source_yarn):
        return cfg
    out = dict(cfg)
    rope = yarn.to_hf(saved) if kind == "yarn" else {"rope_type": "default"}
    if kind == "yarn" and "original_max_position_embeddings" in cfg:  # transformers prefers the top-level one
        out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if "rope_parameters" in cfg:
        params = cfg.get("rope_parameters") or {}
        keep = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
        out["rope_parameters"] = {**rope, "rope_theta": theta, **keep}
        out.pop("rope_scaling", None)
    else:
        out["rope_scaling"] = rope if kind == "yarn" else None
    return out


def _layer(i: int) -> Tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def hf_names(s: Shape) -> List[str]:
    """Every tensor name the HF files must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if s.tied else ["lm_head.weight"])
    for i in range(s.layers):
        h, _ = _layer(i)
        names += [h + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")]
        if s.qkv_bias:
            names += [h + f"self_attn.{p}_proj.bias" for p in "qkv"]
    return names


def hf_shapes(s: Shape) -> Dict[str, Tuple[int, ...]]:
    """Expected shape of each HF tensor."""
    d, q, kv = s.hidden, s.heads * s.head_dim, s.groups * s.head_dim
    by_suffix = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d),
                 "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (d, q),
                 "gate_proj.weight": (s.ffn, d), "up_proj.weight": (s.ffn, d), "down_proj.weight": (d, s.ffn)}
    out = {"model.embed_tokens.weight": (s.vocab, d), "model.norm.weight": (d,), "lm_head.weight": (s.vocab, d)}
    for name in hf_names(s):
        if name not in out:
            out[name] = by_suffix[".".join(name.split(".")[-2:])]
    return out


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """HF q/k/v (weights ``[heads*hd, d]`` or biases ``[heads*hd]``) -> megatron ``linear_qkv``."""
    per, hd = s.heads // s.groups, s.head_dim
    tail = q.shape[1:]
    parts = [q.reshape(s.groups, per * hd, *tail), k.reshape(s.groups, hd, *tail), v.reshape(s.groups, hd, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, s: Shape) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    per, hd = s.heads // s.groups, s.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(s.groups, (per + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [per * hd, hd, hd], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


Getter = Callable[[str], torch.Tensor]


def megatron_from_hf(s: Shape, get: Getter) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(megatron name, tensor)`` for the whole model, reading HF tensors one by one
    through ``get(name)``. A tied model's output layer is its embedding (copied:
    the driver trains an untied output layer unless a preset ties them)."""
    yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
    for i in range(s.layers):
        h, m = _layer(i)
        yield m + "input_layernorm.weight", get(h + "input_layernorm.weight")
        attn = h + "self_attn."
        yield m + "self_attention.linear_qkv.weight", fuse_qkv(
            get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), s)
        if s.qkv_bias:
            yield m + "self_attention.linear_qkv.bias", fuse_qkv(
                get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), s)
        yield m + "self_attention.linear_proj.weight", get(attn + "o_proj.weight")
        yield m + "pre_mlp_layernorm.weight", get(h + "post_attention_layernorm.weight")
        yield m + "mlp.linear_fc1.weight", torch.cat([get(h + "mlp.gate_proj.weight"), get(h + "mlp.up_proj.weight")])
        yield m + "mlp.linear_fc2.weight", get(h + "mlp.down_proj.weight")
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    yield "output_layer.weight", get("model.embed_tokens.weight" if s.tied else "lm_head.weight")


def hf_from_megatron(s: Shape, get: Getter, tied: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for the whole model from megatron tensors ``get(name)``;
    ``tied``: leave out ``lm_head.weight`` (it equals the embedding)."""
    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
    for i in range(s.layers):
        h, m = _layer(i)
        yield h + "input_layernorm.weight", get(m + "input_layernorm.weight")
        attn = h + "self_attn."
        for p, t in zip("qkv", split_qkv(get(m + "self_attention.linear_qkv.weight"), s)):
            yield attn + f"{p}_proj.weight", t
        if s.qkv_bias:
            for p, t in zip("qkv", split_qkv(get(m + "self_attention.linear_qkv.bias"), s)):
                yield attn + f"{p}_proj.bias", t
        yield attn + "o_proj.weight", get(m + "self_attention.linear_proj.weight")
        yield h + "post_attention_layernorm.weight", get(m + "pre_mlp_layernorm.weight")
        gate, up = torch.split(get(m + "mlp.linear_fc1.weight"), [s.ffn, s.ffn])
        yield h + "mlp.gate_proj.weight", gate.contiguous()
        yield h + "mlp.up_proj.weight", up.contiguous()
        yield h + "mlp.down_proj.weight", get(m + "mlp.linear_fc2.weight")
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if not tied:
        yield "lm_head.weight", get("output_layer.weight")
