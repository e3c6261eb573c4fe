"""Fill-in-the-middle data (Megatron-LM's ``--fim-data``, its ``GPTFIMDataset``'s transform).

Each document's tokens are cut at its EOD tokens into segments; each non-empty segment is,
with probability ``--fim-rate``, decoded to text, split at two character positions drawn
uniformly (prefix / middle / suffix, any of them possibly empty), each part encoded again
and rearranged with the sentinel tokens, as SPM with probability ``--fim-spm-rate``
(``<prefix> <suffix> suffix <middle> prefix middle``) or else PSM
(``<prefix> prefix <suffix> suffix <middle> middle``). The EOD tokens stay where they were,
and the result is cut, or filled with ``--fim-pad-token``, to the document's length, as
Megatron-LM keeps each sample's length: document lengths, and with them every packing,
SAB and DST plan, do not change.

Megatron-LM draws from one generator over its samples in order; a document here is read
in pieces (chunked at ``--seq-length``, re-read by a re-run or after a resume), so the
draws of a document come from a generator seeded by ``--seed`` and the document's index:
the same document reads the same way every time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


@dataclass
class FIMConfig:
    """The FIM transform's rates and sentinel token ids."""

    rate: float
    """``--fim-rate``: probability that a segment is rearranged."""
    spm_rate: float
    """``--fim-spm-rate``: probability that a rearranged segment is SPM (else PSM)."""
    prefix_id: int
    """Id of ``--fim-prefix-token``."""
    middle_id: int
    """Id of ``--fim-middle-token``."""
    suffix_id: int
    """Id of ``--fim-suffix-token``."""
    pad_id: int
    """Id of ``--fim-pad-token`` (fills a document that came out shorter)."""
    eod_id: int
    """Id of ``--fim-eod-token`` (segments are cut there)."""
    seed: int = 1234
    """``--seed``: with the document index, seeds the document's draws."""

    def __post_init__(self) -> None:
        for flag, value in (("--fim-rate", self.rate), ("--fim-spm-rate", self.spm_rate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{flag} {value}: a probability in [0, 1]")


def permute(tokens: np.ndarray, tokenizer, config: FIMConfig, rng: np.random.RandomState) -> np.ndarray:
    """One segment (no EOD inside) rearranged as described in the module docstring, or as is."""
    if not rng.binomial(1, config.rate):
        return tokens
    text = tokenizer.decode([int(t) for t in tokens])
    lo, hi = sorted(int(b) for b in rng.randint(low=0, high=len(text) + 1, size=2))
    prefix, middle, suffix = (np.asarray(tokenizer.encode(part), dtype=np.int64)
                              for part in (text[:lo], text[lo:hi], text[hi:]))
    pre, mid, suf = ([config.prefix_id], [config.middle_id], [config.suffix_id])
    if rng.binomial(1, config.spm_rate):
        parts = [pre, suf, suffix, mid, prefix, middle]
    else:
        parts = [pre, prefix, suf, suffix, mid, middle]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def fim_document(tokens: np.ndarray, tokenizer, config: FIMConfig, rng: np.random.RandomState) -> np.ndarray:
    """A whole document transformed: segments between EOD tokens rearranged, EODs kept,
    the result cut or padded to ``len(tokens)``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out, start = [], 0
    for loc in np.flatnonzero(tokens == config.eod_id):
        if loc > start:
            out.append(permute(tokens[start:loc], tokenizer, config, rng))
        out.append(tokens[loc:loc + 1])
        start = loc + 1
    if start < len(tokens):
        out.append(permute(tokens[start:], tokenizer, config, rng))
    doc = np.concatenate(out) if out else tokens
    if len(doc) >= len(tokens):
        return doc[:len(tokens)]
    return np.concatenate([doc, np.full(len(tokens) - len(doc), config.pad_id, dtype=np.int64)])


class FIMDocuments:
    """A document dataset (``sequence_lengths``, ``get(idx, offset, length)``) whose documents
    read FIM-transformed; every other attribute is the wrapped dataset's."""

    CACHED = 8
    """Transformed documents kept (a long document is read in several chunks in a row)."""

    def __init__(self, dataset, tokenizer, config: FIMConfig) -> None:
        self.dataset, self.tokenizer, self.config = dataset, tokenizer, config
        self._cache: "OrderedDict[int, np.ndarray]" = OrderedDict()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # only for names this class lacks (``sequence_lengths``, blend parts)
        if name == "dataset":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def document(self, idx: int) -> np.ndarray:
        """Document ``idx`` transformed (the same array on every call)."""
        doc = self._cache.get(idx)
        if doc is None:
            rng = np.random.RandomState((self.config.seed * 1_000_003 + idx) % 2**32)
            doc = fim_document(np.asarray(self.dataset.get(idx)), self.tokenizer, self.config, rng)
            self._cache[idx] = doc
            if len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        return doc

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        doc = self.document(int(idx))
        return doc[offset:] if length is None else doc[offset:offset + length]


def sentinel_id(tokenizer, flag: str, token: str, warn: Callable[[str], None] = lambda m: None) -> int:
    """The id of a sentinel token; ``ValueError`` (one line) if the tokenizer has it as no single id.

    A vocabulary lookup where the tokenizer has one (Hugging Face, GPT-2 BPE); GPT-2 maps a
    token it lacks to ``<|endoftext|>`` as Megatron-LM's (Hugging Face's) GPT-2 tokenizer does,
    with one ``warn`` line: the FIM configs of Megatron-LM's tests use GPT-2's vocabulary,
    which has no ``<fim_*>`` tokens. Otherwise the token must encode to one id."""
    if tokenizer is None:
        raise ValueError(f"--fim-data needs a tokenizer with text (not NullTokenizer) to find {flag} {token}")
    lookup = getattr(tokenizer, "token_id", None)
    if lookup is not None:
        found = lookup(token)
        unknown = getattr(tokenizer, "UNKNOWN_TOKEN", None)
        if found is None and unknown is not None and lookup(unknown) is not None:
            warn(f"{flag} {token} is not in the vocabulary: it is {unknown} (id {lookup(unknown)}), "
                 "as Megatron-LM's GPT-2 tokenizer maps an unknown token")
            return int(lookup(unknown))
        if found is None:
            raise ValueError(f"{flag} {token}: not in the tokenizer's vocabulary; give a token of it")
        return int(found)
    ids = tokenizer.encode(token)
    if len(ids) != 1:
        raise ValueError(f"{flag} {token}: not one token of the tokenizer (it encodes to {len(ids)} ids); "
                         "give a token of its vocabulary")
    return int(ids[0])


def fim_config(args, tokenizer, warn: Callable[[str], None] = lambda m: None) -> FIMConfig:
    """:class:`FIMConfig` from the driver's ``--fim-*`` flags (``warn``: see :func:`sentinel_id`)."""
    ids = {name: sentinel_id(tokenizer, f"--fim-{name}-token", getattr(args, f"fim_{name}_token"), warn)
           for name in ("prefix", "middle", "suffix", "pad", "eod")}
    return FIMConfig(args.fim_rate, args.fim_spm_rate, ids["prefix"], ids["middle"], ids["suffix"], ids["pad"],
                     ids["eod"], args.seed)
