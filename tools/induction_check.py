"""Can a model configuration learn in-context copying, and how fast, at a given context length?

Needle retrieval needs content-based copying (an induction head: find where the
current token occurred before and copy what followed it). This tool trains a GPT
in one process on the simplest such task and reports how copy accuracy grows:
each sample is ``pre + SPAN + gap + SPAN``, with SPAN random capitals and pre/gap
random lowercase letters of random lengths up to ``--max-gap`` (so the distance
to copy from varies and a fixed-offset head cannot solve it). The loss is on the
second SPAN; accuracy is measured on span tokens 2.. of a fixed held-out batch
(the first one follows random filler and cannot be predicted).

``--model megatron`` builds the GPT exactly as the driver does (megatron-core's
``GPTModel`` with our dense varlen attention, packed THD batches, RoPE);
``--model reference`` is a minimal pure-PyTorch GPT of the same shape (pre-LN,
RoPE, untied output), a yardstick for whether a slow start is the task's or
the implementation's.

Prints JSON on stdout (and to ``--output``): the curve, the final accuracy (mean of the last five
evaluations) and the first step reaching 0.5 and 0.9 (null: not reached);
progress lines go to stderr.

    OMP_NUM_THREADS=1 .venv/bin/python tools/induction_check.py --max-gap 20 --steps 3000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

PROG = "induction_check.py"


def fail(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def parse_args(argv=None):
    p = _Parser(prog=PROG, description="Train a GPT on in-context copying and report how fast it learns.")
    p.add_argument("--model", choices=("megatron", "reference"), default="megatron")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--smeared-keys", action="store_true",
                   help="keys also carry the previous token's key (pretrain_gpt.py --smeared-keys)")
    p.add_argument("--qk-conv", type=int, default=0, metavar="N",
                   help="queries and keys through an N-tap causal convolution (pretrain_gpt.py --qk-conv; "
                        "--model megatron only)")
    p.add_argument("--span", type=int, default=24, help="characters to copy")
    p.add_argument("--max-gap", type=int, default=150,
                   help="longest filler before the span and between the copies (drawn uniformly from 0..N)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", help="also write the JSON here (written whole or not at all)")
    a = p.parse_args(argv)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "steps", "batch",
                 "eval_interval", "eval_samples", "threads"):
        if getattr(a, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.span < 2:
        fail(f"--span must be >= 2, got {a.span}")
    if a.qk_conv == 1 or a.qk_conv < 0:
        fail(f"--qk-conv must be 0 (off) or >= 2 taps, got {a.qk_conv}")
    if a.qk_conv and a.model != "megatron":
        fail("--qk-conv is built into the driver's model only (--model megatron)")
    if a.max_gap < 0:
        fail(f"--max-gap must be >= 0, got {a.max_gap}")
    if not a.lr > 0:
        fail(f"--lr must be > 0, got {a.lr}")
    if a.output and not os.path.isdir(os.path.dirname(os.path.abspath(a.output))):
        fail(f"--output: directory of {a.output} does not exist")
    head_dim, rem = divmod(a.hidden_size, a.num_attention_heads)
    if rem or head_dim % 2:
        fail(f"--hidden-size {a.hidden_size} must split into --num-attention-heads {a.num_attention_heads} "
             "heads of even size (RoPE)")
    return a


def make_sampler(span: int, max_gap: int, seed: int):
    """``sample() -> (tokens, start)``: ``tokens[start:]`` is the second copy of the span."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def letters(lo: int, n: int) -> torch.Tensor:
        return torch.randint(lo, lo + 26, (n,), generator=g)

    def sample():
        code = letters(ord("A"), span)
        pre = letters(ord("a"), int(torch.randint(0, max_gap + 1, (1,), generator=g)))
        gap = letters(ord("a"), int(torch.randint(0, max_gap + 1, (1,), generator=g)))
        seq = torch.cat([pre, code, gap, code])
        return seq, len(seq) - span

    return sample


def reference_gpt(layers: int, hidden: int, heads: int, vocab: int = 256, smeared_keys: bool = False):
    """A minimal pre-LN GPT with RoPE: ``model([T_i] tensors) -> [T_i, vocab] logits``;
    ``smeared_keys`` mixes each rotated key with the one before it as the driver does."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dh = hidden // heads

    def rope(x):  # [1, H, T, dh]: rotate dim pairs (i, i + dh/2) by position-dependent angles
        T = x.shape[-2]
        inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
        ang = torch.arange(T).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.key_smear = nn.Parameter(torch.zeros(heads)) if smeared_keys else None

        def forward(self, x):  # [1, T, hidden]
            T = x.shape[1]
            q, k, v = self.qkv(self.ln1(x)).view(1, T, 3, heads, dh).permute(2, 0, 3, 1, 4)
            k = rope(k)
            if self.key_smear is not None:  # the first token has nothing before it
                prev = torch.cat([k[:, :, :1], k[:, :, :-1]], dim=2)
                k = k + self.key_smear.view(1, heads, 1, 1) * (prev - k)
            a = F.scaled_dot_product_attention(rope(q), k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(1, T, hidden))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, seqs):
            outs = []
            for s in seqs:  # one document at a time: attention never crosses documents
                x = self.emb(s[None])
                for b in self.blocks:
                    x = b(x)
                outs.append(self.out(self.ln(x))[0])
            return outs

    return GPT()


def megatron_gpt(a):
    """The driver's GPTModel (PP=1, world of one) without the DDP wrapper (whose hooks move
    gradients to its own buffers, out of a plain optimizer's sight), its packed forward, and
    a closer for its process group."""
    import eval_longctx as E
    from megatron.training.arguments import build_parser
    from megatron.training.initialize import initialize, shutdown, use_cpu
    from megatron.training.model import build_gpt_chunks, transformer_config

    args = build_parser().parse_args([
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.num_attention_heads), "--seq-length", "1024",
        "--max-position-embeddings", str(2 * a.max_gap + 2 * a.span), "--cpu", "--seed", str(a.seed)]
        + (["--smeared-keys"] if a.smeared_keys else []) + (["--qk-conv", str(a.qk_conv)] if a.qk_conv else []))
    args.ffn_hidden_size = 4 * a.hidden_size
    args.virtual_pipeline_model_parallel_size = None
    initialize(args)
    (gpt,) = build_gpt_chunks(args, transformer_config(args, use_cpu(args)), 256)
    packed = E.EvalModel(gpt, args)  # its logits(): one packed THD forward, as in training
    return gpt, packed.logits, shutdown


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    close = lambda: None
    if a.model == "megatron":
        model, forward, close = megatron_gpt(a)
    else:
        model = reference_gpt(a.num_layers, a.hidden_size, a.num_attention_heads, smeared_keys=a.smeared_keys)
        forward = model
    try:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
        train = make_sampler(a.span, a.max_gap, a.seed)
        held_sampler = make_sampler(a.span, a.max_gap, a.seed + 10_000)
        held_out = [held_sampler() for _ in range(a.eval_samples)]

        def copy_accuracy() -> float:
            with torch.no_grad():
                logits = forward([s for s, _ in held_out])
            hits = [(lg[start:-1].argmax(-1) == s[start + 1:]).float().mean() for (s, start), lg in
                    zip(held_out, logits)]
            return float(torch.stack(hits).mean())

        curve, t0 = [], time.perf_counter()
        for step in range(1, a.steps + 1):
            batch = [train() for _ in range(a.batch)]
            logits = forward([s for s, _ in batch])
            loss = sum(F.cross_entropy(lg[start - 1:-1], s[start:]) for (s, start), lg in zip(batch, logits))
            opt.zero_grad()
            (loss / a.batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % a.eval_interval == 0 or step == a.steps:
                point = {"step": step, "loss": round(float(loss.detach()) / a.batch, 4), "copy_acc": round(copy_accuracy(), 4),
                         "seconds": round(time.perf_counter() - t0, 1)}
                curve.append(point)
                print(json.dumps(point), file=sys.stderr, flush=True)
                if not math.isfinite(point["loss"]):
                    fail(f"loss diverged at step {step} (lower --lr)")
    finally:
        close()
    last = [p["copy_acc"] for p in curve[-5:]]
    first = lambda x: next((p["step"] for p in curve if p["copy_acc"] >= x), None)
    mean_len = a.max_gap + 2 * a.span  # two uniform 0..max_gap fillers and two copies
    text = json.dumps({
        "model": a.model, "num_layers": a.num_layers, "hidden_size": a.hidden_size,
        "num_attention_heads": a.num_attention_heads, "smeared_keys": a.smeared_keys, "qk_conv": a.qk_conv, "span": a.span, "max_gap": a.max_gap,
        "mean_tokens": mean_len, "lr": a.lr, "batch": a.batch, "seed": a.seed, "threads": a.threads,
        "steps": a.steps, "final_copy_acc": round(sum(last) / len(last), 4),
        "steps_to": {"0.5": first(0.5), "0.9": first(0.9)}, "curve": curve}, indent=1)
    if a.output:
        tmp = f"{a.output}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, a.output)
    print(text)


if __name__ == "__main__":
    main()
