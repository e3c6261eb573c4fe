"""The corpus recipe of the real CPU runs, fixed before any arm is run.

Regime: long-context fine-tuning. Whole documents of very different lengths are
packed per micro-batch (never cut, except those longer than a micro-batch), so
micro-batches with the same token count differ in attention work. With block
top-k routing a query keeps at most ``cap = (topk + 2) * block`` keys
(DESIGN.md section 3): documents up to ``cap`` tokens are dense (cost ~ L^2),
longer ones are capped (cost ~ L * cap) and only those react to a budget. The
recipe below makes both kinds common and keeps the paper's cap-to-context ratio
(MoBA block 256 / top-32 keeps ~8.7K keys at 32K context: 0.27; here
(30 + 2) * 64 = 2048 keys at 8192 tokens: 0.25).

Why these numbers (decided from the length statistics and a latency profile of the
layer, before any arm ran): lengths are the WLB-LLM reconstruction, unscaled
(scale ~1.0, documents longer than the context clipped to it): 32% of documents
are dense (<= cap), 36% are capped-long (> 2 x cap), and capped documents hold
~60% of the tokens. With hidden 64 / 2 heads the profiled layer costs ~1.6e-5 ms
per kept pair (fwd + bwd) against ~1.1e-2 ms per token of linear work, so a capped
document spends ~3x more time in attention than in the rest of the layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import List, Optional

import numpy as np

from sparsebalance.pairs import causal_pairs, kept_pairs


@dataclass(frozen=True)
class CorpusRecipe:
    """Documents, context and routing of the real runs."""

    lengths_file: str = "wlb_reconstruction"
    """Length file the lengths are resampled from: a name in data/lengths (no .json), or a
    path to a .json list (a user's own, from tools/dataset_lengths.py)."""
    scale: float = 1.0
    """Target multiplier on the resampled lengths (the realised one is recorded)."""
    num_docs: int = 2000
    """Documents generated (every arm trains on the first ones of the same seeded order)."""
    seq_length: int = 8192
    """Tokens per packed micro-batch (the context)."""
    block_size: int = 64
    """Routing block, tokens."""
    topk: int = 30
    """Static budget k0 (key blocks besides sink + diagonal): cap = (topk + 2) * block."""
    seed: int = 0
    """Seed of the length resampling and of the text."""

    def __post_init__(self) -> None:
        for name in ("num_docs", "seq_length", "block_size", "topk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.scale <= 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")

    @property
    def cap(self) -> int:
        """Most keys a query keeps, tokens."""
        return (self.topk + 2) * self.block_size

    def as_dict(self) -> dict:
        return asdict(self)


def length_file(lengths_dir: str, name: str) -> str:
    """``name`` itself when it ends in .json, else ``lengths_dir/name.json``."""
    return name if name.endswith(".json") else os.path.join(lengths_dir, name + ".json")


def source_lengths(lengths_dir: str, name: str) -> np.ndarray:
    """The length file ``name`` (in ``lengths_dir``) as an int64 array; raises ValueError naming it."""
    path = length_file(lengths_dir, name)
    try:
        with open(path) as fh:
            vals = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lengths_file {path}: {e}") from None
    arr = np.asarray(vals, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0 or arr.min() < 1:
        raise ValueError(f"lengths_file {path}: expected a non-empty JSON list of lengths >= 1")
    return arr


def make_corpus_quantile(source: np.ndarray, recipe: CorpusRecipe) -> float:
    """``--quantile`` for tools/make_corpus.py so that its scale (seq_length / quantile
    value) is as close to ``recipe.scale`` as the source's values allow."""
    srt = np.sort(source)
    want = recipe.seq_length / recipe.scale
    i = int(np.clip(np.searchsorted(srt, want), 1, srt.size - 1))
    return i / (srt.size - 1)


def realised_scale(source: np.ndarray, recipe: CorpusRecipe, quantile: float) -> float:
    """The scale tools/make_corpus.py applies for ``quantile``."""
    return recipe.seq_length / float(np.quantile(source, quantile))


def corpus_stats(lengths: np.ndarray, recipe: CorpusRecipe) -> dict:
    """Shares of dense-short and capped-long documents, and where tokens / attention go."""
    L = np.asarray(lengths, dtype=np.int64)
    kp = kept_pairs(L, recipe.topk, recipe.block_size).astype(float)
    long_ = L > 2 * recipe.cap
    return {
        "documents": int(L.size), "tokens": int(L.sum()),
        "median": float(np.median(L)), "mean": float(L.mean()), "max": int(L.max()),
        "cap_tokens": recipe.cap,
        "dense_share": float(np.mean(L <= recipe.cap)),
        "capped_long_share": float(np.mean(long_)),
        "capped_long_token_share": float(L[long_].sum() / L.sum()),
        "capped_long_attention_share": float(kp[long_].sum() / kp.sum()),
        "density_at_k0": float(kp.sum() / causal_pairs(L).sum()),
        "clipped_share": float(np.mean(L >= recipe.seq_length)),
    }


def describe(recipe: CorpusRecipe, stats: dict, quantile: Optional[float] = None,
             scale: Optional[float] = None) -> List[str]:
    """Markdown lines of the recipe for the report (the resampling line when ``quantile``
    is given: a corpus made by tools/make_corpus.py)."""
    lines = [] if quantile is None else [
        f"- lengths resampled (seed {recipe.seed}) from `{length_file('data/lengths', recipe.lengths_file)}`, "
        f"scale {scale:.3f} (make_corpus `--quantile "
        f"{quantile:.5f} --max-length {recipe.seq_length}`), {recipe.num_docs} documents, "
        f"longer ones clipped to the context"]
    return lines + [
        f"- context (tokens per micro-batch) {recipe.seq_length}; block {recipe.block_size}, "
        f"top-k k0 = {recipe.topk} -> at most {recipe.cap} keys per query",
        f"- documents: median {stats['median']:.0f}, mean {stats['mean']:.0f}, max "
        f"{stats['max']}; dense (<= {recipe.cap}) {stats['dense_share']:.0%}, capped-long "
        f"(> {2 * recipe.cap}) {stats['capped_long_share']:.0%} holding "
        f"{stats['capped_long_token_share']:.0%} of tokens and "
        f"{stats['capped_long_attention_share']:.0%} of kept attention pairs; density at k0 "
        f"{stats['density_at_k0']:.3f}",
    ]
