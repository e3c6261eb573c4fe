"""Tokenizers the driver and tools/preprocess_data.py understand (Megatron-LM's ``--tokenizer-type`` names).

* ``ByteTokenizer`` (this project's, offline, no files): UTF-8 bytes are the token ids, vocab 256.
* ``GPT2BPETokenizer``: byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt), read with the ``tokenizers`` package.
* ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a ``tokenizer.json`` or a local directory
  holding one (or vocab.json + merges.txt). Nothing is downloaded: a name that is not a local
  path is refused with one line.
* ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer``: a
  SentencePiece ``tokenizer.model`` (or a directory holding one), read with the
  ``sentencepiece`` package; without it, one line naming the package.
* ``NullTokenizer``: the data are token ids already; the vocabulary is ``--vocab-size``.

Every failure is a ``ValueError`` with one line naming the flag and the file.

Each tokenizer's ``eod`` is the id ``tools/preprocess_data.py --append-eod`` appends, as
Megatron-LM's tokenizer of the same type has it (None where it has none): GPT-2's
``<|endoftext|>``; a Hugging Face tokenizer's ``eos_token`` (from the ``tokenizer_config.json``
beside its ``tokenizer.json``, where ``transformers`` reads it); SentencePiece's eos.
"""

from __future__ import annotations

import os
from typing import List, Optional

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
"""``--tokenizer-type`` names that read a SentencePiece ``tokenizer.model``."""


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255)."""

    vocab_size = 256
    eod = None  # every id is a byte: no id is left for an end-of-document token

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFJsonTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer: ``tokenizer.json``, a directory holding one, or
    a directory holding GPT-2 style ``vocab.json`` + ``merges.txt``."""

    def __init__(self, path: str, flag: str = "--tokenizer-model") -> None:
        from tokenizers import Tokenizer

        if not os.path.exists(path):
            raise ValueError(f"{flag} {path}: not a local file or directory (this driver does not "
                             "download from the Hugging Face hub: download the tokenizer files first, "
                             "e.g. huggingface-cli download NAME --local-dir DIR, and pass DIR)")
        file = path
        if os.path.isdir(path):
            file = os.path.join(path, "tokenizer.json")
            if not os.path.isfile(file):
                vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
                if os.path.isfile(vocab) and os.path.isfile(merges):
                    self._tok = _byte_level_bpe(vocab, merges, flag)
                    self.vocab_size = self._tok.get_vocab_size()
                    self.eod = self._config_eos(path)
                    return
                spm = " (it has tokenizer.model: use --tokenizer-type Llama2Tokenizer or " \
                      "SentencePieceTokenizer)" if os.path.isfile(os.path.join(path, "tokenizer.model")) else ""
                raise ValueError(f"{flag} {path}: directory has no tokenizer.json (nor vocab.json + "
                                 f"merges.txt){spm}")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            detail = " ".join(str(e).split())[:160]
            raise ValueError(f"{flag} {file}: not a Hugging Face tokenizer.json ({detail})") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self._config_eos(os.path.dirname(os.path.abspath(file)))

    def _config_eos(self, folder: str) -> Optional[int]:
        """Id of the ``eos_token`` that ``folder/tokenizer_config.json`` names, or None."""
        import json

        try:
            with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(eos, dict):  # an AddedToken written out: {"content": ..., ...}
            eos = eos.get("content")
        return self.token_id(eos) if isinstance(eos, str) else None

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids)

    def offsets(self, text: str) -> List[tuple]:
        """(start, end) character span in ``text`` of each token :meth:`encode` gives."""
        return self._tok.encode(text).offsets

    def token_id(self, token: str) -> Optional[int]:
        """The id of ``token`` in the vocabulary (added tokens included), or None."""
        return self._tok.token_to_id(token)


def _byte_level_bpe(vocab: str, merges: str, flag: str):
    """GPT-2's byte-level BPE (``tokenizers`` ``Tokenizer``) from vocab.json + merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    for path, name in ((vocab, "--vocab-file"), (merges, "--merge-file")):
        if not os.path.isfile(path):
            raise ValueError(f"{name} {path} does not exist")
    try:
        tok = Tokenizer(models.BPE.from_file(vocab, merges))
    except Exception as e:
        detail = " ".join(str(e).split())[:160]
        raise ValueError(f"{flag}: cannot read {vocab} / {merges} as GPT-2 BPE files ({detail})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class GPT2BPETokenizer(HFJsonTokenizer):
    """GPT-2's byte-level BPE from ``--vocab-file`` and ``--merge-file``."""

    UNKNOWN_TOKEN = "<|endoftext|>"
    """What Hugging Face's GPT-2 tokenizer (Megatron-LM's) maps a token outside the vocabulary to."""

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]) -> None:
        if not vocab_file or not merge_file:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                             "--merge-file (merges.txt)")
        self._tok = _byte_level_bpe(vocab_file, merge_file, "--tokenizer-type GPT2BPETokenizer")
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self.token_id(self.UNKNOWN_TOKEN)  # Megatron-LM's GPT-2 eod is <|endoftext|>


class SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (Llama 2, Mistral, ...)."""

    def __init__(self, path: str, tokenizer_type: str = "SentencePieceTokenizer") -> None:
        file = os.path.join(path, "tokenizer.model") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"--tokenizer-model {path}: no SentencePiece tokenizer.model there "
                             f"(--tokenizer-type {tokenizer_type})")
        try:
            import sentencepiece
        except ImportError:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs the sentencepiece package to read "
                             f"{file} (pip install sentencepiece)") from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=file)
        except Exception as e:
            detail = " ".join(str(e).split())[:160]
            raise ValueError(f"--tokenizer-model {file}: not a SentencePiece model ({detail})") from None
        self.vocab_size = int(self._sp.vocab_size())
        # Megatron-LM's GPT-style SentencePiece tokenizers end documents with the model's eos;
        # its plain SentencePieceTokenizer appends its own <eod> beyond the model's vocabulary,
        # which the embedding here would not have: none
        eos = int(self._sp.eos_id())
        self.eod = eos if eos >= 0 and tokenizer_type != "SentencePieceTokenizer" else None

    def encode(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: List[int]) -> str:
        return self._sp.decode(list(ids))


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
    """The tokenizer ``--tokenizer-type`` names (NullTokenizer has none: returns None)."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                             "(tokenizer.json or a directory holding one)")
        return HFJsonTokenizer(tokenizer_model)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (tokenizer.model)")
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type == "NullTokenizer":
        return None
    raise ValueError(f"--tokenizer-type {tokenizer_type}: not supported by this driver")


def unused_tokenizer_files(tokenizer_type: str, tokenizer_model: Optional[str], vocab_file: Optional[str],
                           merge_file: Optional[str]) -> List[str]:
    """The tokenizer flags given that ``tokenizer_type`` would not read (never ignored silently)."""
    reads = {"ByteTokenizer": (), "NullTokenizer": (), "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
             "HuggingFaceTokenizer": ("--tokenizer-model",)}.get(tokenizer_type, ("--tokenizer-model",))
    given = {"--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file, "--merge-file": merge_file}
    return [f for f, v in given.items() if v is not None and f not in reads]


def vocab_size_for(tokenizer_type: str, tokenizer_model: Optional[str], vocab_size: Optional[int],
                   vocab_file: Optional[str] = None, merge_file: Optional[str] = None) -> int:
    """Embedding rows the model needs: ``--vocab-size`` if given, else the tokenizer's."""
    if vocab_size is not None:
        return vocab_size
    tok = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if tok is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --vocab-size")
    return tok.vocab_size


def args_tokenizer(args):
    """:func:`build_tokenizer` of parsed ``pretrain_gpt.py`` args."""
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, getattr(args, "vocab_file", None),
                           getattr(args, "merge_file", None))


def args_vocab_size(args) -> int:
    """:func:`vocab_size_for` of parsed ``pretrain_gpt.py`` args."""
    return vocab_size_for(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                          getattr(args, "vocab_file", None), getattr(args, "merge_file", None))


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by x tensor_parallel``
    (``--make-vocab-size-divisible-by``): embedding rows split evenly over TP ranks."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def model_vocab_size(args) -> int:
    """Embedding rows of the run's model: ``--padded-vocab-size`` when given (Megatron-LM
    takes it as is, e.g. from a checkpoint's args), else the tokenizer's vocabulary padded
    by :func:`padded_vocab_size`. ValueError (one line) when the given size cannot hold
    the tokenizer's ids or does not split evenly over the TP ranks."""
    vocab, tp = args_vocab_size(args), args.tensor_model_parallel_size
    given = getattr(args, "padded_vocab_size", None)
    if given is None:
        return padded_vocab_size(vocab, args.make_vocab_size_divisible_by, tp)
    if given < vocab:
        raise ValueError(f"--padded-vocab-size {given} is smaller than the vocabulary of --tokenizer-type "
                         f"{args.tokenizer_type} ({vocab} ids): give at least {vocab}")
    if given % tp:
        raise ValueError(f"--padded-vocab-size {given} does not split over --tensor-model-parallel-size {tp}: "
                         f"give a multiple of {tp}")
    return given
