"""Synthetic corpus with real document-length statistics (the embedded default dataset).

Document lengths are resampled (with replacement, seeded) from
``data/lengths/<name>.json`` (the repository's sample files, or your own
length file: ``tools/dataset_lengths.py``) and scaled so that the chosen quantile of the real distribution maps to
``--max-length`` tokens (longer documents are clipped to it); the shape of the
distribution below that quantile is kept. The text is byte-level: words drawn
from a seeded first-order Markov chain over a small vocabulary, so a tiny GPT
has something to learn and the loss visibly falls.

Tiny CPU run (what ``make demo`` does)::

    .venv/bin/python tools/make_corpus.py --output-prefix data/corpus --num-docs 2000 --max-length 512

GPU cluster run (long-context lengths from the WLB reconstruction)::

    python tools/make_corpus.py --output-prefix /lustre/data/synth --lengths wlb_reconstruction \
        --num-docs 200000 --max-length 131072 --quantile 1.0
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import usage_error  # noqa: E402

quiet_optional_extras()

PROG = "make_corpus.py"
LENGTHS_DIR = os.path.join(REPO, "data", "lengths")
"""The repository's sample length files (data/lengths/README.md: sources, licence)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(message, prog=PROG)


def lengths_path(name: str) -> str:
    """A length file: ``name`` itself when it ends in .json, else data/lengths/NAME.json."""
    return name if name.endswith(".json") else os.path.join(LENGTHS_DIR, name + ".json")


def scaled_lengths(source: np.ndarray, num_docs: int, max_length: int, quantile: float,
                   rng: np.random.Generator, min_length: int = 2) -> np.ndarray:
    """``num_docs`` lengths resampled from ``source`` with ``quantile(source) -> max_length``."""
    ref = float(np.quantile(source, quantile))
    picked = rng.choice(source, size=num_docs, replace=True).astype(np.float64)
    return np.clip(np.rint(picked * max_length / ref), min_length, max_length).astype(np.int64)


def markov_text(length: int, rng: np.random.Generator, words: list, trans: np.ndarray) -> np.ndarray:
    """``length`` bytes of space-separated words walked along ``trans`` (row-stochastic)."""
    out = bytearray()
    w = int(rng.integers(len(words)))
    while len(out) < length:
        out += words[w] + b" "
        w = int(rng.choice(len(words), p=trans[w]))
    return np.frombuffer(bytes(out[:length]), dtype=np.uint8).astype(np.int64)


def markov_chain(rng: np.random.Generator, vocab: int = 64) -> tuple:
    """(``vocab`` random words, row-stochastic transitions) for :func:`markov_text`."""
    words = [bytes(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(2, 8))).tolist())
             for _ in range(vocab)]
    # Sparse transitions (4 likely successors per word): low entropy, learnable.
    trans = np.full((vocab, vocab), 0.02 / vocab)
    for i in range(vocab):
        trans[i, rng.choice(vocab, size=4, replace=False)] += 0.98 / 4
    trans /= trans.sum(1, keepdims=True)
    return words, trans


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--lengths", default="prolong",
                   help="name of a file in data/lengths (no .json), or a path to a JSON list of "
                        "document lengths (tools/dataset_lengths.py writes one from your dataset)")
    p.add_argument("--num-docs", type=int, default=2000)
    p.add_argument("--max-length", type=int, default=512, help="tokens of the longest document")
    p.add_argument("--quantile", type=float, default=0.999, help="source quantile mapped to --max-length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_docs < 1 or args.max_length < 2 or not 0.0 < args.quantile <= 1.0:
        usage_error("need --num-docs >= 1, --max-length >= 2 and 0 < --quantile <= 1", prog=PROG)
    src = lengths_path(args.lengths)
    if not os.path.isfile(src):
        usage_error(f"length file {src} not found (a name is a file in data/lengths; "
                    "or pass a path to a .json list)", prog=PROG)
    source = np.asarray(json.load(open(src)), dtype=np.int64)
    rng = np.random.default_rng(args.seed)
    lengths = scaled_lengths(source, args.num_docs, args.max_length, args.quantile, rng)

    words, trans = markov_chain(rng)

    from megatron.training.indexed_io import write_documents

    n = write_documents(args.output_prefix, (markov_text(int(L), rng, words, trans) for L in lengths), 256)
    print(json.dumps({"output_prefix": args.output_prefix, "documents": n, "tokens": int(lengths.sum()),
                      "lengths_from": src, "median": float(np.median(lengths)), "max": int(lengths.max())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
