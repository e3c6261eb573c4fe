"""The byte-level tokenizer the evaluation uses (1 token = 1 byte).

The driver's ``megatron.training.tokenizer.ByteTokenizer`` is the source of
truth: training data is tokenized by it (``tools/preprocess_data.py``), so ids
must agree. :func:`get_tokenizer` returns it when importable and otherwise the
stand-in :class:`ByteTokenizer` below with the same ids (UTF-8 bytes, vocab
256). The driver appends no end-of-document token (documents are delimited by
``cu_seqlens``), so ``eod`` is None and decoding stops only at ANSWER_END.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence


class Tokenizer(Protocol):
    """What the evaluation needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255), no special tokens."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def eod_id(tok: Tokenizer) -> Optional[int]:
    """The tokenizer's end-of-document id, or None when it has none."""
    return getattr(tok, "eod", None)


def get_tokenizer() -> Tokenizer:
    """The driver's byte tokenizer if importable, else :class:`ByteTokenizer`."""
    try:
        from megatron.training.tokenizer import ByteTokenizer as DriverByteTokenizer
    except ImportError:
        return ByteTokenizer()
    return DriverByteTokenizer()
