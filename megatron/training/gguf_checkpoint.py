"""A llama.cpp GGUF file (Llama architecture) read as a Hugging Face Llama checkpoint.

``tools/checkpoint/convert.py gguf-to-megatron`` writes what it reads here through the
same writer as ``hf-to-megatron``; this module only maps:

* :meth:`GGUFModel.hf_config` — the ``llama.*`` metadata as a transformers ``config.json``
  (``LlamaForCausalLM``; tied embeddings when the file has no ``output.weight``).
* :meth:`GGUFModel.get` — an HF tensor name -> its fp32 tensor, dequantized by the ``gguf``
  package. llama.cpp stores ``attn_q`` / ``attn_k`` rows permuted for its RoPE (within each
  head, the two rotary halves interleaved); :func:`unpermute_rows` undoes that, so the
  result equals HF's weights (transformers' GGUF loader undoes the same permutation).
* :meth:`GGUFModel.tokenizer` — the ``tokenizer.ggml.*`` byte-level BPE (``gpt2``) as a
  ``tokenizers`` tokenizer, splitting text as llama.cpp does for the file's
  ``tokenizer.ggml.pre``; :meth:`GGUFModel.tokenizer_config` — special tokens and the chat
  template for ``tokenizer_config.json``.

Anything else (another architecture, a quantization type not listed in :data:`QUANT_TYPES`,
RoPE scaling, an unexpected tensor) is a :class:`ConversionError`.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from megatron.training.hf_checkpoint import ConversionError, Shape, hf_names, hf_shapes, read_shape

QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
               "Q6_K")
"""GGML tensor types this converter dequantizes (through ``gguf.quants.dequantize``)."""

_LAYER_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
"""GGUF ``blk.N.<name>.weight`` -> HF ``model.layers.N.<name>.weight`` (Llama)."""

PRE_TOKENIZERS = {"default": False, "gpt2": False, "smollm": True, "starcoder": True, "refact": True,
                  "codeshell": True}
"""``tokenizer.ggml.pre`` -> whether llama.cpp splits off every digit (``\\p{N}``) before
GPT-2's split (llama-vocab.cpp's regex lists for these pre-tokenizer types); GPT-2's split
is the one ``tokenizers``' ``ByteLevel`` pre-tokenizer applies."""


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k layout -> HF's: ``w`` is ``[heads * hd, d]``; within each head,
    llama.cpp's row ``2 i + j`` (``j`` in 0, 1) is HF's row ``j * hd / 2 + i``."""
    hd = w.shape[0] // heads
    return w.reshape(heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


class GGUFModel:
    """A GGUF file's Llama model: its config, tensors by HF name, and tokenizer."""

    def __init__(self, path: str):
        import gguf

        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # gguf raises IndexError, ValueError, ... on a damaged file
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise ConversionError(f"{path}: not a readable GGUF file ({detail})") from None
        self.path = path
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ConversionError(f"{path}: general.architecture {arch!r} is not supported (known: llama)")
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type.name not in QUANT_TYPES:
                raise ConversionError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which is not "
                                      f"supported (known: {', '.join(QUANT_TYPES)})")
        self.config = self._config()
        self.shape: Shape = read_shape(self.config)
        self._check_tensors()

    def field(self, key: str, default=None):
        """The metadata value of ``key`` (a list for arrays), or ``default``."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _config(self) -> dict:
        m = lambda key, default=None: self.field("llama." + key, default)  # noqa: E731
        for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
            if not isinstance(m(key), int):
                raise ConversionError(f"{self.path}: metadata llama.{key} is missing or not one integer")
        heads, hidden = m("attention.head_count"), m("embedding_length")
        if not isinstance(m("attention.head_count_kv", heads), int):  # a list: per-layer counts
            raise ConversionError(f"{self.path}: per-layer llama.attention.head_count_kv is not supported")
        if m("expert_count", 0):
            raise ConversionError(f"{self.path}: a mixture of experts (llama.expert_count) is not supported")
        if m("rope.scaling.type", "none") != "none" or "rope_freqs.weight" in self.tensors:
            raise ConversionError(f"{self.path}: RoPE scaling is not supported")
        for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
            if m(key, hidden // heads) != hidden // heads:
                raise ConversionError(f"{self.path}: llama.{key} {m(key)} != embedding_length / head_count "
                                      f"({hidden // heads}) is not supported")
        tokens = self.field("tokenizer.ggml.tokens") or []
        vocab = m("vocab_size") or len(tokens) or int(self.tensors["token_embd.weight"].shape[1])
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "num_hidden_layers": m("block_count"), "hidden_size": hidden,
               "intermediate_size": m("feed_forward_length"), "num_attention_heads": heads,
               "num_key_value_heads": m("attention.head_count_kv", heads), "head_dim": hidden // heads,
               "vocab_size": vocab, "max_position_embeddings": m("context_length", 4096),
               "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
               "rope_parameters": {"rope_type": "default", "rope_theta": float(m("rope.freq_base", 10000.0))},
               "tie_word_embeddings": "output.weight" not in self.tensors,
               "attention_bias": False, "mlp_bias": False, "dtype": "float32"}
        for name in ("bos", "eos", "pad"):
            token_id = self.field(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
            if token_id is not None:
                cfg[f"{name}_token_id"] = token_id
        return cfg

    def _where(self) -> Dict[str, str]:
        """HF tensor name -> GGUF tensor name."""
        out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
        if not self.shape.tied:
            out["lm_head.weight"] = "output.weight"
        for i in range(self.shape.layers):
            out.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for g, hf in _LAYER_TENSORS.items()})
        return out

    def _check_tensors(self) -> None:
        self.where = self._where()
        extra = sorted(set(self.tensors) - set(self.where.values()))
        if extra:
            raise ConversionError(f"{self.path}: tensor {extra[0]} is not part of a Llama model of "
                                  f"{self.shape.layers} layers")
        shapes = hf_shapes(self.shape)
        for hf in hf_names(self.shape):
            t = self.tensors.get(self.where[hf])
            if t is None:
                raise ConversionError(f"{self.path}: missing tensor {self.where[hf]}")
            got = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions fastest first
            if got != shapes[hf]:
                raise ConversionError(f"{self.path}: tensor {t.name} has shape {list(got)}, the metadata "
                                      f"implies {list(shapes[hf])}")

    def get(self, hf_name: str) -> torch.Tensor:
        """The fp32 tensor HF calls ``hf_name``."""
        from gguf.quants import dequantize

        t = self.tensors[self.where[hf_name]]
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(hf_shapes(self.shape)[hf_name])
        if hf_name.endswith("q_proj.weight"):
            w = unpermute_rows(w, self.shape.heads)
        elif hf_name.endswith("k_proj.weight"):
            w = unpermute_rows(w, self.shape.groups)
        return w

    def special_tokens(self) -> Dict[str, str]:
        """``bos_token`` etc. -> the token text, for the ids the metadata names."""
        tokens = self.field("tokenizer.ggml.tokens")
        out = {}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
            token_id = self.field(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None:
                out[f"{name}_token"] = tokens[token_id]
        return out

    def tokenizer(self):
        """The file's byte-level BPE as a ``tokenizers.Tokenizer``."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        kind, pre = self.field("tokenizer.ggml.model"), self.field("tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise ConversionError(f"{self.path}: tokenizer.ggml.model {kind!r} is not supported (known: gpt2)")
        if pre not in PRE_TOKENIZERS:
            raise ConversionError(f"{self.path}: tokenizer.ggml.pre {pre!r} is not supported "
                                  f"(known: {', '.join(PRE_TOKENIZERS)})")
        tokens: List[str] = self.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges") or []]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        split = [pre_tokenizers.ByteLevel(add_prefix_space=bool(self.field("tokenizer.ggml.add_space_prefix")))]
        if PRE_TOKENIZERS[pre]:
            split.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(split)
        tok.decoder = decoders.ByteLevel()
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == 3])  # CONTROL
        tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == 4])  # USER_DEFINED
        bos = self.special_tokens().get("bos_token")
        if self.field("tokenizer.ggml.add_bos_token") and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokens.index(bos))])
        return tok

    def tokenizer_config(self) -> dict:
        """``tokenizer_config.json``: special tokens, BOS/EOS handling and the chat template."""
        cfg = dict(self.special_tokens(), tokenizer_class="PreTrainedTokenizerFast",
                   add_bos_token=bool(self.field("tokenizer.ggml.add_bos_token")),
                   add_eos_token=bool(self.field("tokenizer.ggml.add_eos_token")),
                   model_max_length=self.config["max_position_embeddings"])
        template = self.field("tokenizer.chat_template")
        if template is not None:
            cfg["chat_template"] = template
        return cfg
