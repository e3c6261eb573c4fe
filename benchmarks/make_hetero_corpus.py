"""Corpus whose attention is heterogeneous, built offline, with an optional small checkpoint.

Five sources, byte-level (vocabulary 256), all from what the machine already has:

* ``code``: Python standard-library source (``*.py`` under the running interpreter's
  stdlib directory, ``site-packages`` excluded), a span from a line start of a seeded file;
* ``docs``: the same files' docstrings (module, class and function), joined;
* ``retrieval``: RULER-style needles, "One of the special magic numbers for WORD is:
  NUMBER." (one per 400 bytes) at sentence starts in repeated filler sentences, ending
  with the question for one of them and its answer (a document too short for its
  needles loses those past its end, the asked one included);
* ``copy``: a random passage of 32..512 letters repeated to the length;
* ``markov``: ``tools/make_corpus.py``'s Markov prose (a 64-word chain).

Each document's source is drawn uniformly from ``--sources`` and its length,
independently of the source, from ``data/lengths/<name>.json`` scaled so the
``--quantile`` maps to ``--seq-length`` (``tools/make_corpus.py``'s rule), so two
documents of equal length differ only in content. Writes ``PREFIX.bin/.idx`` and the
sidecar ``PREFIX_sources.json`` (``doc_source`` and ``lengths`` per document index) and
prints one JSON line (documents and tokens per source). Deterministic for a seed and a
Python installation (the stdlib files are its text).

``--train-checkpoint DIR --train-iters N`` also trains a small GPT on the corpus with
``pretrain_gpt.py`` (single process, CPU, dense attention), saving every ``N / 4``
iterations into DIR so later tools can follow the attention over training; a DIR that
already holds this very run (same corpus, same flags: ``DIR/hetero_corpus_train.json``)
is reused, one that holds anything else is refused.

Tiny CPU run::

    .venv/bin/python benchmarks/make_hetero_corpus.py --output-prefix data/hetero --num-docs 200 \\
        --seq-length 512 --train-checkpoint runs/hetero/ckpt --train-iters 20 --train-layers 2

The study's corpus and checkpoint (``docs/sparsity_study.md``; ~5-9 minutes on 2 shared cores)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/make_hetero_corpus.py --output-prefix runs/hetero/corpus \\
        --num-docs 3000 --seq-length 1024 --train-checkpoint runs/hetero/ckpt --train-iters 250

GPU cluster run (longer documents, a bigger model: train it with your own pretrain_gpt.py
launch on the written corpus instead of ``--train-checkpoint``)::

    python benchmarks/make_hetero_corpus.py --output-prefix /lustre/data/hetero --num-docs 100000 \\
        --seq-length 32768 --lengths wlb_reconstruction
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from typing import NoReturn

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402
from sparsebalance.io import atomic_write_text  # noqa: E402

quiet_optional_extras()

PROG = "make_hetero_corpus.py"
LENGTHS_DIR = os.path.join(REPO, "data", "lengths")
SIDECAR_FORMAT = "sparsebalance-hetero-corpus"
STAMP = "hetero_corpus_train.json"
FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def fail(message: str, code: int = 2) -> NoReturn:
    """One ``make_hetero_corpus.py: error:`` line on stderr, then exit ``code``."""
    usage_error(message, prog=PROG, code=code)


def sidecar_path(prefix: str) -> str:
    """The per-document source/length sidecar of corpus ``prefix``."""
    return prefix + "_sources.json"


def _bytes(b: bytes, length: int) -> np.ndarray:
    return np.frombuffer(b[:length], dtype=np.uint8).astype(np.int64)


class Stdlib:
    """The interpreter's standard-library ``*.py`` files, sorted (the code and docs text)."""

    def __init__(self) -> None:
        root = sysconfig.get_paths()["stdlib"]
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
            files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
        self.root, self.files = root, files

    def source(self, i: int) -> bytes:
        with open(self.files[i % len(self.files)], "rb") as fh:
            return fh.read()

    def docstrings(self, i: int) -> bytes:
        try:
            tree = ast.parse(self.source(i))
        except (SyntaxError, ValueError):
            return b""
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        docs = [ast.get_docstring(n) for n in nodes]
        return "\n\n".join(d for d in docs if d).encode("utf-8", "replace") + (b"\n\n" if any(docs) else b"")


def code_doc(length: int, rng: np.random.Generator, lib: Stdlib) -> np.ndarray:
    """``length`` bytes of stdlib source from a line start of a random file (then the next files)."""
    i = int(rng.integers(len(lib.files)))
    text = lib.source(i)
    lines = [0] + [j + 1 for j in range(len(text)) if text[j] == 10]
    out = bytearray(text[lines[int(rng.integers(len(lines)))]:])
    while len(out) < length:
        i += 1
        out += lib.source(i)
    return _bytes(bytes(out), length)


def docs_doc(length: int, rng: np.random.Generator, lib: Stdlib) -> np.ndarray:
    """``length`` bytes of stdlib docstrings from a random file on."""
    i = int(rng.integers(len(lib.files)))
    out = bytearray()
    for step in range(len(lib.files)):
        if len(out) >= length:
            break
        out += lib.docstrings(i + step)
    while len(out) < length:  # a stdlib without docstrings: still a document of the length
        out += out or b"."
    return _bytes(bytes(out), length)


def retrieval_doc(length: int, rng: np.random.Generator, words: list) -> np.ndarray:
    """Filler with key-value needles; the last line asks for one needle's value and answers."""
    n = max(1, length // 400)
    keys = [words[int(j)] for j in rng.choice(len(words), size=min(n, len(words)), replace=False)]
    values = [b"%07d" % int(rng.integers(10 ** 6, 10 ** 7)) for _ in keys]
    needles = [b"One of the special magic numbers for " + k + b" is: " + v + b". " for k, v in zip(keys, values)]
    q = int(rng.integers(len(keys)))
    tail = b"What is the special magic number for " + keys[q] + b"? The special magic number for " \
        + keys[q] + b" is: " + values[q] + b"."
    body_len = max(0, length - len(tail))
    filler = (FILLER * (body_len // len(FILLER) + 1))[:body_len]
    cuts = sorted(int(c) for c in rng.integers(0, max(1, body_len), size=len(needles)))
    body, last = bytearray(), 0
    for c, nd in zip(cuts, needles):
        c = filler.rfind(b". ", 0, c) + 2 if filler.rfind(b". ", 0, c) >= 0 else 0  # at a sentence start
        body += filler[last:max(c, last)] + nd
        last = max(c, last)
    body += filler[last:]
    text = bytes(body[:body_len]) + tail  # needles past the cut are dropped: the asked one may be too
    return _bytes(text, length) if len(text) >= length else _bytes(text + FILLER * length, length)


def copy_doc(length: int, rng: np.random.Generator) -> np.ndarray:
    """A random passage of 32..512 letters and spaces, repeated to ``length``."""
    p = int(rng.integers(32, 513))
    passage = bytes(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz     "), size=p).tolist())
    return _bytes(passage * (length // p + 1), length)


SOURCES = ("code", "docs", "retrieval", "copy", "markov")


def build_documents(lengths: np.ndarray, sources: list, rng: np.random.Generator):
    """(documents, their source names) for ``lengths``, sources drawn uniformly from ``sources``."""
    from make_corpus import markov_chain, markov_text

    lib = Stdlib() if {"code", "docs"} & set(sources) else None
    if lib is not None and not lib.files:
        fail(f"no standard-library *.py files under {lib.root} (needed by the code and docs sources)", 1)
    words, trans = markov_chain(rng)
    make = {"code": lambda L: code_doc(L, rng, lib), "docs": lambda L: docs_doc(L, rng, lib),
            "retrieval": lambda L: retrieval_doc(L, rng, words), "copy": lambda L: copy_doc(L, rng),
            "markov": lambda L: markov_text(L, rng, words, trans)}
    picked = [sources[int(j)] for j in rng.integers(len(sources), size=len(lengths))]
    return [make[s](int(L)) for s, L in zip(picked, lengths)], picked


# --- the checkpoint -------------------------------------------------------------------


def train_flags(args) -> list:
    """pretrain_gpt.py's flags for the corpus' small model (dense attention, one process)."""
    from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

    return [*PROJECT_RUN_FLAGS, "--cpu", "--num-layers", str(args.train_layers),
            "--hidden-size", str(args.train_hidden), "--num-attention-heads", "4",
            "--seq-length", str(args.seq_length), "--global-batch-size", "2", "--split", "90,10,0",
            "--lr", "1e-3", "--lr-warmup-iters", str(max(1, args.train_iters // 20)), "--clip-grad", "1.0",
            "--train-iters", str(args.train_iters), "--seed", str(args.seed), "--log-interval", "10",
            "--eval-interval", "0", "--no-progress-bar",
            "--save-interval", str(max(1, args.train_iters // 4))]


def corpus_digest(docs: list) -> str:
    """sha256 over the documents' lengths and bytes (what the stamp ties a checkpoint to)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(b"%d:" % d.size)
        h.update(np.asarray(d, dtype=np.uint8).tobytes())
    return h.hexdigest()


def held_checkpoint(args, digest: str):
    """(stamp of this run, True when ``--train-checkpoint`` already holds it); a directory
    holding another run exits 2, before anything is written."""
    ckpt = args.train_checkpoint
    stamp = {"corpus_sha256": digest, "flags": train_flags(args)}
    stamp_path = os.path.join(ckpt, STAMP)
    if os.path.isfile(stamp_path):
        try:
            with open(stamp_path) as fh:
                held = json.load(fh)
        except (OSError, ValueError):
            held = None
        if held == stamp:
            return stamp, True
        fail(f"--train-checkpoint: {ckpt} holds a run of another corpus or other flags ({STAMP}); "
             "pass a new directory")
    return stamp, False


def train_checkpoint(args, stamp: dict, reuse: bool) -> dict:
    """Train (or reuse) the checkpoint in ``--train-checkpoint``; its summary."""
    from megatron.training.checkpointing import list_iterations

    ckpt = args.train_checkpoint
    if reuse:
        return {"dir": ckpt, "iterations": list_iterations(ckpt), "reused": True, "seconds": 0.0}
    os.makedirs(ckpt, exist_ok=True)
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = os.path.join(ckpt, "train.log")
    t0 = time.time()
    with open(log, "w") as fh:
        rc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *stamp["flags"],
                             "--data-path", args.output_prefix, "--save", ckpt],
                            stdout=fh, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        fail(f"--train-checkpoint: pretrain_gpt.py exited {rc}; see {log}", 1)
    atomic_write_text(os.path.join(ckpt, STAMP), json.dumps(stamp, indent=1) + "\n")
    return {"dir": ckpt, "iterations": list_iterations(ckpt), "reused": False,
            "seconds": round(time.time() - t0, 1)}


# --- command line ---------------------------------------------------------------------


def build_parser():
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX_sources.json")
    p.add_argument("--num-docs", type=int, default=2000)
    p.add_argument("--seq-length", type=int, default=1024, help="longest document (tokens) = training sequence")
    p.add_argument("--lengths", default="prolong",
                   help="name of a file in data/lengths (no .json), or a path to a JSON list")
    p.add_argument("--quantile", type=float, default=0.95,
                   help="length quantile mapped to --seq-length (0.95: at a 1-2K cap the median document "
                        "spans several routing blocks; 0.999 would leave it under two)")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    p.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("checkpoint (optional)")
    t.add_argument("--train-checkpoint", default=None, metavar="DIR", help="train a small GPT into DIR (or reuse)")
    t.add_argument("--train-iters", type=int, default=250)
    t.add_argument("--train-layers", type=int, default=4)
    t.add_argument("--train-hidden", type=int, default=128)
    return p


def check_args(args) -> list:
    """Input checks before anything is written (exit 2); the source list."""
    if args.num_docs < 1:
        fail("--num-docs must be >= 1")
    if args.seq_length < 64:
        fail("--seq-length must be >= 64")
    if not 0.0 < args.quantile <= 1.0:
        fail("--quantile must be in (0, 1]")
    if args.seed < 0:
        fail("--seed must be >= 0")
    sources = parse_sources(args.sources, SOURCES, fail)
    if args.train_checkpoint is not None:
        ckpt = args.train_checkpoint
        if os.path.exists(ckpt) and not os.path.isdir(ckpt):
            fail(f"--train-checkpoint: {ckpt} is not a directory")
        if os.path.isdir(ckpt) and os.listdir(ckpt) and not os.path.isfile(os.path.join(ckpt, STAMP)):
            fail(f"--train-checkpoint: {ckpt} is not empty and holds no {STAMP}; pass a new directory")
        for flag in ("train_iters", "train_layers", "train_hidden"):
            if getattr(args, flag) < 1:
                fail(f"--{flag.replace('_', '-')} must be >= 1")
        if args.train_hidden % 4:
            fail("--train-hidden must be a multiple of 4 (4 attention heads)")
    return sources


def parse_sources(text: str, known: tuple, fail_fn) -> list:
    """The names of comma list ``text`` (``--sources``): distinct, each in ``known``; else
    ``fail_fn(message)`` (a command line's one-line exit)."""
    names = [s for s in text.split(",") if s]
    if not names or len(set(names)) != len(names) or any(s not in known for s in names):
        fail_fn(f"--sources: expected distinct names from {', '.join(known)}, got {text!r}")
    return names


def read_lengths(name: str) -> np.ndarray:
    src = name if name.endswith(".json") else os.path.join(LENGTHS_DIR, name + ".json")
    if not os.path.isfile(src):
        fail(f"--lengths: length file {src} not found (a name is a file in data/lengths; "
             "or pass a path to a .json list)")
    try:
        with open(src) as fh:
            arr = np.asarray(json.load(fh), dtype=np.int64)
    except (OSError, ValueError, TypeError) as e:
        fail(f"--lengths: {src} is not a JSON list of lengths ({e})")
    if arr.ndim != 1 or arr.size == 0 or (arr < 1).any():
        fail(f"--lengths: {src} must be a non-empty list of positive lengths")
    return arr


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sources = check_args(args)
    from make_corpus import scaled_lengths

    source_lengths = read_lengths(args.lengths)
    rng = np.random.default_rng(args.seed)
    lengths = scaled_lengths(source_lengths, args.num_docs, args.seq_length, args.quantile, rng)
    docs, picked = build_documents(lengths, sources, rng)
    if args.train_checkpoint is not None:
        stamp, reuse = held_checkpoint(args, corpus_digest(docs))

    from megatron.training.indexed_io import write_documents

    write_documents(args.output_prefix, docs, 256)
    side = {"format": SIDECAR_FORMAT, "version": 1, "seed": args.seed, "seq_length": args.seq_length,
            "lengths_from": args.lengths, "python": sys.version.split()[0], "sources": sources,
            "doc_source": picked, "lengths": [int(x) for x in lengths]}
    atomic_write_text(sidecar_path(args.output_prefix), json.dumps(side) + "\n")
    per = {s: {"documents": 0, "tokens": 0} for s in sources}
    for s, L in zip(picked, lengths):
        per[s]["documents"] += 1
        per[s]["tokens"] += int(L)
    summary = {"output_prefix": args.output_prefix, "documents": len(docs), "tokens": int(lengths.sum()),
               "docs_per_source": {s: v["documents"] for s, v in per.items()},
               "tokens_per_source": {s: v["tokens"] for s, v in per.items()},
               "median_length": float(np.median(lengths)), "max_length": int(lengths.max()),
               "sidecar": sidecar_path(args.output_prefix), "checkpoint": None}
    if args.train_checkpoint is not None:
        summary["checkpoint"] = train_checkpoint(args, stamp, reuse)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
