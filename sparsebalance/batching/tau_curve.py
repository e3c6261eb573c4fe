"""A document's threshold-routing density as a function of TAU: the relation DST's TAU levels
are priced with.

SAB's estimator (:class:`~sparsebalance.batching.density_feedback.ThresholdDensity`) learns
each document's density at the run's TAU (``TAU0``: the attention records measure it there).
DST's TAU levels need the density at other TAUs too. :class:`TauCurve` moves a density from one
TAU to another with a relation measured on real documents: per measured TAU ``t_j`` the mean log
ratio ``log(d(t_j) / d(t_ref))`` of a document of length ``L`` is ``a_j + b_j log2 L`` (least
squares over the study's documents; ``b_j`` is 0 when they all have one length), and between
the measured TAUs the log ratio is linear in ``x = -log(1 - TAU)`` (the log of the inverse tail
mass), extended past the first and last measured TAU with its end slopes. Increments between
consecutive measured TAUs below 0 are taken as 0, so the density never falls as TAU rises.

Where the numbers come from: :data:`MEASURED` is :meth:`TauCurve.from_study` on
``results/real_study.json`` (SmolLM2-135M, 50 documents of 10 sources at 2K, 4K and 8K
tokens, per-head counts at TAU 0.8, 0.9 and 0.95, block 64; ``benchmarks/sparsity_study.py
--real``); ``tests/batching/test_tau_curve.py`` refits it from that file. Per document it
leaves 1.7% (0.8) and 2.0% (0.95) rms error in the log ratio; on the 20 documents measured
again at TAU 0.97 (``results/real_study_perhead_tau097.json``, outside the fit's range) it
over-predicts by 3.9% on average (10% at most). At lengths beyond the study's the length term
is extrapolated, as the simulation's length trend of the density is
(``benchmarks/harness/compare/density_study.py``); a different model or routing block needs
its own study (``--sb-dst-tau-study``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence, Tuple

import numpy as np


def tail_x(tau) -> np.ndarray:
    """``-log(1 - TAU)``, the curve's coordinate (``inf`` at TAU 1)."""
    t = np.asarray(tau, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return -np.log1p(-np.minimum(t, 1.0))


@dataclass(frozen=True)
class TauCurve:
    """``log(d(TAU) / d(ref))`` of a document as a function of TAU and its length (module
    docstring)."""

    ref: float
    """The TAU the ratios are taken against (a measured one)."""
    taus: Tuple[float, ...]
    """Measured TAUs, sorted, ``ref`` among them."""
    intercept: Tuple[float, ...]
    """Per measured TAU, ``a_j`` (0 at ``ref``)."""
    slope: Tuple[float, ...]
    """Per measured TAU, ``b_j`` per doubling of the length (0 at ``ref``)."""
    origin: str = ""
    """Where the fit came from (a study path and its documents)."""

    def __post_init__(self) -> None:
        t = np.asarray(self.taus, dtype=np.float64)
        if t.size < 2 or np.any(np.diff(t) <= 0) or t[0] <= 0 or t[-1] >= 1:
            raise ValueError(f"tau curve: needs two or more sorted TAUs in (0, 1), got {list(self.taus)}")
        if self.ref not in self.taus:
            raise ValueError(f"tau curve: the reference TAU {self.ref} is not a measured one {list(self.taus)}")
        if not len(self.intercept) == len(self.slope) == t.size:
            raise ValueError("tau curve: one intercept and one slope per measured TAU")
        if not np.all(np.isfinite(self.intercept)) or not np.all(np.isfinite(self.slope)):
            raise ValueError("tau curve: intercepts and slopes must be finite")

    def log_ratio(self, tau: float, lengths) -> np.ndarray:
        """``[n]`` ``log(d(tau) / d(ref))`` of documents of ``lengths`` tokens (``+inf`` at TAU 1:
        every candidate kept)."""
        tau = float(tau)
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"TAU must be in (0, 1], got {tau}")
        lg = np.log2(np.maximum(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0))
        if tau >= 1.0:
            return np.full(lg.size, np.inf)
        v = np.asarray(self.intercept)[:, None] + np.asarray(self.slope)[:, None] * lg[None, :]  # [J, n]
        r = self.taus.index(self.ref)
        # monotone in TAU: increments below 0 count as 0, anchored at the reference
        inc = np.maximum(np.diff(v, axis=0), 0.0)
        v = np.concatenate([np.zeros((1, lg.size)), np.cumsum(inc, axis=0)])
        v -= v[r]
        x = tail_x(self.taus)
        xt = float(tail_x(tau))
        j = int(np.clip(np.searchsorted(x, xt) - 1, 0, x.size - 2))  # segment (or end segment)
        w = (xt - x[j]) / (x[j + 1] - x[j])
        return v[j] + w * (v[j + 1] - v[j])

    def scale(self, densities, lengths, tau_from: float, tau_to: float) -> np.ndarray:
        """``[n]`` densities measured (or predicted) at ``tau_from`` moved to ``tau_to``,
        within ``(0, 1]``."""
        d = np.asarray(densities, dtype=np.float64).reshape(-1)
        if float(tau_from) == float(tau_to):
            return d.copy()
        lr = self.log_ratio(tau_to, lengths) - self.log_ratio(tau_from, lengths)
        with np.errstate(over="ignore"):
            return np.minimum(d * np.exp(lr), 1.0)

    # -- fitting ---------------------------------------------------------------------------
    @classmethod
    def fit(cls, lengths, taus: Sequence[float], densities, ref: float, origin: str = "") -> "TauCurve":
        """Fit on ``densities [n, len(taus)]`` (NaN: not measured) of documents of ``lengths``:
        per TAU the least-squares ``a_j + b_j log2 L`` of the log ratio to ``ref`` over the
        documents measured at both (``b_j`` 0 when they have one length)."""
        t = [float(x) for x in taus]
        D = np.asarray(densities, dtype=np.float64)
        lg = np.log2(np.maximum(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0))
        if D.shape != (lg.size, len(t)):
            raise ValueError(f"tau curve: densities must be [documents, TAUs] = {(lg.size, len(t))}, "
                             f"got {D.shape}")
        if float(ref) not in t:
            raise ValueError(f"tau curve: the reference TAU {ref} was not measured ({t})")
        order = np.argsort(t)
        t, D = [t[i] for i in order], D[:, order]
        r = t.index(float(ref))
        a, b = [], []
        for j in range(len(t)):
            ok = np.isfinite(D[:, j]) & np.isfinite(D[:, r]) & (D[:, j] > 0) & (D[:, r] > 0)
            if j == r:
                a.append(0.0)
                b.append(0.0)
                continue
            if not ok.any():
                raise ValueError(f"tau curve: no document measured at both TAU {t[j]} and {ref}")
            y, x = np.log(D[ok, j] / D[ok, r]), lg[ok]
            if np.ptp(x) > 0:
                bj, aj = np.polyfit(x, y, 1)
            else:
                bj, aj = 0.0, float(y.mean())
            a.append(float(aj))
            b.append(float(bj))
        return cls(ref=float(ref), taus=tuple(t), intercept=tuple(a), slope=tuple(b), origin=origin)

    @classmethod
    def from_documents(cls, documents: Sequence[Mapping], ref: float, counts: str = "per_head",
                       origin: str = "") -> "TauCurve":
        """Fit on a sparsity study's ``documents`` (``benchmarks/sparsity_study.py --real``): each
        with ``length`` and ``densities`` ``{"TAU": {"per_head": d, "per_block": d} or d}``."""
        if counts not in ("per_head", "per_block"):
            raise ValueError(f"counts must be per_head or per_block, got {counts!r}")
        taus = sorted({float(k) for d in documents for k in (d.get("densities") or {})})
        if len(taus) < 2:
            raise ValueError("tau curve: the study's documents are measured at fewer than two TAUs "
                             "(run benchmarks/sparsity_study.py --real with several --taus)")
        D = np.full((len(documents), len(taus)), np.nan)
        for i, d in enumerate(documents):
            for k, v in (d.get("densities") or {}).items():
                D[i, taus.index(float(k))] = float(v[counts] if isinstance(v, Mapping) else v)
        return cls.fit([int(d["length"]) for d in documents], taus, D, ref, origin)

    @classmethod
    def from_study(cls, path: str, counts: str = "per_head") -> "TauCurve":
        """Fit on the study JSON at ``path`` (its ``tau`` is the reference). ValueError (one line)
        if it cannot be read or measures fewer than two TAUs."""
        try:
            with open(path) as fh:
                study = json.load(fh)
            docs, ref = study["documents"], float(study["tau"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a sparsity study with 'tau' and 'documents' ({e})".splitlines()[0]) \
                from None
        return cls.from_documents(docs, ref, counts, origin=f"{path} ({len(docs)} documents, {counts})")

    def as_dict(self) -> dict:
        """Plain JSON form."""
        return {"ref": self.ref, "taus": list(self.taus), "intercept": list(self.intercept),
                "slope": list(self.slope), "origin": self.origin}


MEASURED = TauCurve(
    ref=0.9, taus=(0.8, 0.9, 0.95),
    intercept=(0.41058703493508, 0.0, -0.36867700320100),
    slope=(-0.06263282738491, 0.0, 0.05074886745419),
    origin="results/real_study.json (50 documents, per_head)")
"""The relation measured on SmolLM2-135M (module docstring; per-head counts)."""
