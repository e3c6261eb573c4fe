"""Training mix and held-out evaluation sets for the long-context tasks.

The training mix is a list of documents (JSONL ``{"text": ..., "loss_start": ...}`` for
``tools/preprocess_data.py``): task samples (:mod:`benchmarks.harness.longctx.tasks`,
split ``"train"``) interleaved with ordinary filler-prose documents whose
lengths are resampled from a real long-context length distribution
(``data/lengths/*.json``) and scaled to the CPU-sized context. The
evaluation sets use split ``"eval"``, an independent random stream.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from benchmarks.harness.longctx import text as T
from benchmarks.harness.longctx.tasks import ALL_TASKS, MIN_LENGTH, TASKS, Sample, TaskConfig, generate
from sparsebalance.io import atomic_path


@dataclass(frozen=True)
class MixConfig:
    """What goes into the training mix."""

    num_docs: int
    """Documents in the mix (task samples + filler documents)."""
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    """Context lengths (tokens) of task documents, drawn uniformly per document."""
    tasks: tuple[str, ...] = TASKS
    """Tasks of task documents, drawn uniformly per document."""
    filler_share: float = 0.25
    """Fraction of documents that are ordinary filler prose (0..1)."""
    lengths_file: str = "data/lengths/prolong.json"
    """JSON list of document lengths that filler lengths are resampled from."""
    filler_quantile: float = 0.99
    """Quantile of the length file mapped to ``max_tokens - reserve_tokens`` (the
    rule of tools/make_corpus.py; longer documents are clipped to it)."""
    min_filler_tokens: int = 32
    """Filler documents shorter than this after scaling are lengthened to it."""
    max_tokens: int = 4096
    """Longest document including ``reserve_tokens`` (the driver's --seq-length)."""
    reserve_tokens: int = 0
    """Tokens left free per document (e.g. for an EOD token; the project's
    preprocessor appends none: documents are delimited by cu_seqlens)."""
    seed: int = 0
    """Seed of the whole mix."""
    task_config: TaskConfig = field(default_factory=TaskConfig)
    """Generator settings of the task documents."""

    def __post_init__(self) -> None:
        if self.num_docs < 1:
            raise ValueError(f"num_docs must be >= 1, got {self.num_docs}")
        if not 0.0 <= self.filler_share <= 1.0:
            raise ValueError(f"filler_share must be in [0, 1], got {self.filler_share}")
        if not self.tasks or any(t not in ALL_TASKS for t in self.tasks):
            raise ValueError(f"tasks must be a non-empty subset of {', '.join(ALL_TASKS)}; got {self.tasks}")
        if not self.lengths:
            raise ValueError("lengths must not be empty")
        if self.reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {self.reserve_tokens}")
        for n in self.lengths:
            if n < MIN_LENGTH or n + self.reserve_tokens > self.max_tokens:
                raise ValueError(
                    f"lengths: {n} must be in [{MIN_LENGTH}, max_tokens - reserve_tokens = "
                    f"{self.max_tokens - self.reserve_tokens}]")
        if not 0.0 < self.filler_quantile <= 1.0:
            raise ValueError(f"filler_quantile must be in (0, 1], got {self.filler_quantile}")
        if not 1 <= self.min_filler_tokens <= self.max_tokens - self.reserve_tokens:
            raise ValueError(f"min_filler_tokens must be in [1, max_tokens - reserve_tokens], "
                             f"got {self.min_filler_tokens}")


def load_lengths(path: str) -> np.ndarray:
    """Document lengths (int64, > 0) from a JSON list file; ValueError if unusable."""
    try:
        with open(path) as f:
            data = json.load(f)
        arr = np.asarray(data, dtype=np.int64)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"lengths_file: cannot read {path}: {e}") from None
    if arr.ndim != 1 or arr.size == 0 or (arr <= 0).any():
        raise ValueError(f"lengths_file: {path} must be a non-empty JSON list of positive ints")
    return arr


def filler_lengths(cfg: MixConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` filler document lengths (tokens, excluding the reserve).

    Resampled with replacement from ``cfg.lengths_file`` and scaled so that its
    ``filler_quantile`` maps to the longest allowed document, then rounded and
    clipped to ``[min_filler_tokens, max_tokens - reserve_tokens]``: the shape
    of the real distribution below that quantile is kept.
    """
    base = load_lengths(cfg.lengths_file)
    hi = cfg.max_tokens - cfg.reserve_tokens
    scale = hi / float(np.quantile(base, cfg.filler_quantile))
    drawn = rng.choice(base, size=n, replace=True).astype(np.float64) * scale
    return np.clip(np.rint(drawn), cfg.min_filler_tokens, hi).astype(np.int64)


def training_documents(cfg: MixConfig) -> Iterator[tuple[str, str, int]]:
    """Yield ``(kind, text, prompt_chars)`` per training document, kind = task name or "filler".

    ``prompt_chars`` is the length of a task sample's prompt (its answer starts
    there) and 0 for filler, whose every token is a training target.

    Exactly ``round(filler_share * num_docs)`` documents are filler, at
    positions shuffled with the seed; each is at most ``max_tokens -
    reserve_tokens`` tokens long.
    """
    rng = np.random.default_rng([cfg.seed, 0x5EED])
    n_filler = int(round(cfg.filler_share * cfg.num_docs))
    is_filler = np.zeros(cfg.num_docs, dtype=bool)
    is_filler[rng.permutation(cfg.num_docs)[:n_filler]] = True
    flens = iter(filler_lengths(cfg, n_filler, rng).tolist()) if n_filler else iter(())
    task_idx = rng.integers(len(cfg.tasks), size=cfg.num_docs)
    len_idx = rng.integers(len(cfg.lengths), size=cfg.num_docs)
    for i in range(cfg.num_docs):
        if is_filler[i]:
            prose = T.filler_text(random.Random(f"{cfg.seed}:filler:{i}"), next(flens) - 1)
            yield "filler", prose + "\n", 0
        else:
            task = cfg.tasks[task_idx[i]]
            s = generate(task, cfg.lengths[len_idx[i]], cfg.seed, i, split="train",
                         config=cfg.task_config)
            yield task, s.text, len(s.prompt)


def write_lines(path: str, lines: Iterable[str]) -> int:
    """Write ``lines`` (each gets a newline) to ``path`` atomically, streaming (a training
    mix does not have to fit in memory as one string).

    Returns the number of lines. A failure leaves no file at ``path``.
    """
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
            n += 1
    return n


def write_training_mix(path: str, cfg: MixConfig) -> dict[str, int]:
    """Write the mix as JSONL ``{"text": ..., "loss_start": ...}``; returns documents per kind.

    ``loss_start`` is the character offset of the answer in a task document (0 for
    filler): ``tools/preprocess_data.py --loss-start-key loss_start`` turns it into the
    sidecar that ``pretrain_gpt.py --mask-prompt-loss`` trains answers only with.
    """
    counts: dict[str, int] = {}

    def lines() -> Iterator[str]:
        for kind, text, prompt_chars in training_documents(cfg):
            counts[kind] = counts.get(kind, 0) + 1
            yield json.dumps({"text": text, "loss_start": prompt_chars})

    write_lines(path, lines())
    return counts


def write_eval_set(path: str, samples: Iterable[Sample]) -> int:
    """Write samples as JSONL (one :meth:`Sample.to_dict` per line)."""
    return write_lines(path, (json.dumps(s.to_dict()) for s in samples))


def read_eval_set(path: str) -> list[Sample]:
    """Samples from :func:`write_eval_set` output; ValueError naming the line if bad."""
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"eval set: cannot open {path}: {e.strerror}") from None
    out = []
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Sample.from_dict(json.loads(line)))
            except (json.JSONDecodeError, ValueError, AttributeError) as e:
                raise ValueError(f"eval set: {path} line {lineno}: {e}") from None
    if not out:
        raise ValueError(f"eval set: {path} has no samples")
    return out
