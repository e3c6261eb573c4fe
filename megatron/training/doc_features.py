"""Per-document features SAB's density estimator reads, and the attention feedback it learns from.

Under ``--sb-routing threshold`` with a cost-based packer (``--sb-batching sab``) the driver
builds a :class:`sparsebalance.batching.density_feedback.ThresholdDensity` from two
sidecars of each dataset prefix, both optional:

* ``PREFIX_sources.json`` (``{"doc_source": [str per document], "lengths": [...]}``, as
  ``benchmarks/make_hetero_corpus.py`` writes it): the source tag. In a blended
  ``--data-path`` a component without one is tagged with its prefix's file name.
* ``PREFIX_compression.npy`` (float32, one per document; ``tools/preprocess_data.py``
  writes it): zlib's compressed / raw bytes of the document's UTF-8 text (default level,
  as the sparsity study measures it). Computed once when the text is tokenized, the only
  time the text is at hand: the ``.bin`` holds tokens, and compressing every step's
  documents at training time would cost about as much as packing them.

After every step :func:`feedback` turns this rank's attention records into per-segment kept
and causal pairs of the whole step (:func:`segment_pairs`), all-reduces them over every
rank (pipeline stages add their layers, context-parallel ranks their shares) and hands the
same numbers to the estimator on every rank, so every rank packs alike.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Iterable, Optional, Tuple

import numpy as np

from sparsebalance.io import atomic_path


def compression_ratio(text: str) -> float:
    """zlib compressed / raw bytes of ``text`` in UTF-8 (1.0 for empty text)."""
    raw = text.encode("utf-8")
    return len(zlib.compress(raw)) / len(raw) if raw else 1.0


def compression_path(prefix: str) -> str:
    """The compression-ratio sidecar of dataset ``prefix``."""
    return prefix + "_compression.npy"


def write_compression(prefix: str, ratios: Iterable[float]) -> int:
    """Write per-document compression ratios next to dataset ``prefix`` (atomically)."""
    arr = np.asarray(list(ratios), dtype=np.float32)
    if arr.ndim != 1 or not np.all(np.isfinite(arr)) or (arr <= 0).any():
        raise ValueError("compression ratios must be positive numbers, one per document")
    with atomic_path(compression_path(prefix), suffix=".npy") as tmp:
        np.save(tmp, arr)
    return int(arr.size)


def _read_sidecars(prefix: str, n: int, blended: bool) -> Tuple[np.ndarray, np.ndarray]:
    """(sources [n] object, compression [n] float, NaN = unknown) of one dataset prefix;
    ValueError (one line) when a sidecar exists but does not fit the dataset."""
    src = np.full(n, os.path.basename(prefix) if blended else None, dtype=object)
    path = prefix + "_sources.json"
    if os.path.isfile(path):
        try:
            with open(path) as fh:
                side = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not readable JSON ({e})") from None
        names = side.get("doc_source") if isinstance(side, dict) else None
        if not isinstance(names, list) or len(names) != n or not all(isinstance(s, str) for s in names):
            raise ValueError(f"{path}: needs a 'doc_source' list of {n} source names")
        src = np.asarray(names, dtype=object)
    comp = np.full(n, np.nan)
    path = compression_path(prefix)
    if os.path.isfile(path):
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a numpy array file ({e})") from None
        if arr.shape != (n,) or arr.dtype.kind != "f":
            raise ValueError(f"{path}: expected {n} float ratios, got shape {arr.shape} {arr.dtype}")
        comp = arr.astype(np.float64)
    return src, comp


def document_features(blend, dataset) -> Tuple[np.ndarray, np.ndarray]:
    """(source [N], compression ratio [N]) of every document of ``dataset`` (the run's
    ``args.data_blend`` opened by ``data_sources.open_data``)."""
    if not blend:  # --mock-data: nothing known beyond lengths
        return np.full(len(dataset), None, dtype=object), np.full(len(dataset), np.nan)
    if len(blend) == 1:
        return _read_sidecars(blend[0][1], len(dataset), False)
    which, index = dataset.components
    src = np.empty(len(dataset), dtype=object)
    comp = np.empty(len(dataset))
    for i, (_, prefix) in enumerate(blend):
        rows = np.flatnonzero(which == i)
        n = len(dataset.datasets[i])
        s, c = _read_sidecars(prefix, n, True)
        src[rows], comp[rows] = s[index[rows]], c[index[rows]]
    return src, comp


def segment_pairs(packing, dp_rank: int, records, density=None) -> Tuple[np.ndarray, np.ndarray]:
    """This rank's kept and causal pairs of every segment of the step, ``[S]`` each in the
    packing's order (rank, micro-batch, segment); zero for the other ranks' segments.

    Records of dense layers (``topk`` None) are left out: only routed layers say anything
    about a document's density. A record without per-document kept pairs (context
    parallelism) is shared among its segments in proportion to ``density``'s predicted
    kept pairs (the causal pairs without one), a trailing padding segment taking its share
    at their mean density; the padding segment itself is not reported. A record routed at a
    DST TAU level (``tau``) has its pairs moved to the run's TAU first
    (:meth:`~sparsebalance.batching.density_feedback.ThresholdDensity.at_tau0`): the estimator
    learns densities at one TAU.
    """
    sizes = [len(mb) for rank in packing.ranks for mb in rank]
    M = len(packing.ranks[0])
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    kept, causal = np.zeros(first[-1]), np.zeros(first[-1])
    for r in records:
        if r.topk is None or r.microbatch is None:
            continue
        mb = packing.ranks[dp_rank][r.microbatch]
        n = len(mb)
        L = np.array([s[2] for s in mb], dtype=np.int64)
        docs = np.asarray(r.doc_lengths, dtype=np.float64)
        if docs.size < n or not np.array_equal(docs[:n], L):
            raise ValueError(f"attention record of micro-batch {r.microbatch} holds documents "
                             f"{list(r.doc_lengths)[:4]}..., the packing {L[:4].tolist()}...")
        all_causal = docs * (docs + 1) / 2
        heads = r.causal_pairs / all_causal.sum()
        c = all_causal[:n] * heads
        tau = getattr(r, "tau", None)
        if r.doc_kept_pairs:
            k = np.asarray(r.doc_kept_pairs[:n], dtype=np.float64)
        else:
            share = c if density is None else density.kept(L, r.topk, [s[0] for s in mb], tau) * heads
            # a padding segment is taken at the real segments' mean density
            pad = all_causal[n:].sum() * heads * float(np.sum(share)) / max(float(c.sum()), 1e-30)
            k = r.kept_pairs * share / max(float(np.sum(share)) + pad, 1e-30)
        if density is not None and tau is not None:
            k = np.minimum(density.at_tau0(k, L, tau), c)
        at = first[dp_rank * M + r.microbatch]
        kept[at:at + n] += k
        causal[at:at + n] += c
    return kept, causal


def feedback(density, packing, dp_rank: int, records) -> None:
    """All-reduce the step's per-segment pairs over every rank and queue them in ``density``
    (:meth:`~sparsebalance.batching.density_feedback.ThresholdDensity.observe`)."""
    import torch

    from megatron.training.step_metrics import comm_device

    kept, causal = segment_pairs(packing, dp_rank, records, density)
    t = torch.from_numpy(np.stack([kept, causal])).to(comm_device())
    torch.distributed.all_reduce(t)
    kept, causal = t.cpu().numpy()
    seg = [(s[0], s[2]) for rank in packing.ranks for mb in rank for s in mb]
    arr = np.array(seg, dtype=np.int64).reshape(len(seg), 2)
    density.observe(packing.step, arr[:, 0], arr[:, 1], np.minimum(kept, causal), causal)


def threshold_density(config, blend, dataset, doc_ids: np.ndarray) -> Optional[object]:
    """The :class:`~sparsebalance.batching.density_feedback.ThresholdDensity` of a run whose
    ``config`` (``SparseBalanceConfig``) routes by threshold, over the split ``doc_ids``;
    None under top-k routing or dense attention. It learns at ``--sb-threshold`` and moves
    densities to DST's TAU levels along ``--sb-dst-tau-study``'s relation (default the one
    measured on SmolLM2-135M, ``sparsebalance.batching.tau_curve.MEASURED``)."""
    att = config.attention
    if not att.sparse or att.threshold is None:
        return None
    from sparsebalance.batching.density_feedback import ThresholdDensity
    from sparsebalance.batching.tau_curve import TauCurve

    curve = None
    if config.dst.tau_study is not None:
        curve = TauCurve.from_study(config.dst.tau_study, "per_head" if att.per_head else "per_block")
    src, comp = document_features(blend, dataset)
    return ThresholdDensity(block_size=att.block_size, topk_min=att.topk_min, sources=src[doc_ids],
                            compression=comp[doc_ids], tau0=att.threshold, curve=curve)


def sensitivity_weights(config, blend, dataset, doc_ids: np.ndarray):
    """DST's :class:`~sparsebalance.balancer.SensitivityWeights` over the split ``doc_ids``
    (``--sb-dst-sensitivity estimate``): the estimator fitted on ``config.dst.sensitivity_study``,
    each document read by its source and compression sidecars."""
    from sparsebalance.balancer import SensitivityWeights

    path = config.dst.sensitivity_study
    try:
        with open(path) as f:
            study = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--sb-sensitivity-study {path}: cannot read it ({e})") from None
    src, comp = document_features(blend, dataset)
    return SensitivityWeights.from_study(study, sources=src[doc_ids], compression=comp[doc_ids])
