"""Real long-document corpus, offline, tokenized with a pretrained model's own tokenizer.

Documents come from what the machine already has; a source the machine lacks is skipped
with a note (in the printed summary and the sidecar), never a crash:

* ``code``: Python standard-library source (the running interpreter's ``*.py``);
* ``pydoc``: the interpreter's pydoc topics (``pydoc_data.topics``), joined;
* ``licence``: licence texts (``/usr/share/common-licenses``, ``/usr/share/doc/*/copyright``);
* ``news``: NEWS, changelog and README files (``/usr/share/doc``, gzipped or not; idlelib's NEWS);
* ``man``: man pages (``/usr/share/man/man[1-8]``, troff source as installed);
* ``niah`` / ``multikey``: RULER-style needle retrieval, one needle or several keys
  (``benchmarks/harness/longctx/tasks.py``'s ``niah_single`` / ``niah_multikey``), ending with
  the question and its answer;
* ``repeat``: a passage of stdlib source (256..2,048 characters) repeated;
* ``csv`` / ``json``: weather-station rows / nested records, generated from the seed.

Each document's source is drawn uniformly from the available ``--sources``; its length, independently
of the source, from ``data/lengths/<--lengths>.json`` (real document lengths) mapped into
``[--min-length, --max-length]`` tokens: log-affinely, the ``--quantiles`` (default the 5% and 95%
quantiles) going to the two ends and what lies outside clipped, so the shape between keeps its
proportions (prolong: median 1,914 -> ~2,100 tokens; ~5% of documents at each end). Every document
is then exactly its length in the model's tokens: text is cut where the tokenizer reaches the length
(code and text sources from a random line of a random file on); a RULER-style document is
generated at the character length whose tokenization hits the length, so its question and answer
stay whole (the closest below when none does within a bounded search: recorded in the sidecar's
``lengths``).

Writes ``PREFIX.jsonl`` (``{"text", "source"}`` per line), tokenizes it with
``tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model
--tokenizer-model`` into ``PREFIX.bin/.idx`` (and its ``PREFIX_compression.npy``: each text's zlib
compression ratio), and the sidecar ``PREFIX_sources.json`` in ``benchmarks/make_hetero_corpus.py``'s
format (``doc_source`` and ``lengths`` per document, plus ``target_lengths``, the tokenizer and
``skipped``: the sources this machine lacks, and why). Prints one JSON line. Deterministic for a
seed, a tokenizer and a machine (its files are the text).

Tiny CPU run (the converted SmolLM2's tokenizer: ``make real-model``)::

    .venv/bin/python benchmarks/make_real_corpus.py --tokenizer-model runs/models/smollm2-135m/hf \\
        --output-prefix runs/real/tiny --num-docs 40 --max-length 2048

The study's corpus (``make real-study``; ~2 minutes on 2 quiet cores)::

    .venv/bin/python benchmarks/make_real_corpus.py --tokenizer-model runs/models/smollm2-135m/hf \\
        --output-prefix runs/real/corpus --num-docs 1000

GPU cluster run: the same on the cluster's model directory (``--max-length 32768`` for a model
with that context).
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import sys
from typing import Callable, NoReturn, Optional

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from make_hetero_corpus import SIDECAR_FORMAT, Stdlib, parse_sources, read_lengths, sidecar_path  # noqa: E402

from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402
from sparsebalance.io import atomic_write_text  # noqa: E402

PROG = "make_real_corpus.py"
SOURCES = ("code", "pydoc", "licence", "news", "man", "niah", "multikey", "repeat", "csv", "json")
RULER_TASKS = {"niah": "niah_single", "multikey": "niah_multikey"}
SEARCH_TRIES = 200
"""Character lengths tried for a RULER-style document before taking the closest below."""


def fail(message: str, code: int = 2) -> NoReturn:
    """One ``make_real_corpus.py: error:`` line on stderr, then exit ``code``."""
    usage_error(message, prog=PROG, code=code)


def scaled_lengths(source: np.ndarray, n: int, lo: int, hi: int, quantiles: tuple,
                   rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths resampled from ``source``, mapped log-affinely so that its ``quantiles``
    go to ``lo`` and ``hi`` tokens, clipped to ``[lo, hi]``."""
    qlo, qhi = (float(np.quantile(source, q)) for q in quantiles)
    picked = np.log(rng.choice(source, size=n, replace=True).astype(np.float64))
    if qhi <= qlo:
        return np.full(n, hi, dtype=np.int64)
    x = (picked - math.log(qlo)) / (math.log(qhi) - math.log(qlo))
    return np.clip(np.rint(np.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))), lo, hi).astype(np.int64)


# --- text sources -------------------------------------------------------------------------


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read(4 << 20)
    except (OSError, EOFError):
        return ""
    if b"\0" in data[:4096]:  # binary
        return ""
    return data.decode("utf-8", "replace")


class Files:
    """Text files of one source, sorted by path; a document is text from a random line of a
    random file on (then the next files)."""

    def __init__(self, paths) -> None:
        seen, files = set(), []
        for p in sorted(paths):
            real = os.path.realpath(p)
            if real not in seen and os.path.isfile(real) and os.path.getsize(real) > 0:
                seen.add(real)
                files.append(p)
        self.files = files

    def text(self, rng: np.random.Generator, n_chars: int) -> str:
        i = int(rng.integers(len(self.files)))
        first = _read(self.files[i])
        starts = [0] + [j + 1 for j, c in enumerate(first) if c == "\n" and j + 1 < len(first)]
        out = [first[starts[int(rng.integers(len(starts)))]:]]
        size, step = len(out[0]), 1
        while size < n_chars and step <= len(self.files):
            nxt = _read(self.files[(i + step) % len(self.files)])
            out.append(nxt)
            size += len(nxt)
            step += 1
        return "\n".join(out)


def _stdlib_files() -> Files:
    return Files(Stdlib().files)


def _pydoc_topics() -> Optional[list]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return None
    return [topics[k] for k in sorted(topics)]


class Topics:
    """pydoc topics joined from a random one on."""

    def __init__(self, topics: list) -> None:
        self.topics = topics

    def text(self, rng: np.random.Generator, n_chars: int) -> str:
        i, out, size = int(rng.integers(len(self.topics))), [], 0
        for step in range(len(self.topics)):
            if size >= n_chars:
                break
            out.append(self.topics[(i + step) % len(self.topics)])
            size += len(out[-1])
        return "\n\n".join(out)


class Repeat:
    """A passage of stdlib source repeated (in-context copying)."""

    def __init__(self, files: Files) -> None:
        self.files = files

    def text(self, rng: np.random.Generator, n_chars: int) -> str:
        passage = self.files.text(rng, 2048)[: int(rng.integers(256, 2049))]
        return (passage + "\n") * (n_chars // (len(passage) + 1) + 1)


CITIES = ("Oslo", "Lima", "Perth", "Quito", "Cairo", "Hanoi", "Dakar", "Reno", "Turku", "Davao", "Leeds", "Brno")
WORDS = ("alpha", "beta", "delta", "gamma", "omega", "sigma", "kappa", "theta", "zeta", "lambda", "rho", "tau")


class Csv:
    """Weather-station rows: date, station, readings (numbers a model cannot copy from context)."""

    def text(self, rng: np.random.Generator, n_chars: int) -> str:
        rows = ["date,station,temp_c,humidity_pct,wind_kmh,pressure_hpa,rain_mm,status"]
        day, size = int(rng.integers(0, 3000)), 0
        while size < n_chars:
            d = np.datetime64("2015-01-01") + np.timedelta64(day // 6, "D")
            row = (f"{d},{CITIES[int(rng.integers(len(CITIES)))]},{rng.normal(14, 9):.1f},"
                   f"{int(rng.integers(20, 100))},{abs(rng.normal(12, 8)):.1f},{rng.normal(1013, 8):.1f},"
                   f"{max(0.0, rng.normal(0.5, 2)):.1f},{('ok', 'ok', 'ok', 'check', 'fault')[int(rng.integers(5))]}")
            rows.append(row)
            size += len(row) + 1
            day += 1
        return "\n".join(rows)


class Json:
    """Nested records (ids, names, tags, scores), pretty-printed."""

    def text(self, rng: np.random.Generator, n_chars: int) -> str:
        recs, size, i = [], 0, int(rng.integers(10 ** 5))
        while size < n_chars:
            name = "".join(WORDS[int(j)] for j in rng.integers(len(WORDS), size=2))
            rec = {"id": i, "name": name, "city": CITIES[int(rng.integers(len(CITIES)))],
                   "active": bool(rng.integers(2)), "score": round(float(rng.uniform(0, 100)), 2),
                   "tags": [WORDS[int(j)] for j in rng.integers(len(WORDS), size=int(rng.integers(0, 4)))],
                   "owner": {"user": f"{name}{int(rng.integers(100))}", "level": int(rng.integers(1, 6))}}
            recs.append(json.dumps(rec, indent=2))
            size += len(recs[-1]) + 2
            i += int(rng.integers(1, 9))
        return "[\n" + ",\n".join(recs) + "\n]\n"


def text_sources() -> tuple:
    """({source: object with ``text(rng, n_chars)``} for what this machine has, {source: why skipped})."""
    found, skipped = {}, {}
    stdlib = _stdlib_files()
    candidates: dict = {
        "code": lambda: stdlib if stdlib.files else "no standard-library *.py files",
        "pydoc": lambda: Topics(t) if (t := _pydoc_topics()) else "pydoc_data.topics is not installed",
        "licence": lambda: Files(glob.glob("/usr/share/common-licenses/*")
                                 + glob.glob("/usr/share/doc/*/copyright")),
        "news": lambda: Files([p for p in glob.glob("/usr/share/doc/**/*", recursive=True)
                               if os.path.basename(p).split(".")[0].lower() in ("news", "changelog", "changes",
                                                                                  "readme")]
                              + glob.glob(os.path.join(os.path.dirname(stdlib.files[0]) if stdlib.files else "",
                                                       "idlelib", "NEWS*.txt"))),
        "man": lambda: Files(glob.glob("/usr/share/man/man[1-8]/*")),
        "repeat": lambda: Repeat(stdlib) if stdlib.files else "no standard-library *.py files",
        "csv": Csv, "json": Json,
    }
    for name, make in candidates.items():
        src = make()
        if isinstance(src, str):
            skipped[name] = src
        elif isinstance(src, Files) and not src.files:
            skipped[name] = "no files on this machine"
        else:
            found[name] = src
    return found, skipped


# --- exact token lengths ------------------------------------------------------------------


def cut_to_tokens(text: str, n: int, count: Callable[[str], int], offsets: Callable[[str], list]
                  ) -> Optional[str]:
    """The shortest prefix of ``text`` that is ``n`` tokens (``count``), or None when
    the text is shorter or no prefix tokenizes to exactly ``n``."""
    offs = offsets(text)
    if len(offs) < n:
        return None
    end = offs[n - 1][1]
    got = count(text[:end])
    if got == n:
        return text[:end]
    lo, hi = (end, len(text)) if got < n else (0, end)  # count(text[:lo]) < n <= count(text[:hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(text[:mid]) < n:
            lo = mid
        else:
            hi = mid
    return text[:hi] if count(text[:hi]) == n else None


def ruler_text(task: str, n: int, seed: int, index: int, count: Callable[[str], int]) -> Optional[str]:
    """A RULER-style document (``task``) of exactly ``n`` tokens when found within
    :data:`SEARCH_TRIES` character lengths, else the longest found below ``n`` (None: none
    fits, the task needs more characters than ``n`` tokens hold)."""
    from benchmarks.harness.longctx.tasks import MIN_LENGTH, generate

    chars, best, tried = 4 * n, None, set()
    for _ in range(SEARCH_TRIES):
        if chars in tried:
            chars += 1
            continue
        tried.add(chars)
        try:
            text = generate(task, chars, seed, index, split="real-corpus").text
        except ValueError:  # the task's text does not fit this many characters
            chars = 2 * chars
            continue
        got = count(text)
        if got == n:
            return text
        if got < n and (best is None or got > best[0]):
            best = (got, text)
        # far off: rescale by characters per token; close: another draw (the text changes with
        # the length, so each try is a fresh sample)
        chars = (max(MIN_LENGTH, round(chars * n / max(got, 1))) if abs(n - got) > 8
                 else chars + (1 if got < n else -1))
    return best[1] if best is not None else None


def document(source: str, n: int, rng: np.random.Generator, sources: dict, seed: int, index: int,
             count, offsets) -> str:
    """One document of ``source`` that tokenizes to ``n`` tokens."""
    if source in RULER_TASKS:
        text = ruler_text(RULER_TASKS[source], n, seed, index, count)
        if text is None:
            fail(f"--min-length: a {source} document needs more than {n} tokens of this tokenizer")
        return text
    chars = 6 * n
    for _ in range(8):
        text = cut_to_tokens(sources[source].text(rng, chars), n, count, offsets)
        if text is not None:
            return text
        chars *= 2
    raise RuntimeError(f"source {source}: no text of {n} tokens")


# --- command line -------------------------------------------------------------------------


def build_parser():
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--tokenizer-model", required=True,
                   help="the model's tokenizer: a directory holding tokenizer.json (a converted checkpoint's hf/) "
                        "or the file")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX.jsonl, PREFIX.bin, PREFIX.idx, PREFIX_sources.json")
    p.add_argument("--num-docs", type=int, default=1000)
    p.add_argument("--min-length", type=int, default=1024, help="shortest document (tokens)")
    p.add_argument("--max-length", type=int, default=8192, help="longest document (tokens)")
    p.add_argument("--lengths", default="prolong",
                   help="name of a file in data/lengths (no .json), or a path to a JSON list")
    p.add_argument("--quantiles", default="0.05,0.95",
                   help="the length quantiles mapped to --min-length and --max-length")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    p.add_argument("--seed", type=int, default=0)
    return p


def check_args(args) -> tuple:
    """Input checks before anything is written (exit 2); (sources asked, quantiles)."""
    if args.num_docs < 1:
        fail("--num-docs must be >= 1")
    if not 16 <= args.min_length <= args.max_length:
        fail("need 16 <= --min-length <= --max-length")
    try:
        qs = tuple(float(x) for x in args.quantiles.split(","))
    except ValueError:
        qs = ()
    if len(qs) != 2 or not 0.0 <= qs[0] < qs[1] <= 1.0:
        fail(f"--quantiles: expected two increasing numbers in [0, 1], got {args.quantiles!r}")
    if args.seed < 0:
        fail("--seed must be >= 0")
    asked = parse_sources(args.sources, SOURCES, fail)
    if not os.path.exists(args.tokenizer_model):
        fail(f"--tokenizer-model: {args.tokenizer_model} does not exist (make real-model writes the model's hf/)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_prefix))):
        fail(f"--output-prefix: directory of {args.output_prefix} does not exist")
    return asked, qs


def tokenizer_fns(path: str) -> tuple:
    """(count, offsets, vocab size) of the tokenizer preprocess_data.py will use."""
    from megatron.training.tokenizer import HFJsonTokenizer

    try:
        tok = HFJsonTokenizer(path)
    except ValueError as e:
        fail(str(e))
    return (lambda t: len(tok.encode(t))), tok.offsets, tok.vocab_size


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    asked, quantiles = check_args(args)
    count, offsets, _ = tokenizer_fns(args.tokenizer_model)
    found, skipped = text_sources()
    found.update({s: None for s in RULER_TASKS})
    skipped = {s: why for s, why in skipped.items() if s in asked}
    sources = [s for s in asked if s in found]
    if not sources:
        fail("none of --sources is available on this machine: " + "; ".join(f"{s}: {w}" for s, w in skipped.items()),
             1)
    rng = np.random.default_rng(args.seed)
    targets = scaled_lengths(read_lengths(args.lengths), args.num_docs, args.min_length, args.max_length,
                             quantiles, rng)
    picked = [sources[int(j)] for j in rng.integers(len(sources), size=args.num_docs)]
    texts = [document(s, int(n), rng, found, args.seed, i, count, offsets)
             for i, (s, n) in enumerate(zip(picked, targets))]
    jsonl = args.output_prefix + ".jsonl"
    atomic_write_text(jsonl, "".join(json.dumps({"text": t, "source": s}) + "\n" for t, s in zip(texts, picked)))
    import contextlib
    import io

    import preprocess_data

    with contextlib.redirect_stdout(io.StringIO()):  # its one line; the summary below says it all
        preprocess_data.main(["--input", jsonl, "--output-prefix", args.output_prefix, "--json-key", "text",
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", args.tokenizer_model])
    from megatron.training.indexed_io import open_dataset

    dataset = open_dataset(args.output_prefix)  # held: its lengths are a view of its mmap
    lengths = [int(x) for x in dataset.sequence_lengths]
    if len(lengths) != len(texts):
        fail(f"{args.output_prefix}: {len(lengths)} documents tokenized of {len(texts)} written", 1)
    side = {"format": SIDECAR_FORMAT, "version": 1, "seed": args.seed, "seq_length": args.max_length,
            "lengths_from": args.lengths, "python": sys.version.split()[0], "sources": sources,
            "doc_source": picked, "lengths": lengths, "target_lengths": [int(x) for x in targets],
            "tokenizer": os.path.abspath(args.tokenizer_model), "skipped": skipped}
    atomic_write_text(sidecar_path(args.output_prefix), json.dumps(side) + "\n")
    summary = {"output_prefix": args.output_prefix, "documents": len(texts), "tokens": int(sum(lengths)),
               "docs_per_source": {s: picked.count(s) for s in sources},
               "median_length": float(np.median(lengths)), "max_length": max(lengths),
               "at_target_length": int(sum(a == b for a, b in zip(lengths, targets))),
               "skipped": skipped, "sidecar": sidecar_path(args.output_prefix)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
