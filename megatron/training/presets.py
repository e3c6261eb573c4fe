"""Named model shapes for ``--model-preset``: the flags of published checkpoints.

Each preset is a ``{argparse dest: value}`` map that becomes the parser's
defaults before parsing, so an explicit flag always wins over the preset. The
numbers are those of each model's Hugging Face ``config.json`` (Qwen2.5 base
models; Meta-Llama-3-8B). Llama 3 (not 3.1) uses no RoPE scaling; for a Llama
3.1 checkpoint add ``--use-rope-scaling`` (``tools/checkpoint/convert.py``
prints the flags of any converted checkpoint).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

# Both families: grouped-query attention (Megatron-LM reads --num-query-groups only with
# --group-query-attention) and no dropout (their config.json's attention_dropout 0.0)
_COMMON = dict(group_query_attention=True, hidden_dropout=0.0, attention_dropout=0.0)
_QWEN2 = dict(_COMMON, normalization="RMSNorm", swiglu=True, position_embedding_type="rope", rotary_base=1000000,
              norm_epsilon=1e-6, add_qkv_bias=True, disable_bias_linear=True, init_method_std=0.02,
              make_vocab_size_divisible_by=1)

MODEL_PRESETS: Dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN2, num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936, untie_embeddings_and_output_weights=False),
    "qwen2.5-1.5b": dict(_QWEN2, num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                         num_query_groups=2, vocab_size=151936, untie_embeddings_and_output_weights=False),
    "qwen2.5-3b": dict(_QWEN2, num_layers=36, hidden_size=2048, ffn_hidden_size=11008, num_attention_heads=16,
                       num_query_groups=2, vocab_size=151936, untie_embeddings_and_output_weights=False),
    "qwen2.5-7b": dict(_QWEN2, num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                       num_query_groups=4, vocab_size=152064, untie_embeddings_and_output_weights=True),
    "llama3-8b": dict(_COMMON, normalization="RMSNorm", swiglu=True, position_embedding_type="rope", rotary_base=500000,
                      norm_epsilon=1e-5, add_qkv_bias=False, disable_bias_linear=True, init_method_std=0.02,
                      make_vocab_size_divisible_by=1, num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                      num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                      untie_embeddings_and_output_weights=True),
}
"""``--model-preset`` name -> argparse defaults it sets."""


def preset_in(argv: Sequence[str]) -> Optional[str]:
    """The ``--model-preset`` value in ``argv`` (last one wins), or None.

    An unknown name is returned as is; argparse's ``choices`` then rejects it."""
    name = None
    for i, tok in enumerate(argv):
        if tok == "--model-preset" and i + 1 < len(argv):
            name = argv[i + 1]
        elif tok.startswith("--model-preset="):
            name = tok.split("=", 1)[1]
    return name

