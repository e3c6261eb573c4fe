"""SAB's per-document densities under threshold routing: predicted before packing, learnt online.

With ``--sb-routing threshold`` a document's kept (query, key) pairs follow its content,
so SAB's cost model (:class:`sparsebalance.batching.cost.CostModel`) cannot count them from
the length (``sparsebalance.pairs.kept_pairs``) as it does for top-k routing.
:class:`ThresholdDensity` is the cost model's ``density`` hook for that case: each item's
kept pairs are ``sparsebalance.pairs.threshold_kept_pairs`` of the density the
:class:`~sparsebalance.batching.sparsity_estimator.SparsityEstimator` predicts from the
document's source tag, length bucket and text compression ratio (what is known before
the step: the dataset's sidecars), and the hook returns their ratio to the top-k count.

Online updates: after a step, every rank hands :meth:`ThresholdDensity.observe` the same
per-segment kept and causal pairs (the driver all-reduces what its attention modules
recorded), tagged with the step's index. Observations of step ``s`` are folded in only
when step ``s + lag`` is packed (:meth:`advance`, called by the sampler; ``lag`` 2): the
packing of step ``t`` is then a function of (seed, observations of steps ``< t - 1``)
whether the driver packs step ``t`` before step ``t - 1`` has run (planning ahead) or
after, so every rank and every resume packs alike. :meth:`state_dict` holds the
estimator's sums and the queued observations; the checkpoint saves it live with the
sampler's state (``sparsebalance.balancer.StepPlanner.state_dict``).

DST's TAU levels (``--sb-dst`` under threshold routing): the estimator learns densities at
the run's TAU (``tau0``); :meth:`ThresholdDensity.densities` with ``tau`` moves them to another
TAU along the measured :class:`~sparsebalance.batching.tau_curve.TauCurve`, and
:meth:`ThresholdDensity.at_tau0` moves pairs measured at a planned TAU back before they are
observed, so the estimator keeps learning one quantity.

Cost: one vectorised prediction per packing call (grouped by (source, bucket)) and one
grouped update per step; ``seconds`` accumulates the time spent in this object.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from sparsebalance.batching.sparsity_estimator import SourceCodes, SparsityEstimator
from sparsebalance.batching.tau_curve import MEASURED, TauCurve
from sparsebalance.pairs import causal_pairs, kept_pairs, threshold_kept_pairs


class ThresholdDensity:
    """Predicted per-item kept pairs for the packers under threshold routing.

    Args:
        estimator: the density model (default a fresh :class:`SparsityEstimator`, prior 1.0:
            dense until something is measured).
        block_size: routing block, tokens.
        topk_min: threshold routing's floor of chosen blocks (``--sb-topk-min``).
        sources: [N] source tag of each document (document id = index; None: untagged).
        compression: [N] compression ratio of each document's text (NaN: unknown; None: none).
        lag: observations of step ``s`` are used from the packing of step ``s + lag`` on
            (module docstring; >= 1).
        tau0: the run's TAU, at which the estimator learns (None: densities at other TAUs
            are not asked for).
        curve: density as a function of TAU (default :data:`~sparsebalance.batching.tau_curve.MEASURED`).
    """

    def __init__(self, estimator: Optional[SparsityEstimator] = None, *, block_size: int,
                 topk_min: int = 0, sources: Optional[Sequence] = None,
                 compression: Optional[Sequence[float]] = None, lag: int = 2,
                 tau0: Optional[float] = None, curve: Optional[TauCurve] = None) -> None:
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        if int(lag) < 1:
            raise ValueError(f"lag must be >= 1, got {lag!r}")
        self.estimator = estimator if estimator is not None else SparsityEstimator()
        self.block_size, self.topk_min, self.lag = int(block_size), int(topk_min), int(lag)
        # encoded once: every prediction indexes the codes instead of sorting names
        self.sources = None if sources is None else SourceCodes.encode(sources)
        self.compression = None if compression is None else np.asarray(compression, dtype=np.float64)
        if self.sources is not None and self.compression is not None \
                and len(self.sources) != self.compression.size:
            raise ValueError(f"{len(self.sources)} sources but {self.compression.size} compression ratios")
        if tau0 is not None and not 0.0 < float(tau0) <= 1.0:
            raise ValueError(f"tau0 must be in (0, 1], got {tau0!r}")
        self.tau0 = None if tau0 is None else float(tau0)
        self.curve = MEASURED if curve is None else curve
        self._queue: list = []  # [step, doc ids, lengths, kept, causal] not yet folded in
        self.seconds = 0.0
        """CPU time this thread spent predicting and learning so far (s)."""

    # -- features -------------------------------------------------------------------------
    def _features(self, doc_ids, n: int):
        if doc_ids is None:
            return np.full(n, None, dtype=object), None
        d = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        src = self.sources[d] if self.sources is not None else np.full(n, None, dtype=object)
        comp = self.compression[d] if self.compression is not None else None
        return src, comp

    def densities(self, lengths, doc_ids=None, tau: Optional[float] = None) -> np.ndarray:
        """[n] predicted density (kept / causal pairs) of each item (a chunk of a document
        counts as a document of its own length, with the document's tags) at the run's TAU, or
        at ``tau`` (moved along :attr:`curve`; needs ``tau0``)."""
        t0 = time.thread_time()
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        src, comp = self._features(doc_ids, L.size)
        out = self.estimator.predict_many(src, L, comp)
        if tau is not None and float(tau) != self.tau0:
            out = self.curve.scale(out, L, self._tau0(), tau)
        self.seconds += time.thread_time() - t0
        return out

    def _tau0(self) -> float:
        if self.tau0 is None:
            raise ValueError("densities at another TAU need the run's TAU (ThresholdDensity(tau0=...))")
        return self.tau0

    def at_tau0(self, kept, lengths, tau: Optional[float]) -> np.ndarray:
        """[n] pairs ``kept`` by items of ``lengths`` routed at ``tau`` (a DST level), moved to
        the run's TAU along :attr:`curve` (the quantity the estimator learns); as they are when
        ``tau`` is None or the run's."""
        k = np.asarray(kept, dtype=np.float64).reshape(-1)
        if tau is None or float(tau) == self.tau0:
            return k.copy()
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        lr = self.curve.log_ratio(self._tau0(), L) - self.curve.log_ratio(tau, L)
        return k * np.exp(lr)

    def kept(self, lengths, topk: Optional[int], doc_ids=None, tau: Optional[float] = None) -> np.ndarray:
        """[n] predicted kept pairs per head of each item at cap ``topk`` (None: dense), at the
        run's TAU or at ``tau``."""
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if topk is None:
            return causal_pairs(L).astype(np.float64)
        return threshold_kept_pairs(L, self.densities(L, doc_ids, tau), topk, self.block_size, self.topk_min)

    def ratio(self, lengths, topk: Optional[int], doc_ids=None) -> np.ndarray:
        """[n] predicted kept pairs over top-k's (``CostModel``'s density hook); 1 for dense."""
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if topk is None:
            return np.ones(L.size)
        model = kept_pairs(L, topk, self.block_size).astype(np.float64)
        return np.where(model > 0, self.kept(L, topk, doc_ids) / np.maximum(model, 1.0), 1.0)

    # -- online learning ----------------------------------------------------------------------
    def observe(self, step: int, doc_ids, lengths, kept, causal) -> None:
        """Queue what step ``step`` measured: per segment its document id, length (tokens),
        and kept / causal pairs (summed over heads and layers alike; segments with no
        causal pairs are dropped). Identical on every rank (the caller all-reduces)."""
        d = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        k = np.asarray(kept, dtype=np.float64).reshape(-1)
        c = np.asarray(causal, dtype=np.float64).reshape(-1)
        if not d.size == L.size == k.size == c.size:
            raise ValueError(f"observe: {d.size} ids, {L.size} lengths, {k.size} kept, {c.size} causal")
        ok = c > 0
        if (k[ok] < 0).any() or (k[ok] > c[ok] * (1 + 1e-9)).any():
            raise ValueError("observe: kept pairs must be in [0, causal]")
        self._queue.append([int(step), d[ok].tolist(), L[ok].tolist(), k[ok].tolist(), c[ok].tolist()])

    def advance(self, step: int) -> None:
        """Fold in the queued observations of steps ``<= step - lag`` (called before packing
        step ``step``)."""
        t0 = time.thread_time()
        keep = []
        for entry in self._queue:
            if entry[0] > step - self.lag:
                keep.append(entry)
                continue
            _, d, L, k, c = entry
            if not d:
                continue
            src, comp = self._features(d, len(d))
            dens = np.minimum(np.asarray(k) / np.asarray(c), 1.0)
            self.estimator.update_many(src, L, dens, None, comp)
        self._queue = keep
        self.seconds += time.thread_time() - t0

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain-Python state: the estimator's and the observations not folded in yet."""
        return {"version": 1, "lag": self.lag, "estimator": self.estimator.state_dict(),
                "queue": [list(e) for e in self._queue]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ValueError if malformed or saved with another lag."""
        try:
            if int(state["lag"]) != self.lag:
                raise ValueError(f"saved with lag {state['lag']}, this run has {self.lag}")
            self.estimator.load_state_dict(state["estimator"])
            self._queue = [[int(s), list(d), list(L), list(k), list(c)] for s, d, L, k, c in state["queue"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed density state ({e!r})") from None
