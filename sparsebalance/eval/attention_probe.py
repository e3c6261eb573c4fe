"""Where the attention heads read while a model writes a needle's value.

For a ``niah_single`` sample scored under teacher forcing, the query that predicts
answer digit ``j`` sits at ``len(prompt) - 1 + j`` and the digit it should copy at
``v0 + j`` in the context, ``v0`` being where the needle's value starts. A head
that copies by content reads that very position (offset 0); a head that reads the
value through some other place (a copy of it stored further on, say) reads at a
steady offset from it; a head that is not involved reads anywhere. Per head this
module measures

* ``value_mass``: attention mass on the needle's value, averaged over the digits;
* ``on_target``: how often the head's strongest key is the digit to write;
* the offsets of the strongest key from the digit to write (``far`` beyond
  ``window``), their most common value (``mode_offset``) and share (``at_mode``);
* the model's digit accuracy when the head reads at its usual offset and when it
  does not (``acc_at_mode`` / ``acc_off_mode``): slips of a copying head show up as
  errors, which is what this is for.

Pure tensor code: ``tools/needle_attention.py`` runs the model and feeds it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from sparsebalance.eval.tasks import Sample

FAR = "far"
"""Offset bucket of a strongest key more than ``window`` positions from the target."""


def needle_value_start(sample: Sample) -> int:
    """Token offset in ``sample.prompt`` where the needle's value starts (byte tokenizer).

    Only ``niah_single`` has exactly one needle whose value is the answer.
    """
    if sample.task != "niah_single":
        raise ValueError(f"needle attention needs niah_single samples, got {sample.task}")
    i = sample.prompt.find(f"is: {sample.answer}.")
    if i < 0:
        raise ValueError("the sample's needle does not hold its answer")
    return i + len("is: ")


def attention_rows(q: torch.Tensor, k: torch.Tensor, rows: Sequence[int],
                   scale: Optional[float] = None) -> torch.Tensor:
    """Causal softmax attention of the query positions ``rows`` over one document.

    ``q`` is ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` (grouped keys are shared by
    ``H // Hkv`` query heads, as in megatron's GQA). Returns ``[len(rows), H, T]``;
    the keys after each row's position get probability 0.
    """
    T, H, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or H % k.shape[1]:
        raise ValueError(f"query {tuple(q.shape)} and key {tuple(k.shape)} do not match")
    k = k.float().repeat_interleave(H // k.shape[1], dim=1)
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= T):
        raise ValueError(f"rows must be in [0, {T})")
    scores = torch.einsum("rhd,thd->rht", q.float()[idx], k) * (scale if scale is not None else D ** -0.5)
    future = torch.arange(T).view(1, 1, T) > idx.view(-1, 1, 1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


@dataclass
class _Head:
    mass: float = 0.0
    hits: int = 0
    offsets: Counter = field(default_factory=Counter)
    reads: list = field(default_factory=list)  # (offset bucket, digit right) per digit


class NeedleAttention:
    """Accumulates, over samples, where each (layer, head) reads per answer digit."""

    def __init__(self, window: int = 64):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.window = window
        self.heads: dict = defaultdict(_Head)
        self.position_hits: list = []  # per digit position: [right, total]

    def add(self, probs_by_layer: Mapping[int, torch.Tensor], value_start: int,
            right: Sequence[bool]) -> None:
        """One sample: per layer, the ``[digits, H, T]`` rows of :func:`attention_rows`
        (row ``j`` is the query predicting digit ``j``), and whether the model's argmax
        was the gold digit at each of those positions.
        """
        right = [bool(r) for r in right]
        while len(self.position_hits) < len(right):
            self.position_hits.append([0, 0])
        for j, r in enumerate(right):
            self.position_hits[j][0] += r
            self.position_hits[j][1] += 1
        lo, hi = value_start, value_start + len(right)
        for layer, probs in probs_by_layer.items():
            if probs.shape[0] != len(right):
                raise ValueError(f"layer {layer}: {probs.shape[0]} rows for {len(right)} scored digits")
            top = probs.argmax(dim=-1)  # [digits, H]
            for j in range(probs.shape[0]):
                for h in range(probs.shape[1]):
                    s = self.heads[(layer, h)]
                    s.mass += float(probs[j, h, lo:hi].sum())
                    off = int(top[j, h]) - (value_start + j)
                    s.hits += off == 0
                    bucket = off if abs(off) <= self.window else FAR
                    s.offsets[bucket] += 1
                    s.reads.append((bucket, right[j]))

    def summary(self, top: int = 5) -> dict:
        """JSON-ready: digit accuracy (overall and per position) and one record per head."""
        total = sum(t for _, t in self.position_hits)
        out = {
            "digit_accuracy": sum(r for r, _ in self.position_hits) / total if total else None,
            "position_accuracy": [r / t for r, t in self.position_hits],
            "heads": [],
        }
        for (layer, h), s in sorted(self.heads.items()):
            n = len(s.reads)
            ints = [(o, c) for o, c in s.offsets.most_common() if o != FAR]
            mode = ints[0][0] if ints else None
            at = [r for o, r in s.reads if o == mode]
            off = [r for o, r in s.reads if o != mode]
            out["heads"].append({
                "layer": layer, "head": h,
                "value_mass": s.mass / n,
                "on_target": s.hits / n,
                "mode_offset": mode,
                "at_mode": len(at) / n,
                "acc_at_mode": sum(at) / len(at) if at else None,
                "acc_off_mode": sum(off) / len(off) if off else None,
                "offsets": [[o, c / n] for o, c in s.offsets.most_common(top)],
            })
        return out
