"""JSONL -> megatron-core indexed datasets (.bin/.idx), with Megatron-LM's preprocess_data flags.

Tiny CPU run (built-in byte-level tokenizer, works offline; writes data/mydocs_text_document.bin/.idx)::

    .venv/bin/python tools/preprocess_data.py --input docs.jsonl --output-prefix data/mydocs

A Megatron-LM preprocessing line works as it is (writes /lustre/data/corpus_text_document.bin/.idx)::

    python tools/preprocess_data.py --input /lustre/corpus.jsonl --output-prefix /lustre/data/corpus \\
        --json-keys text --append-eod --workers 32 --partitions 2 \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /lustre/qwen2.5/tokenizer.json

Meaning, as Megatron-LM's ``tools/preprocess_data.py``:

* ``--json-keys K ...`` (default ``text``): one dataset per key, ``<prefix>_<key>_document``
  (``_sentence`` with ``--split-sentences``: one sequence per sentence, nltk's punkt, with
  ``--keep-newlines`` and ``--lang``). This tool's older form, ``--json-key K``, writes the one
  dataset to ``<prefix>`` itself.
* ``--append-eod``: the tokenizer's end-of-document id after each non-empty document (see
  megatron/training/tokenizer.py for each type's). A text with no tokens is an empty
  document in the index, as upstream writes it.
* ``--workers N``: N processes tokenize blocks of lines; the files do not depend on N.
  ``--partitions P``: the input's lines dealt round-robin into P parts (contiguous parts with
  ``--keep-sequential-samples``; ``--input`` may then be a glob), each encoded by N/P
  workers in its own process, then merged in part order with the builder's ``add_index``.
  The parts live in a temporary folder and are removed (upstream keeps them beside the input).
* Token ids are stored as megatron-core's ``DType.optimal_dtype`` of the vocabulary (uint16
  below 65500 ids, else int32), written by its ``IndexedDatasetBuilder``.

This tool's own: lines that are blank are skipped; ``--loss-start-key`` writes
``<dataset>_loss_start.npy`` (``pretrain_gpt.py --mask-prompt-loss``); at document level each
dataset gets ``<dataset>_compression.npy`` (zlib compressed / raw bytes per document, read by
``--sb-routing threshold``). Every output appears only when all are complete (written in a
temporary folder beside them, then renamed); bad input is one error line and exit 1.
``tools/dataset_lengths.py`` turns a dataset into the length file the profile and simulator read.
"""

from __future__ import annotations

import argparse
import collections
import glob
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import TOKENIZER_TYPES, usage_error  # noqa: E402
from tools._preprocess_encode import Block, EncodeConfig, TokenizerSpec, encode_block, init_worker  # noqa: E402

quiet_optional_extras()

PROG = "preprocess_data.py"
BLOCK_BYTES = 1 << 20
"""Input bytes per work item: large enough that handing it to a worker costs little."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(message, prog=PROG)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file (with --partitions > 1: a glob of them)")
    keys = g.add_mutually_exclusive_group()
    keys.add_argument("--json-keys", nargs="+", default=None,
                      help="keys to extract (default text); one dataset <prefix>_<key>_document each")
    keys.add_argument("--json-key", default=None, help="one key, written to <prefix> itself (default text)")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (nltk punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    g.add_argument("--lang", default="english", help="punkt language of --split-sentences")
    g.add_argument("--loss-start-key", default=None,
                   help="JSON field holding the character offset where a document's training "
                        "targets start (absent: 0); writes <dataset>_loss_start.npy for "
                        "pretrain_gpt.py --mask-prompt-loss")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteTokenizer")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: tokenizer.json or a directory holding it; "
                        "SentencePiece types: tokenizer.model")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids are below it")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path of the output files without suffix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes (a multiple of --partitions)")
    g.add_argument("--partitions", type=int, default=1, help="input parts encoded concurrently, then merged")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: contiguous parts, so the dataset keeps the input's order")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines (stderr)")
    return p


def _check(args) -> Tuple[EncodeConfig, Dict[str, str], List[str], int]:
    """The encode config, the dataset prefix of each key, the input files and the vocabulary
    size; exits with one line (code 2) on a bad command line."""
    from megatron.core.datasets.indexed_dataset import DType

    from megatron.training.tokenizer import unused_tokenizer_files
    from tools._preprocess_encode import load_splitter

    if args.workers < 1 or args.partitions < 1 or args.log_interval < 1:
        usage_error("--workers, --partitions and --log-interval must be >= 1", prog=PROG)
    if args.workers % args.partitions:
        usage_error(f"--workers {args.workers} is not a multiple of --partitions {args.partitions} "
                    "(each part gets --workers / --partitions processes)", prog=PROG)
    files = [args.input] if os.path.isfile(args.input) else []
    if not files and args.partitions > 1:
        files = sorted(f for f in glob.glob(args.input) if os.path.isfile(f))
    if not files:
        usage_error(f"--input {args.input} does not exist", prog=PROG)
    keys = tuple(args.json_keys or [args.json_key or "text"])
    if len(set(keys)) != len(keys):
        usage_error(f"--json-keys {' '.join(keys)} names a key twice", prog=PROG)
    if args.loss_start_key and (len(keys) > 1 or args.split_sentences):
        usage_error("--loss-start-key needs one JSON key and no --split-sentences", prog=PROG)
    if args.keep_newlines and not args.split_sentences:
        usage_error("--keep-newlines only applies with --split-sentences", prog=PROG)
    unused = unused_tokenizer_files(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    if unused or (args.vocab_size is not None and args.tokenizer_type != "NullTokenizer"):
        usage_error(f"--tokenizer-type {args.tokenizer_type} does not read {', '.join(unused) or '--vocab-size'}",
                    prog=PROG)
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                         args.vocab_size)
    try:
        tokenizer = spec.build()
        if args.split_sentences:
            load_splitter(args.lang, args.keep_newlines)
    except ValueError as e:
        usage_error(str(e), prog=PROG)
    if args.append_eod and tokenizer.eod is None:
        usage_error(f"--append-eod: --tokenizer-type {args.tokenizer_type} has no end-of-document token"
                    + (" (its tokenizer_config.json names no eos_token)"
                       if args.tokenizer_type == "HuggingFaceTokenizer" else ""), prog=PROG)
    level = "sentence" if args.split_sentences else "document"
    names = ({keys[0]: args.output_prefix} if args.json_key
             else {k: f"{args.output_prefix}_{k}_{level}" for k in keys})
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    config = EncodeConfig(tokenizer=spec, json_keys=keys, source=args.input, dtype=dtype.__name__,
                          append_eod=args.append_eod, split_sentences=args.split_sentences,
                          keep_newlines=args.keep_newlines, lang=args.lang, loss_start_key=args.loss_start_key)
    return config, names, files, tokenizer.vocab_size


def _blocks(path: str, first_line: int = 1, stride: int = 1) -> Iterator[Block]:
    """``path`` in blocks of whole lines of about :data:`BLOCK_BYTES`."""
    with open(path, "rb") as f:
        line = first_line
        while True:
            data = f.read(BLOCK_BYTES)
            if not data:
                return
            if not data.endswith(b"\n"):
                data += f.readline()  # complete the last line
            yield Block(first_line=line, stride=stride, data=data)
            line += stride * data.count(b"\n")


def _in_order(pool, blocks: Iterator[Block], window: int):
    """:func:`encode_block` of each block, in block order, by ``pool``; at most ``window``
    blocks in flight (``Pool.imap`` would read the whole input ahead into memory)."""
    pending: collections.deque = collections.deque()
    for block in blocks:
        pending.append(pool.apply_async(encode_block, (block,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Progress:
    """Upstream's progress line every ``interval`` documents (stderr)."""

    def __init__(self, interval: int) -> None:
        self.interval, self.docs, self.nbytes, self.start = interval, 0, 0, time.time()

    def add(self, docs: int, nbytes: int) -> None:
        before, self.docs, self.nbytes = self.docs, self.docs + docs, self.nbytes + nbytes
        if self.docs // self.interval > before // self.interval:
            elapsed = max(time.time() - self.start, 1e-9)
            print(f"Processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                  f"{self.nbytes / elapsed / 2**20:.2f} MB/s).", file=sys.stderr, flush=True)


def encode_file(path: str, first_line: int, stride: int, config: EncodeConfig, workers: int,
                prefixes: Dict[str, str], log_interval: int) -> Dict[str, int]:
    """Encode ``path`` into a dataset per key at ``prefixes`` (+ its sidecars); returns the
    sequences written per key."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=np.dtype(config.dtype).type) for k, p in prefixes.items()}
    compression: Dict[str, list] = {k: [] for k in prefixes}
    starts: list = []
    progress = _Progress(log_interval)
    blocks = _blocks(path, first_line, stride)
    pool = multiprocessing.Pool(workers, initializer=init_worker, initargs=(config,)) if workers > 1 else None
    try:
        if pool is None:
            init_worker(config)
        for enc in (_in_order(pool, blocks, 4 * workers) if pool else map(encode_block, blocks)):
            for key, builder in builders.items():
                tokens, offset = enc.tokens[key], 0
                for lengths in enc.sequence_lengths[key]:
                    end = offset + sum(lengths)
                    builder.add_document(tokens[offset:end], lengths)
                    offset = end
                compression[key].extend(enc.compression[key])
            starts.extend(enc.loss_starts)
            progress.add(enc.documents, enc.nbytes)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
        if not config.split_sentences:
            np.save(prefixes[key] + "_compression.npy", np.asarray(compression[key], dtype=np.float32))
    if config.loss_start_key is not None:
        np.save(prefixes[config.json_keys[0]] + "_loss_start.npy", np.asarray(starts, dtype=np.int64))
    return {k: len(b.sequence_lengths) for k, b in builders.items()}


def _split_input(files: List[str], parts: int, sequential: bool, folder: str) -> List[Tuple[str, int, int]]:
    """The input's lines dealt into ``parts`` files in ``folder``: (path, first line, stride)
    each, line numbers counted over the inputs in order."""
    n = 0
    if sequential:
        for name in files:
            with open(name, "rb") as f:
                n += sum(1 for _ in f)
    size = -(-n // parts) if sequential else 0
    paths = [os.path.join(folder, f"part{i}.jsonl") for i in range(parts)]
    outs = [open(p, "wb") for p in paths]
    try:
        i = 0
        for name in files:
            with open(name, "rb") as f:
                for line in f:
                    part = min(i // size, parts - 1) if sequential else i % parts
                    outs[part].write(line if line.endswith(b"\n") else line + b"\n")
                    i += 1
    finally:
        for o in outs:
            o.close()
    if sequential:
        return [(p, 1 + k * size, 1) for k, p in enumerate(paths)]
    return [(p, 1 + k, parts) for k, p in enumerate(paths)]


def _encode_part(conn, *args) -> None:
    """One part in its own process; sends back the sequence counts or the error line."""
    try:
        conn.send(("ok", encode_file(*args)))
    except (ValueError, OSError) as e:
        conn.send(("error", str(e)))
    finally:
        conn.close()


def _encode_parts(files, args, config: EncodeConfig, prefixes: Dict[str, str], folder: str) -> Dict[str, int]:
    """``--partitions``: encode the parts concurrently, then merge them in part order."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    parts = _split_input(files, args.partitions, args.keep_sequential_samples, folder)
    part_prefixes = [{k: os.path.join(folder, f"part{i}_{k}") for k in prefixes} for i in range(len(parts))]
    procs = []
    for (path, first, stride), pp in zip(parts, part_prefixes):
        recv, send = multiprocessing.Pipe(duplex=False)
        proc = multiprocessing.Process(target=_encode_part, args=(send, path, first, stride, config,
                                                                   args.workers // args.partitions, pp,
                                                                   args.log_interval))
        proc.start()
        send.close()
        procs.append((proc, recv))
    errors = []
    for proc, recv in procs:
        try:
            status, value = recv.recv()
        except EOFError:
            status, value = "error", "a partition's process died without a result"
        proc.join()
        if status == "error":
            errors.append(value)
    if errors:
        raise ValueError(errors[0])
    counts = {}
    for key, prefix in prefixes.items():
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.dtype(config.dtype).type)
        for pp in part_prefixes:
            builder.add_index(pp[key])
        builder.finalize(prefix + ".idx")
        counts[key] = len(builder.sequence_lengths)
        sidecars = ["_compression.npy"] if not config.split_sentences else []
        if config.loss_start_key is not None and key == config.json_keys[0]:
            sidecars.append("_loss_start.npy")
        for suffix in sidecars:
            np.save(prefix + suffix, np.concatenate([np.load(pp[key] + suffix) for pp in part_prefixes]))
    return counts


def _publish(folder: str, names: Dict[str, str], temps: Dict[str, str]) -> None:
    """Rename the finished files into place: sidecars, then .bin, then .idx (a dataset that
    opens is complete); a stale sidecar the new dataset lacks is removed first."""
    for key, final in names.items():
        made = [s for s in ("_loss_start.npy", "_compression.npy") if os.path.exists(temps[key] + s)]
        for suffix in ("_loss_start.npy", "_compression.npy"):
            if suffix not in made and os.path.exists(final + suffix):
                os.remove(final + suffix)
        for suffix in (*made, ".bin", ".idx"):
            with open(temps[key] + suffix, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temps[key] + suffix, final + suffix)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    config, names, files, vocab = _check(args)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=".preprocess-", dir=out_dir)
    except OSError as e:
        usage_error(f"--output-prefix {args.output_prefix}: {e.strerror}", prog=PROG, code=1)
    temps = {k: os.path.join(folder, os.path.basename(v)) for k, v in names.items()}
    try:
        if args.partitions == 1:
            counts = encode_file(files[0], 1, 1, config, args.workers, temps, args.log_interval)
        else:
            counts = _encode_parts(files, args, config, temps, folder)
        empty = [k for k, n in counts.items() if n == 0]
        if empty:
            raise ValueError(f"{args.input}: no non-empty documents to write (key {empty[0]!r})")
        _publish(folder, names, temps)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        usage_error(str(e), prog=PROG, code=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for key, name in names.items():
        extra = f" and loss starts to {name}_loss_start.npy" if args.loss_start_key else ""
        print(f"wrote {counts[key]} documents to {name}.bin/.idx (vocab {vocab}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
