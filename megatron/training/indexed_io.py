"""Write and open megatron-core indexed datasets (``<prefix>.bin`` / ``<prefix>.idx``).

Writing goes through megatron-core's ``IndexedDatasetBuilder`` into a temporary
prefix that is renamed into place only when complete (``.bin`` first, ``.idx``
last), so an interrupted write never leaves a dataset that opens. Reading goes
through ``IndexedDataset``; :func:`open_dataset` turns a missing or corrupt
dataset into a ``ValueError`` with one readable line.

A dataset may carry per-document loss starts in ``<prefix>_loss_start.npy``
(int64, one per document): the first token of each document that is a training
target (0: all of it). Task documents put their prompt before it, so with
``--mask-prompt-loss`` the model is trained on answers only, given the prompt.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from sparsebalance.io import atomic_path


def write_documents(prefix: str, documents: Iterable[np.ndarray], vocab_size: int) -> int:
    """Write token-id documents (1-D int arrays) to ``prefix``; returns the count.

    Tokens are stored as uint16 when ``vocab_size <= 65536`` (else int32).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if vocab_size <= 65536 else np.int32
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    n = 0
    # both files appear whole or not at all (a failure removes both temporaries)
    with atomic_path(prefix + ".bin", suffix=".bin") as tmp_bin, \
            atomic_path(prefix + ".idx", suffix=".idx") as tmp_idx:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        for doc in documents:
            doc = np.asarray(doc)
            if doc.size == 0:
                continue
            # a numpy array: the builder casts it to its dtype (a torch tensor would not be cast)
            builder.add_document(doc.astype(dtype), [doc.size])
            n += 1
        builder.finalize(tmp_idx)
        if n == 0:
            raise ValueError("no non-empty documents to write")
    return n


def loss_start_path(prefix: str) -> str:
    """The loss-start sidecar of dataset ``prefix``."""
    return prefix + "_loss_start.npy"


def write_loss_starts(prefix: str, starts: Iterable[int]) -> int:
    """Write per-document loss starts (tokens) next to dataset ``prefix``; returns the count.

    Written atomically (``sparsebalance.io``), so the sidecar is whole or absent.
    """
    arr = np.asarray(list(starts), dtype=np.int64)
    if arr.ndim != 1 or (arr < 0).any():
        raise ValueError("loss starts must be non-negative token offsets, one per document")
    path = loss_start_path(prefix)
    with atomic_path(path, suffix=".npy") as tmp:
        np.save(tmp, arr)
    return int(arr.size)


def open_loss_starts(prefix: str, lengths: np.ndarray) -> np.ndarray:
    """Loss starts of dataset ``prefix`` (its documents have ``lengths``); ValueError if unusable."""
    path = loss_start_path(prefix)
    if not os.path.isfile(path):
        raise ValueError(f"--mask-prompt-loss needs {path} "
                         "(write it with tools/preprocess_data.py --loss-start-key)")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a numpy array file ({e})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or len(arr) != len(lengths):
        raise ValueError(f"{path}: expected {len(lengths)} integer loss starts, one per document, "
                         f"got shape {arr.shape} {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr > np.asarray(lengths, dtype=np.int64)))
    if bad.size:
        raise ValueError(f"{path}: document {int(bad[0])} has loss start {int(arr[bad[0]])} outside "
                         f"[0, {int(lengths[bad[0]])}]")
    return arr


def open_dataset(prefix: str):
    """``IndexedDataset`` for ``prefix``; ValueError (one line) if missing or corrupt."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise ValueError(f"data path {prefix + ext} does not exist")
    # Construct in two steps so a failed __init__ leaves an object whose __del__
    # (which deletes bin_reader and index) does not print a second traceback.
    ds = IndexedDataset.__new__(IndexedDataset)
    try:
        ds.__init__(prefix, mmap=True)
        lengths = np.asarray(ds.sequence_lengths)
        expected = int(lengths.sum()) * np.dtype(ds.index.dtype).itemsize
    except Exception as e:  # megatron asserts on a bad header; report it as bad data
        for attr in ("bin_reader", "index"):
            if not hasattr(ds, attr):
                setattr(ds, attr, None)
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ValueError(f"data path {prefix}: not a valid indexed dataset "
                         f"({type(e).__name__}{': ' + detail if detail else ''})") from None
    actual = os.path.getsize(prefix + ".bin")
    if len(lengths) == 0:
        raise ValueError(f"data path {prefix}: dataset has no documents")
    if actual != expected:
        raise ValueError(f"data path {prefix}: .bin holds {actual} bytes but the index describes {expected}")
    return ds
