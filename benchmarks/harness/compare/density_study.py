"""Per-document densities for the simulation under threshold routing, from a sparsity study.

``benchmarks/compare.py --mode sim --routing threshold --density-study STUDY.json``: the
study's ``documents`` (``benchmarks/sparsity_study.py --output``; each with ``source``,
``length`` in tokens, ``density`` = kept / causal pairs under threshold routing with
per-head counts, and where measured ``compression_ratio``) give the simulated documents
their content. The simulated lengths still come from the shared length files (the
study's documents are 1K-8K tokens; the cells' documents reach 256K), so:

1. The study's documents are split in two by a seeded permutation: the *fit* half stands
   for what earlier steps of the run measured (it only warms SAB's estimator, through
   simulated documents of the cell's own length distribution drawn from it, see 3), the
   *draw* half gives the documents whose times are simulated. No simulated document
   carries a density its estimator has seen.
2. A simulated document of length ``L`` takes the (source, density, compression ratio) of
   a study document drawn uniformly (seeded) from its log2 length bucket in the half it
   draws from, the nearest populated bucket when its own has none (lengths beyond the
   study's range), and its density is moved along the study's length trend:
   ``density x (L / L_study) ^ b``, ``b`` the least-squares slope of log density on log
   length over all study documents (0 when the study has one length only). Threshold
   routing's cap and floor then bound its kept pairs (``sparsebalance.pairs.
   threshold_kept_pairs``, cap = the budget). ``b`` is reported: at long contexts the
   result leans on this extrapolation.
3. SAB's estimator starts warm: before the cell's first step it has seen ``warm_steps``
   steps' worth of documents (lengths drawn from the cell's length stream with another
   seed, content from the fit half by rule 2), as a run would have after its first
   steps; then it learns online from every simulated step (lag 2, as in training).
4. ``mode="bucket-mean"``: every study document's density is first replaced by the mean
   of its length bucket (all sources), so density follows length alone; the same cells
   then show what sparsity-awareness itself buys.
5. Other TAUs (DST's TAU levels, ``sparsebalance.batching.tau_curve``). A study whose documents
   carry ``densities`` at several TAUs (``results/real_study.json``: 0.8, 0.9, 0.95) gives each
   simulated document its study document's own measured curve: the log ratio to the study's TAU,
   linear in ``-log(1 - TAU)`` between the measured TAUs and extended with the end slopes, moved
   to the simulated length by the length term of a :class:`TauCurve` fitted on every study
   document (the same least squares as ``b``, per TAU). The planner does not see this truth: SAB's
   estimator predicts the density at the study's TAU and moves it with a :class:`TauCurve`
   fitted on the fit half only (:meth:`CellContent.estimator`). A study measured at one TAU only
   (the synthetic one) takes :data:`~sparsebalance.batching.tau_curve.MEASURED` for both, so
   there the planner's relation is exact by construction.

:func:`synthetic_study` is the stand-in used until a real study exists (its docstring
says what it assumes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sparsebalance.batching.sparsity_estimator import length_bucket
from sparsebalance.batching.tau_curve import MEASURED, TauCurve

MODES = ("measured", "bucket-mean")
"""``--density-mode`` choices (module docstring, rule 4)."""


def load_study(path: str) -> dict:
    """The study JSON's ``documents`` checked against the contract; ValueError naming the
    first bad entry."""
    with open(path) as fh:
        study = json.load(fh)
    docs = study.get("documents") if isinstance(study, dict) else None
    if not isinstance(docs, list) or len(docs) < 4:
        raise ValueError(f"{path}: needs a 'documents' list of at least 4 documents")
    for i, d in enumerate(docs):
        ok = (isinstance(d, dict) and isinstance(d.get("source"), str)
              and isinstance(d.get("length"), int) and d["length"] >= 1
              and isinstance(d.get("density"), (int, float)) and 0 < d["density"] <= 1)
        c = d.get("compression_ratio") if isinstance(d, dict) else None
        if not ok or (c is not None and not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0)):
            raise ValueError(f"{path}: documents[{i}] needs source (str), length (int >= 1), density "
                             f"in (0, 1] and optionally compression_ratio > 0, got {d!r}"[:300])
    return study


@dataclass(frozen=True)
class StudyDocs:
    """The study's documents as arrays (one row per document)."""

    source: np.ndarray
    length: np.ndarray
    density: np.ndarray
    compression: np.ndarray
    """NaN where the study has no ratio."""
    tau0: float = 0.9
    """The study's TAU (what ``density`` was measured at)."""
    taus: tuple = ()
    """TAUs the documents' ``densities`` were measured at (empty: the study's TAU only)."""
    at_taus: Optional[np.ndarray] = None
    """[n, len(taus)] per-head densities at ``taus`` (NaN: not measured); None without."""

    @classmethod
    def of(cls, study: dict, mode: str = "measured") -> "StudyDocs":
        if mode not in MODES:
            raise ValueError(f"density mode must be one of {MODES}, got {mode!r}")
        docs = study["documents"]
        tau0 = float(study.get("tau", 0.9))
        taus = tuple(sorted({float(k) for d in docs for k in (d.get("densities") or {})} | {tau0}))
        at = None
        if len(taus) > 1:
            at = np.full((len(docs), len(taus)), np.nan)
            for i, d in enumerate(docs):
                for k, v in (d.get("densities") or {}).items():
                    at[i, taus.index(float(k))] = float(v["per_head"] if isinstance(v, dict) else v)
                at[i, taus.index(tau0)] = float(d["density"])
        out = cls(source=np.array([d["source"] for d in docs], dtype=object),
                  length=np.array([d["length"] for d in docs], dtype=np.int64),
                  density=np.array([d["density"] for d in docs], dtype=np.float64),
                  compression=np.array([np.nan if d.get("compression_ratio") is None
                                        else d["compression_ratio"] for d in docs], dtype=np.float64),
                  tau0=tau0, taus=taus if at is not None else (), at_taus=at)
        if mode == "bucket-mean":
            b = np.array([length_bucket(x) for x in out.length])
            mean = {k: out.density[b == k].mean() for k in np.unique(b)}
            if at is not None:  # the curves too: a bucket's mean log ratio
                lr = np.log(at / at[:, [taus.index(tau0)]])
                lr = np.stack([np.nanmean(lr[b == k], axis=0) for k in b])
                at = np.array([mean[k] for k in b])[:, None] * np.exp(lr)
            out = cls(out.source, out.length, np.array([mean[k] for k in b]), out.compression, tau0, out.taus, at)
        return out

    def take(self, idx: np.ndarray) -> "StudyDocs":
        return StudyDocs(self.source[idx], self.length[idx], self.density[idx], self.compression[idx], self.tau0,
                         self.taus, None if self.at_taus is None else self.at_taus[idx])

    def tau_curve(self) -> TauCurve:
        """The pooled density-vs-TAU relation of these documents (rule 5);
        :data:`MEASURED` for a study measured at one TAU."""
        if self.at_taus is None:
            return MEASURED
        return TauCurve.fit(self.length, self.taus, self.at_taus, self.tau0,
                            origin=f"{self.length.size} study documents")

    def own_curves(self) -> Optional[list]:
        """Per document its own measured relation (a :class:`TauCurve` of that document alone, None
        for one measured at the study's TAU only); None for a study measured at one TAU."""
        if self.at_taus is None:
            return None
        out = []
        for i in range(self.length.size):  # a document measured at the study's TAU only: the pooled one
            ok = np.isfinite(self.at_taus[i])
            out.append(TauCurve.fit(self.length[i:i + 1], np.asarray(self.taus)[ok], self.at_taus[i:i + 1, ok],
                                    self.tau0) if ok.sum() > 1 else None)
        return out

    def length_exponent(self) -> float:
        """Least-squares slope of log density on log length (0 for a single length)."""
        x, y = np.log(self.length.astype(np.float64)), np.log(self.density)
        if np.ptp(x) == 0:
            return 0.0
        return float(np.polyfit(x, y, 1)[0])


@dataclass
class Assigned:
    """Content of a stream of simulated documents (one row per document): the study document
    each one drew (its source, density, length and compression ratio) and the length trend."""

    source: np.ndarray
    base_density: np.ndarray
    base_length: np.ndarray
    compression: np.ndarray
    exponent: float
    tau0: float = 0.9
    """The study's TAU (``base_density``'s)."""
    study_doc: Optional[np.ndarray] = None
    """Per document, the pool document it drew (index into ``curves``)."""
    curves: Optional[list] = None
    """Per pool document its own measured relation to TAU (rule 5; None for one measured at the
    study's TAU only); None: ``length_curve`` alone."""
    length_curve: TauCurve = MEASURED
    """The pooled relation (rule 5): its length term moves ``curves`` to the document's length
    (or, without ``curves``, the whole relation)."""

    def density_at(self, docs, lengths, tau: Optional[float] = None) -> np.ndarray:
        """Density of segments of ``lengths`` tokens of documents ``docs`` (a document, or a
        chunk of one that attends within itself): the drawn density moved along the trend, at the
        study's TAU or at ``tau`` (rule 5)."""
        d = np.asarray(docs, dtype=np.int64)
        n = np.asarray(lengths, dtype=np.float64)
        base = np.clip(self.base_density[d] * (n / self.base_length[d]) ** self.exponent, 1e-6, 1.0)
        if tau is None or float(tau) == self.tau0:
            return base
        lr = self.length_curve.log_ratio(tau, n) - self.length_curve.log_ratio(self.tau0, n)
        if self.curves is not None:  # the drawn document's own curve, moved to this length
            own = self.base_length[d]
            lr = lr - (self.length_curve.log_ratio(tau, own) - self.length_curve.log_ratio(self.tau0, own))
            s = self.study_doc[d]
            for j in np.unique(s).tolist():
                at = s == j
                c = self.curves[j] or self.length_curve
                lr[at] += c.log_ratio(tau, own[at]) - c.log_ratio(self.tau0, own[at])
        return np.clip(base * np.exp(lr), 1e-6, 1.0)


def assign(lengths: np.ndarray, pool: StudyDocs, exponent: float, seed: int,
           length_curve: Optional[TauCurve] = None) -> Assigned:
    """Rules 2 and 5 of the module docstring for documents of ``lengths`` drawing from ``pool``
    (``length_curve``: rule 5's pooled relation, default the pool's own)."""
    L = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    pb = np.array([length_bucket(x) for x in pool.length])
    have = np.unique(pb)
    want = np.floor(np.log2(np.maximum(L, 1)) + 1e-9).astype(np.int64)
    nearest = have[np.abs(want[:, None] - have[None, :]).argmin(axis=1)]
    pick = np.empty(L.size, dtype=np.int64)
    for b in have.tolist():
        rows = np.flatnonzero(nearest == b)
        members = np.flatnonzero(pb == b)
        pick[rows] = members[rng.integers(0, members.size, rows.size)]
    return Assigned(source=pool.source[pick], base_density=pool.density[pick],
                    base_length=pool.length[pick], compression=pool.compression[pick], exponent=exponent,
                    tau0=pool.tau0, study_doc=pick, curves=pool.own_curves(),
                    length_curve=pool.tau_curve() if length_curve is None else length_curve)


@dataclass
class CellContent:
    """What one simulated cell needs: the documents' content and the warm-up stream."""

    docs: Assigned
    """Content of the simulated stream (draw half)."""
    warm_lengths: np.ndarray
    """Warm-up documents' lengths (tokens)."""
    warm: Assigned
    """Warm-up documents' content (fit half)."""
    exponent: float
    """The length trend ``b`` (rule 2)."""
    tau_curve: TauCurve = MEASURED
    """The relation to TAU the planner prices DST's TAU levels with: fitted on the fit half
    (rule 5)."""

    def estimator(self, block_size: int, topk_min: int, item_length: int):
        """A :class:`~sparsebalance.batching.density_feedback.ThresholdDensity` over the
        simulated stream's documents that has seen the warm-up documents (chunked at
        ``item_length`` tokens as the sampler chunks them), at the study's TAU, moving its
        densities to other TAUs by :attr:`tau_curve`."""
        from sparsebalance.batching.density_feedback import ThresholdDensity

        td = ThresholdDensity(block_size=block_size, topk_min=topk_min, sources=self.docs.source,
                              compression=self.docs.compression, tau0=self.docs.tau0, curve=self.tau_curve)
        doc = np.repeat(np.arange(self.warm_lengths.size), -(-self.warm_lengths // item_length))
        first = np.concatenate([[0], np.cumsum(-(-self.warm_lengths // item_length))[:-1]])
        off = (np.arange(doc.size) - first[doc]) * item_length
        seg = np.minimum(self.warm_lengths[doc] - off, item_length)
        td.estimator.update_many(self.warm.source[doc], seg, self.warm.density_at(doc, seg), None,
                                 self.warm.compression[doc])
        return td


def cell_content(study: dict, mode: str, lengths: np.ndarray, warm_tokens: int, seed: int) -> CellContent:
    """Rules 1-4 for one cell's length stream ``lengths`` (``warm_tokens``: tokens of
    warm-up documents)."""
    docs = StudyDocs.of(study, mode)
    exponent = docs.length_exponent()
    perm = np.random.default_rng(seed + 7919).permutation(docs.length.size)
    fit, draw = docs.take(perm[: perm.size // 2]), docs.take(perm[perm.size // 2:])
    rng = np.random.default_rng(seed + 104729)
    L = np.asarray(lengths, dtype=np.int64)
    warm_L: list = []
    while sum(warm_L) < warm_tokens:
        warm_L.extend(rng.permutation(L)[: 4096].tolist())
    warm = np.array(warm_L, dtype=np.int64)
    pooled = docs.tau_curve()
    return CellContent(docs=assign(L, draw, exponent, seed, pooled), warm_lengths=warm,
                       warm=assign(warm, fit, exponent, seed + 1, pooled), exponent=exponent,
                       tau_curve=fit.tau_curve())


# Stand-in for the real study (module docstring of synthetic_study).
_SOURCES = {  # source: (density at 4K tokens, mean zlib ratio, sd of the ratio)
    "pydoc": (0.20, 0.33, 0.03), "prose": (0.23, 0.38, 0.03), "retrieval": (0.24, 0.12, 0.03),
    "code": (0.25, 0.28, 0.03), "csv": (0.26, 0.30, 0.03), "repeated": (0.28, 0.03, 0.01)}


def synthetic_study(n: int = 240, seed: int = 0, rho: float = 0.5, cv_equal_length: float = 0.13,
                    exponent: float = -0.35, lengths: Optional[np.ndarray] = None) -> dict:
    """A study-shaped stand-in (``documents`` of source, length, density, compression_ratio).

    What is taken from measurements (issue 49, SmolLM2-135M at 4K, TAU 0.9, per-head
    counts): per-source mean density from 0.20 (pydoc) to 0.28 (repeated passage), and a
    CV of density at equal length of about 0.13. The rest is assumed: the intermediate
    sources' means (0.23-0.26, inside that range), density falling with length as
    ``(L / 4096) ^ exponent`` (-0.35), lengths log-uniform over 1K-8K (or ``lengths``),
    sources uniform, zlib ratios per source (repeated text compresses to ~3%, prose to
    ~38%) with a within-source SD of 0.03, and a within-source log-normal density
    factor whose SD makes the overall CV at equal length ``cv_equal_length``, correlated
    ``rho`` with the document's standardised compression deviation (``rho = 0``: the
    ratio carries nothing beyond the source). The estimator's gain over length-only comes
    from the source spread (measured) and from ``rho`` (assumed), nothing else.
    """
    rng = np.random.default_rng(seed)
    names = sorted(_SOURCES)
    base = np.array([_SOURCES[s][0] for s in names])
    between = base.std() / base.mean()
    within = math.sqrt(max(cv_equal_length ** 2 - between ** 2, 0.0))
    L = (np.exp(rng.uniform(math.log(1024), math.log(8192), n)).astype(np.int64)
         if lengths is None else np.asarray(lengths, dtype=np.int64))
    src = rng.integers(0, len(names), L.size)
    z_c, z_e = rng.standard_normal(L.size), rng.standard_normal(L.size)
    comp = np.array([_SOURCES[names[s]][1] for s in src]) + np.array([_SOURCES[names[s]][2] for s in src]) * z_c
    factor = np.exp(within * (rho * z_c + math.sqrt(1 - rho ** 2) * z_e) - within ** 2 / 2)
    dens = np.clip(base[src] * (L / 4096.0) ** exponent * factor, 1e-4, 1.0)
    return {"fixture": "synthetic_study", "tau": 0.9,
            "assumptions": {"seed": seed, "rho": rho, "cv_equal_length": cv_equal_length,
                            "exponent": exponent, "sources": _SOURCES},
            "documents": [{"source": names[s], "length": int(x), "density": float(d),
                           "compression_ratio": float(max(c, 0.005))}
                          for s, x, d, c in zip(src.tolist(), L.tolist(), dens.tolist(), comp.tolist())]}
