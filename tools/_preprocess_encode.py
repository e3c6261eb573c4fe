"""The encoding half of ``tools/preprocess_data.py``: JSONL lines -> token ids, a block of
lines at a time, in the calling process or in a pool of worker processes.

A block is a run of whole input lines (bytes); :func:`encode_block` returns, per JSON key,
the block's documents' token ids concatenated plus each document's sequence lengths (one
per sentence with ``--split-sentences``, else one; none for a document whose text yields
no tokens, as Megatron-LM's tool writes it). Blocks are independent, so encoding them in
any number of processes and writing them in block order gives the same files.

Each worker builds its own tokenizer from a :class:`TokenizerSpec` (a ``tokenizers`` or
SentencePiece object is not shared across processes): :func:`init_worker` is the pool's
initializer and sets the module state :func:`encode_block` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

MAX_SPLIT_CHARS = 1_000_000
"""Texts are split into sentences in pieces of at most this many characters (Megatron-LM's
bound on what punkt is handed at once)."""


class NullTextTokenizer:
    """``--tokenizer-type NullTokenizer``: the text is token ids separated by whitespace.

    As Megatron-LM's NullTokenizer: ids are below ``--vocab-size``, the end-of-document id
    is ``--vocab-size`` itself, so the vocabulary written is one larger.
    """

    def __init__(self, vocab_size: int) -> None:
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1

    def encode(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer text must be whitespace-separated integer token ids") from None
        bad = [i for i in ids if not 0 <= i < self.eod]
        if bad:
            raise ValueError(f"NullTokenizer token id {bad[0]} is outside [0, --vocab-size {self.eod})")
        return ids


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer flags (each process builds its own tokenizer from them)."""

    tokenizer_type: str
    """Megatron-LM's ``--tokenizer-type`` name."""
    tokenizer_model: Optional[str] = None
    """HuggingFaceTokenizer: tokenizer.json or a folder; SentencePiece types: tokenizer.model."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer: vocab.json."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer: merges.txt."""
    vocab_size: Optional[int] = None
    """NullTokenizer: ids are below it."""

    def build(self):
        """The tokenizer (``encode``, ``vocab_size``, ``eod``); ValueError (one line) if unusable."""
        if self.tokenizer_type == "NullTokenizer":
            if self.vocab_size is None or self.vocab_size < 1:
                raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size >= 1")
            return NullTextTokenizer(self.vocab_size)
        from megatron.training.tokenizer import build_tokenizer

        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file)


@dataclass(frozen=True)
class EncodeConfig:
    """What every worker needs to turn lines into token ids."""

    tokenizer: TokenizerSpec
    """Built once per process."""
    json_keys: Tuple[str, ...]
    """Fields of each JSON object; one output dataset each."""
    source: str
    """The input as error messages name it."""
    dtype: str
    """numpy dtype of the token ids written (megatron-core's ``DType.optimal_dtype``)."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id to each non-empty document."""
    split_sentences: bool = False
    """One sequence per sentence (nltk punkt) instead of one per document."""
    keep_newlines: bool = False
    """With ``split_sentences``: newlines after a sentence stay in it."""
    lang: str = "english"
    """punkt model of ``split_sentences``."""
    loss_start_key: Optional[str] = None
    """Field holding the character offset where a document's training targets start."""


@dataclass(frozen=True)
class Block:
    """Whole input lines; line ``k`` of ``data`` (0-based) is input line ``first_line + k * stride``."""

    first_line: int
    stride: int
    data: bytes


@dataclass
class Encoded:
    """One block's documents, per key (dataset order)."""

    tokens: Dict[str, np.ndarray] = field(default_factory=dict)
    """The documents' token ids, concatenated."""
    sequence_lengths: Dict[str, List[List[int]]] = field(default_factory=dict)
    """Per document: its sequences' lengths (sum = its tokens; [] when it has none)."""
    compression: Dict[str, List[float]] = field(default_factory=dict)
    """Per document with tokens: zlib compressed / raw bytes of its text."""
    loss_starts: List[int] = field(default_factory=list)
    """Per document with tokens (one key only): tokens before its loss start."""
    documents: int = 0
    """Input lines that held a document."""
    nbytes: int = 0
    """Input bytes of the block."""


class _Identity:
    def tokenize(self, text: str) -> List[str]:
        return [text]


_STATE: dict = {}


def load_splitter(lang: str, keep_newlines: bool):
    """nltk's punkt sentence splitter for ``lang``; ValueError (one line) where nltk or its
    punkt data are not installed (nothing is downloaded)."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise ValueError("--split-sentences needs the nltk package and its punkt data "
                         "(pip install nltk; python -m nltk.downloader punkt)") from None
    try:
        splitter = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except (LookupError, OSError, ValueError) as e:
        detail = " ".join(str(e).split())[:120]
        raise ValueError(f"--split-sentences --lang {lang}: nltk's punkt model is not installed "
                         f"(python -m nltk.downloader punkt; {detail})") from None
    if not keep_newlines:
        return splitter

    class KeepNewlines(PunktLanguageVars):
        # punkt's period context looks ahead past the whitespace after a sentence end, and
        # that whitespace is dropped between sentences; consuming it in the match instead
        # (\s* before the look-ahead) keeps it, newlines included, on the sentence before
        _period_context_fmt = r"""
            \S*                  # word material
            %(SentEndChars)s     # a possible sentence end
            \s*                  # whitespace after it, kept on this sentence
            (?=(?P<after_tok>
                %(NonWord)s      # other punctuation
                |
                (?P<next_tok>\S+)
            ))"""

    return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=KeepNewlines())


def init_worker(config: EncodeConfig) -> None:
    """Build this process's tokenizer (and sentence splitter) for :func:`encode_block`."""
    _STATE["config"] = config
    _STATE["tokenizer"] = config.tokenizer.build()
    _STATE["splitter"] = (load_splitter(config.lang, config.keep_newlines) if config.split_sentences
                          else _Identity())


def _sentences(text, splitter) -> List[str]:
    if isinstance(text, list):  # already split, as Megatron-LM's tool accepts
        return text
    return [s for i in range(0, len(text), MAX_SPLIT_CHARS) for s in splitter.tokenize(text[i:i + MAX_SPLIT_CHARS])]


def _field(record, key: str, where: str):
    try:
        text = record[key]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: not a JSON object with a {key!r} field") from None
    if isinstance(text, list) and all(isinstance(s, str) for s in text):
        return text
    if not isinstance(text, str):
        raise ValueError(f"{where}: {key!r} is not a string (nor a list of strings)")
    return text


def _loss_start(record, key: str, text: str, tokenizer, where: str) -> int:
    chars = record.get(key, 0)
    if isinstance(chars, bool) or not isinstance(chars, int) or not 0 <= chars <= len(text):
        raise ValueError(f"{where}: {key!r} must be a character offset in [0, {len(text)}], got {chars!r}")
    # a prefix's own tokenization: exact for the byte tokenizer; for a subword tokenizer
    # the token straddling the offset counts as prompt
    return len(tokenizer.encode(text[:chars])) if chars else 0


def encode_block(block: Block) -> Encoded:
    """Token ids of the documents in ``block`` (see the module docstring); ValueError naming
    the input line on bad input."""
    from megatron.training.doc_features import compression_ratio

    config: EncodeConfig = _STATE["config"]
    tok, splitter = _STATE["tokenizer"], _STATE["splitter"]
    out = Encoded(nbytes=len(block.data))
    ids: Dict[str, list] = {k: [] for k in config.json_keys}
    for k in config.json_keys:
        out.sequence_lengths[k], out.compression[k] = [], []
    for n, raw in enumerate(block.data.split(b"\n")):
        if not raw.strip():
            continue
        where = f"{config.source}:{block.first_line + n * block.stride}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError:
            raise ValueError(f"{where}: not a JSON object") from None
        out.documents += 1
        for key in config.json_keys:
            text = _field(record, key, where)
            lengths = []
            for sentence in _sentences(text, splitter):
                try:
                    sentence_ids = tok.encode(sentence)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                if sentence_ids:
                    ids[key].extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if lengths and config.append_eod:
                ids[key].append(tok.eod)
                lengths[-1] += 1
            out.sequence_lengths[key].append(lengths)
            if lengths:
                whole = text if isinstance(text, str) else "".join(text)
                out.compression[key].append(compression_ratio(whole))
                if config.loss_start_key is not None:
                    out.loss_starts.append(_loss_start(record, config.loss_start_key, whole, tok, where))
    for key in config.json_keys:
        out.tokens[key] = np.asarray(ids[key], dtype=config.dtype)
    return out

