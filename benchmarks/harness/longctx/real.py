"""RULER-style retrieval on a pretrained model in its own tokens, and sparse attention at decode time.

Samples: :func:`benchmarks.harness.longctx.tasks.generate` text, sized so that the chat-wrapped
prompt plus the answer is ``n`` tokens of the model's tokenizer (``count``), split into the
user turn (instructions, context, question) and the answer prefix that opens the assistant
turn (``The special magic number for KEY is:`` / ``Answer:``), so the gold answer is the
very next thing the model says. ``wrap(user) -> text`` applies the model's chat template
(``tokenizer_config.json``'s, from the GGUF metadata); identity for a base model.

Scoring is greedy decoding of the answer: correct when the argmax reproduces every answer
token and the token after does not continue it (a letter or digit). It takes ONE forward of
``prompt + answer`` (teacher forcing), exact for greedy decoding because every logit depends
only on earlier tokens, including under sparse attention as :func:`decode_attention` routes
the answer's queries.

What sparse attention means at decode time (the choice made here): the prompt is prefilled
under the arm's block routing (query blocks of ``B`` prompt tokens, the library's kernel on
the prompt alone), and each generated token then attends from a full KV cache through its
own routing (``Bq = 1``: its query against each complete earlier key block's mean key; sink
and its own, partial block always kept; top-k, or threshold routing's count per head), as
MoBA and Quest decode. Routing the answer inside the prompt's last query block instead
(one teacher-forced forward through the training kernel) would let the block's mean query
see the answer tokens, which point at the needle: a leak that favours sparse arms.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from benchmarks.harness.longctx.tasks import Sample, generate

ANSWER_PREFIXES = ("The special magic number for", "The special magic numbers for", "Answer:")
SIZE_TRIES = 12


def split_prompt(prompt: str) -> tuple:
    """(user text, answer prefix) of a task prompt: the prefix is the prompt's tail from
    its last answer-prefix phrase on, without the trailing blank."""
    at = max(prompt.rfind(p) for p in ANSWER_PREFIXES)
    if at < 0:
        raise ValueError("task prompt has no answer prefix")
    return prompt[:at].rstrip(), prompt[at:].rstrip()


def chat_sample(sample: Sample, wrap: Callable[[str], str]) -> tuple:
    """(prompt text, answer text) of ``sample`` for a chat model: the user turn through
    ``wrap``, then the answer prefix; the answer keeps its leading blank."""
    user, prefix = split_prompt(sample.prompt)
    return wrap(user) + prefix, " " + sample.answer


def sized_sample(task: str, n: int, seed: int, index: int, count: Callable[[str], int],
                 wrap: Callable[[str], str], slack: int = 64) -> tuple:
    """(sample, prompt text, answer text) whose prompt + answer is ``n - slack .. n`` tokens
    (``count``); the closest below ``n`` after :data:`SIZE_TRIES` draws (each character
    length is a fresh sample of the same stream)."""
    chars, best = 4 * n, None
    for _ in range(SIZE_TRIES):
        s = generate(task, max(chars, 1024), seed, index, split="real-eval")
        prompt, answer = chat_sample(s, wrap)
        got = count(prompt + answer)
        if n - slack <= got <= n:
            return s, prompt, answer
        if got <= n and (best is None or got > best[0]):
            best = (got, (s, prompt, answer))
        chars = max(1024, round(chars * (n - slack // 2) / max(got, 1)))
    if best is None:
        raise ValueError(f"no {task} sample fits {n} tokens")
    return best[1]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, *, topk: Optional[int],
                     block_size: int, scale: float, rule=None) -> torch.Tensor:
    """Attention of decode queries ``q [A, H, D]`` at positions ``start .. start + A - 1`` over
    the cached keys/values ``k, v [T, Hkv, D]`` (``T >= start + A``; GQA: head ``h`` reads
    group ``h // (H // Hkv)``), each query routed alone (see module docstring): the gate of
    complete key block ``j`` (not the sink, before the query's own block) is ``q . mean(k_j) *
    scale``; ``topk`` None is dense causal attention; ``rule`` a threshold
    :class:`~sparsebalance.ops.plan.RoutingRule` (``topk`` the cap). Returns ``[A, H, D]``."""
    from sparsebalance.ops.plan import _threshold_counts

    A, H, D = q.shape
    Hkv = k.shape[1]
    kh = k.repeat_interleave(H // Hkv, dim=1).float()  # [T, H, D]
    vh = v.repeat_interleave(H // Hkv, dim=1).float()
    out = torch.empty(A, H, D, dtype=torch.float32, device=q.device)
    for a in range(A):
        t = start + a
        qt = q[a].float()  # [H, D]
        keep = torch.zeros(H, t + 1, dtype=torch.bool, device=q.device)
        own = t // block_size
        cand = own - 1  # complete blocks 1 .. own-1
        if topk is None or cand <= 0 or (rule is None or rule.threshold is None) and cand <= topk:
            keep[:] = True
        else:
            means = kh[block_size:own * block_size].view(cand, block_size, H, D).mean(1)  # [C, H, D]
            g = torch.einsum("hd,chd->hc", qt, means) * scale
            if rule is not None and rule.threshold is not None:
                c = _threshold_counts(g[:, None, :], float(rule.threshold),
                                      torch.tensor(rule.topk_min), torch.tensor(topk), torch.tensor(cand),
                                      rule.per_head)[:, 0, 0].expand(H)
            else:
                c = torch.full((H,), topk)
            order = g.argsort(dim=1, descending=True, stable=True)
            for h in range(H):
                for j in order[h, :int(c[h])].tolist():
                    keep[h, (j + 1) * block_size:(j + 2) * block_size] = True
            keep[:, :block_size] = True
            keep[:, own * block_size:] = True
        s = torch.einsum("hd,thd->ht", qt, kh[:t + 1]) * scale
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=1)
        out[a] = torch.einsum("ht,thd->hd", p, vh[:t + 1])
    return out.to(q.dtype)


def answer_correct(pred: torch.Tensor, target: torch.Tensor, decode: Callable) -> bool:
    """Greedy decoding reproduces ``target`` (``pred [len(target) + 1]``: the argmax at each
    answer position and the one after) and then stops continuing it (no letter or digit)."""
    if not bool((pred[:-1] == target).all()):
        return False
    after = decode([int(pred[-1])])
    return not (after[:1].isalnum() or after.startswith(" ") and after[1:2].isalnum())
