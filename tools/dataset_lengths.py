"""An indexed dataset's document lengths -> the length file the profile and the simulator read.

Writes a JSON list with one integer per document (tokens), in dataset order: the documents
as the trainer packs them, i.e. each sequence of the index (a ``--split-sentences`` dataset's
sentences). Several prefixes are concatenated in the order given. Read with megatron-core's
``IndexedDataset`` (the index only: no token is read).

Tiny CPU run (a dataset written by tools/preprocess_data.py or tools/make_corpus.py)::

    .venv/bin/python tools/dataset_lengths.py --data-path data/mydocs --output data/mydocs_lengths.json

GPU cluster run, then the consumers of the length file::

    python tools/dataset_lengths.py --data-path /lustre/data/corpus_text_document --output corpus_lengths.json
    python tools/profile_latency.py --lengths corpus_lengths.json ...     # the latency profile
    python benchmarks/compare.py --mode sim --lengths corpus_lengths.json  # the cluster simulator
    python -m sparsebalance.batching pack --lengths corpus_lengths.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import usage_error  # noqa: E402

quiet_optional_extras()

PROG = "dataset_lengths.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(message, prog=PROG)


def dataset_lengths(prefixes) -> list:
    """Tokens of each document of the datasets at ``prefixes``, in order; ValueError (one line)
    if one is missing or corrupt."""
    from megatron.training.indexed_io import open_dataset

    lengths: list = []
    for prefix in prefixes:
        ds = open_dataset(prefix)
        # copied while ``ds`` is alive: its lengths are a view of the index's memory map,
        # which closes with it
        lengths.extend(np.array(ds.sequence_lengths, dtype=np.int64).tolist())
        del ds
    return lengths


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--data-path", nargs="+", required=True, metavar="PREFIX",
                   help="indexed dataset prefix(es) (<prefix>.bin/.idx)")
    p.add_argument("--output", default=None, help="JSON file to write (atomic); default: stdout")
    args = p.parse_args(argv)
    try:
        lengths = dataset_lengths(args.data_path)
    except ValueError as e:
        usage_error(str(e), prog=PROG, code=1)
    text = json.dumps(lengths)
    if args.output is None:
        print(text)
        return 0
    from sparsebalance.io import atomic_write_text

    try:
        atomic_write_text(args.output, text + "\n")
    except OSError as e:
        usage_error(f"--output {args.output}: {e.strerror or e}", prog=PROG, code=1)
    print(f"wrote {len(lengths)} document lengths ({sum(lengths)} tokens) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
