"""Tokenizers the driver and tools/preprocess_data.py understand.

``ByteTokenizer`` (built in, offline): UTF-8 bytes are the token ids, vocab 256.
``HuggingFaceTokenizer``: a ``tokenizers`` JSON file (``tokenizer.json``).
``NullTokenizer``: data are already token ids; the vocab size comes from ``--vocab-size``.
"""

from __future__ import annotations

from typing import List, Optional


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255)."""

    vocab_size = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFJsonTokenizer:
    """A Hugging Face ``tokenizers`` JSON file."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids)


def vocab_size_for(tokenizer_type: str, tokenizer_model: Optional[str], vocab_size: Optional[int]) -> int:
    """Embedding rows the model needs: ``--vocab-size`` if given, else the tokenizer's."""
    if vocab_size is not None:
        return vocab_size
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer.vocab_size
    if tokenizer_type == "HuggingFaceTokenizer":
        return HFJsonTokenizer(tokenizer_model).vocab_size
    raise ValueError(f"tokenizer_type {tokenizer_type!r} needs an explicit vocab_size")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by x tensor_parallel``
    (``--make-vocab-size-divisible-by``): embedding rows split evenly over TP ranks."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple
