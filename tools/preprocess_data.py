"""JSONL (one ``{"text": ...}`` per line) -> megatron-core indexed dataset (.bin/.idx).

Tiny CPU run (built-in byte-level tokenizer, works offline)::

    .venv/bin/python tools/preprocess_data.py --input docs.jsonl --output-prefix data/mydocs

GPU cluster run (a Hugging Face ``tokenizers`` JSON, e.g. Qwen2.5's)::

    python tools/preprocess_data.py --input /lustre/corpus.jsonl --output-prefix /lustre/data/corpus \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /lustre/qwen2.5/tokenizer.json

One document per line; lines whose text is empty are skipped. The output appears
only when complete (written under a temporary name, then renamed). Also writes
``<prefix>_compression.npy``: each document's zlib compressed / raw bytes of its text, a
feature SAB's density estimator reads under ``--sb-routing threshold``
(``megatron/training/doc_features.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import usage_error  # noqa: E402

quiet_optional_extras()

PROG = "preprocess_data.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(message, prog=PROG)


def _documents(path: str, key: str, tokenizer, start_key=None, starts=None, ratios=None):
    """Token arrays of the non-empty documents; with ``start_key``, appends each one's
    loss start (tokens of ``text[:record[start_key]]``; 0 when the field is absent) to
    ``starts``; appends each one's text compression ratio to ``ratios``."""
    import numpy as np

    from megatron.training.doc_features import compression_ratio

    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a JSON object with a {key!r} field")
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: {key!r} is not a string")
            if not text:
                continue
            if start_key is not None:
                chars = record.get(start_key, 0)
                if isinstance(chars, bool) or not isinstance(chars, int) or not 0 <= chars <= len(text):
                    raise ValueError(f"{path}:{lineno}: {start_key!r} must be a character offset "
                                     f"in [0, {len(text)}], got {chars!r}")
                # a prefix's own tokenization: exact for the byte tokenizer; for a
                # subword tokenizer the token straddling the offset counts as prompt
                starts.append(len(tokenizer.encode(text[:chars])) if chars else 0)
            ratios.append(compression_ratio(text))
            yield np.asarray(tokenizer.encode(text), dtype=np.int64)


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="JSONL file")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--json-key", default="text")
    p.add_argument("--tokenizer-type", choices=("ByteTokenizer", "HuggingFaceTokenizer"), default="ByteTokenizer")
    p.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: tokenizer.json, or a directory holding it (a converted model's hf/)")
    p.add_argument("--loss-start-key", default=None,
                   help="JSON field holding the character offset where a document's training "
                        "targets start (absent: 0); writes <prefix>_loss_start.npy for "
                        "pretrain_gpt.py --mask-prompt-loss")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        usage_error(f"--input {args.input} does not exist", prog=PROG)
    from megatron.training import tokenizer as tok
    from megatron.training.doc_features import compression_path, write_compression
    from megatron.training.indexed_io import loss_start_path, write_documents, write_loss_starts

    if args.tokenizer_type == "HuggingFaceTokenizer":
        if not args.tokenizer_model or not os.path.exists(args.tokenizer_model):
            usage_error("--tokenizer-type HuggingFaceTokenizer needs an existing --tokenizer-model "
                        "(tokenizer.json or a directory holding one)", prog=PROG)
        try:
            tokenizer = tok.HFJsonTokenizer(args.tokenizer_model)
        except ValueError as e:
            usage_error(str(e), prog=PROG)
    else:
        tokenizer = tok.ByteTokenizer()
    starts = [] if args.loss_start_key else None
    ratios: list = []
    try:
        for old in (loss_start_path(args.output_prefix), compression_path(args.output_prefix)):
            if os.path.exists(old):
                os.remove(old)  # never pair new data with old sidecars
        n = write_documents(args.output_prefix,
                            _documents(args.input, args.json_key, tokenizer, args.loss_start_key, starts,
                                       ratios),
                            tokenizer.vocab_size)
        if starts is not None:
            write_loss_starts(args.output_prefix, starts)
        write_compression(args.output_prefix, ratios)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        usage_error(str(e), prog=PROG, code=1)
    extra = f" and loss starts to {loss_start_path(args.output_prefix)}" if starts is not None else ""
    print(f"wrote {n} documents to {args.output_prefix}.bin/.idx (vocab {tokenizer.vocab_size}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
