"""The byte-level tokenizer the evaluation uses (1 token = 1 byte).

The driver's :class:`megatron.training.tokenizer.ByteTokenizer` is the one
tokenizer: training data is tokenized by it (``tools/preprocess_data.py``), so
the evaluation uses the same class and ids agree by construction (UTF-8 bytes,
vocab 256). The harness lives outside the library package, so importing the
driver here is allowed. The driver appends no end-of-document token (documents
are delimited by ``cu_seqlens``), so ``eod`` is None and decoding stops only at
ANSWER_END.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from megatron.training.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Tokenizer", "eod_id", "get_tokenizer"]


class Tokenizer(Protocol):
    """What the evaluation needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def eod_id(tok: Tokenizer) -> Optional[int]:
    """The tokenizer's end-of-document id, or None when it has none."""
    return getattr(tok, "eod", None)


def get_tokenizer() -> Tokenizer:
    """The driver's byte tokenizer."""
    return ByteTokenizer()
