"""Where the training documents come from: ``--data-path`` (one prefix or a blend) or ``--mock-data``.

Megatron-LM's ``--data-path`` takes one prefix, ``WEIGHT PREFIX WEIGHT PREFIX ...``,
or several prefixes without weights. A blend here is a document-level mixture: each
dataset contributes ``weight`` of the blend's tokens per pass, its documents repeated
(or a seeded subset taken) to reach that share; without weights the datasets are
concatenated (shares in proportion to their sizes). The packed sampler then shuffles
and packs the blend's documents like one dataset's. (Megatron-LM mixes fixed-length
samples instead of documents; the token shares are the same.)

``--mock-data`` writes a random-token dataset (one ``--seq-length`` document per
sample, as Megatron-LM's mock GPT dataset fills each sample) into a temporary directory
(or ``--data-cache-path``) and trains on it. Every rank writes the same documents (they
follow from ``--seed`` alone), so the ranks of a CP, TP or PP group read the same samples.
A document of ``--seq-length`` + 1 tokens (Megatron-LM's sample with its extra label
token) would leave a 1-token remainder: every other micro-batch would carry one token
and no target.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
from typing import List, Optional, Tuple

import numpy as np

MOCK_MAX_DOCS = 20000
"""Most documents ``--mock-data`` writes (it cycles through them like any dataset)."""


def parse_blend(text: str) -> List[Tuple[float, str]]:
    """``[(weight, prefix)]`` (weights sum to 1, or None-like -1 for "by size") of ``--data-path``.

    Raises ValueError (one line) for a malformed blend.
    """
    words = text.split()
    if len(words) == 1:
        return [(1.0, words[0])]

    def number(w: str) -> Optional[float]:
        try:
            return float(w)
        except ValueError:
            return None

    if number(words[0]) is None:  # prefixes only: concatenation
        bad = [w for w in words if number(w) is not None]
        if bad:
            raise ValueError(f"--data-path: {bad[0]!r} looks like a weight but the first word is a prefix; "
                             "give WEIGHT PREFIX pairs or prefixes only")
        return [(-1.0, w) for w in words]
    if len(words) % 2:
        raise ValueError(f"--data-path: {len(words)} words; a blend is WEIGHT PREFIX pairs")
    pairs = []
    for i in range(0, len(words), 2):
        w = number(words[i])
        if w is None or w < 0:
            raise ValueError(f"--data-path: {words[i]!r} is not a weight (a number >= 0) before {words[i + 1]!r}")
        pairs.append((w, words[i + 1]))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError("--data-path: the blend's weights sum to 0")
    return [(w / total, p) for w, p in pairs]


class BlendedDocuments:
    """Documents of several indexed datasets as one (the interface the loader reads:
    ``len``, ``sequence_lengths``, ``get(idx, offset, length)``)."""

    def __init__(self, datasets: List, weights: List[float], seed: int) -> None:
        lengths = [np.asarray(d.sequence_lengths, dtype=np.int64) for d in datasets]
        rng = np.random.default_rng(seed)
        if weights[0] < 0:  # no weights: every document once
            picks = [np.arange(len(n)) for n in lengths]
        else:
            total = float(sum(int(n.sum()) for n in lengths))
            picks = [_take(n, w * total, rng) for n, w in zip(lengths, weights)]
        self._datasets = datasets
        self._which = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(picks)])
        self._index = np.concatenate(picks).astype(np.int64)
        self.sequence_lengths = np.concatenate([n[p] for n, p in zip(lengths, picks)])
        self.shares = [float(n[p].sum()) / float(self.sequence_lengths.sum()) for n, p in zip(lengths, picks)]
        """Fraction of the blend's tokens from each dataset (close to its weight)."""

    def __len__(self) -> int:
        return len(self._index)

    @property
    def datasets(self) -> List:
        """The blended datasets, in ``--data-path`` order."""
        return self._datasets

    @property
    def components(self) -> tuple:
        """(dataset number, index in that dataset) of every document of the blend."""
        return self._which, self._index

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None):
        return self._datasets[self._which[idx]].get(int(self._index[idx]), offset=offset, length=length)


def _take(lengths: np.ndarray, tokens: float, rng: np.random.Generator) -> np.ndarray:
    """Document indices of one dataset adding up to about ``tokens`` tokens: whole passes
    over the dataset, then a seeded random subset for the remainder."""
    size = int(lengths.sum())
    if tokens <= 0:
        return np.zeros(0, dtype=np.int64)
    passes, rest = divmod(tokens, size)
    parts = [np.arange(len(lengths))] * int(passes)
    order = rng.permutation(len(lengths))
    k = int(np.searchsorted(np.cumsum(lengths[order]), rest)) if rest > 0 else 0
    parts.append(np.sort(order[:k]))
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return out if len(out) else order[:1]


def open_data(args: argparse.Namespace):
    """The run's documents: ``args.data_blend`` (set by :func:`resolve_data`) opened."""
    from megatron.training.indexed_io import open_dataset

    blend = args.data_blend
    if len(blend) == 1:
        return open_dataset(blend[0][1])
    return BlendedDocuments([open_dataset(p) for _, p in blend], [w for w, _ in blend], args.seed)


def resolve_data(args: argparse.Namespace, usage_error) -> None:
    """Parse ``--data-path`` / ``--mock-data`` into ``args.data_blend`` and check the files exist."""
    if args.mock_data:
        if args.data_path is not None:
            raise usage_error("give --data-path or --mock-data, not both")
        args.data_blend = None  # written by write_mock_data before the run
        return
    if args.data_path is None:
        raise usage_error("--data-path is required (make one with tools/make_corpus.py or "
                          "tools/preprocess_data.py, or pass --mock-data)")
    try:
        args.data_blend = parse_blend(args.data_path)
    except ValueError as e:
        raise usage_error(str(e))
    for _, prefix in args.data_blend:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise usage_error(f"--data-path: {prefix + ext} does not exist")
    if len(args.data_blend) > 1 and args.mask_prompt_loss:
        raise usage_error("--mask-prompt-loss reads one dataset's loss starts: it cannot be used with a "
                          "blended --data-path")
    if len(args.data_blend) == 1:
        args.data_path = args.data_blend[0][1]


def write_mock_data(args: argparse.Namespace, vocab_size: int) -> str:
    """``--mock-data``: write the random-token dataset and point ``args`` at it; returns its prefix.

    Deterministic in ``--seed``, so every rank writes the same documents (each its own copy)."""
    from megatron.training.indexed_io import write_documents

    if args.data_cache_path is not None:
        root = args.data_cache_path
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="mock-data-")
        atexit.register(shutil.rmtree, root, True)
    prefix = os.path.join(root, f"mock_seed{args.seed}_len{args.seq_length}_rank{os.environ.get('RANK', '0')}")
    docs = min(MOCK_MAX_DOCS, max(64, 2 * args.global_batch_size * args.train_iters))
    rng = np.random.default_rng(args.seed)
    write_documents(prefix, (rng.integers(0, vocab_size, size=args.seq_length) for _ in range(docs)),
                    vocab_size)
    args.data_path = prefix
    args.data_blend = [(1.0, prefix)]
    return prefix
