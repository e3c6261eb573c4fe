"""Tiny llama.cpp GGUF files written with the ``gguf`` package (no download): a random
Llama of 2 layers (hidden 64, 4 heads, 2 key/value heads), F32 norms, F16 and quantized
matrices (Q8_0, Q4_1, Q4_0, Q5_1), q/k rows permuted as llama.cpp's converter stores them,
and a small byte-level BPE trained here, with control tokens and a chat template."""

import functools
import json
import os

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["def f(x):\n    return x + 1\n\n\ndef g(y):\n    return [y, y * 2]\n",
          "Shopping list:\n  1. apples\n  2. pears\n  3. plums, 42 of them\n",
          "The quick brown fox jumps over the lazy dog; the dog sleeps. " * 3,
          "héllo wörld, naïve café 🙂 -- tabs\tand  double  spaces\n"]
HIDDEN, HEADS, GROUPS, FFN, LAYERS = 64, 4, 2, 96, 2
TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "F16", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q5_1", "output": "Q8_0"}
"""GGML type of each matrix (the K-quants need rows of 256 values: too wide here); norms are F32."""


@functools.lru_cache(maxsize=None)
def tiny_bpe(vocab_size=320):
    """(tokens, merges) of a byte-level BPE trained on :data:`CORPUS`, :data:`SPECIAL` first,
    split as llama.cpp's ``smollm`` pre-tokenizer splits (every digit alone)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tuple(tokens), tuple(merges)


def permute_rows(w, heads):
    """HF's q/k rows -> llama.cpp's (each head's two rotary halves interleaved)."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch="llama", tied=True, seed=0, types=None, pre="smollm"):
    """Write a tiny random model to ``path``; returns its HF-layout tensors by GGUF name.
    ``types``: GGUF name prefix -> GGML type name, overriding :data:`TYPES`."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = tiny_bpe()
    vocab = len(tokens)
    hd = HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HEADS * hd, HIDDEN), f"blk.{i}.attn_k.weight": (GROUPS * hd, HIDDEN),
                       f"blk.{i}.attn_v.weight": (GROUPS * hd, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(GROUPS)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges(list(merges))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    hf = {}
    for name, shape in shapes.items():
        kind = name.split(".")[-2]
        t = (rng.standard_normal(shape) * (0.1 if len(shape) > 1 else 0.2) + (len(shape) == 1)).astype(np.float32)
        hf[name] = t
        if kind in ("attn_q", "attn_k"):
            t = permute_rows(t, HEADS if kind == "attn_q" else GROUPS)
        qtype = gguf.GGMLQuantizationType[(types or {}).get(kind, TYPES.get(kind, "F32"))]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif qtype.name == "Q8_1":  # a type gguf cannot dequantize: bytes of the right size
            _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor(name, np.zeros((shape[0], shape[1] // 32 * nbytes), np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def converted_tiny_model(world, d) -> str:
    """:func:`write_gguf` into ``d/model.gguf``, converted by ``convert.py gguf-to-megatron``
    in the warm ``world`` into ``d/ckpt`` (returned)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    write_gguf(os.path.join(d, "model.gguf"))
    ckpt = os.path.join(d, "ckpt")
    p = world.launch(os.path.join(repo, "tools", "checkpoint", "convert.py"),
                     ["gguf-to-megatron", "--gguf", os.path.join(d, "model.gguf"), "--output", ckpt,
                      "--no-progress-bar"])
    assert p.returncode == 0, p.stderr[-3000:]
    return ckpt
