"""Per-op timelines the driver writes with ``--sb-timeline``: where prediction error comes from.

For every logged step the driver stores the predicted and the measured per-op
forward/backward times. Replaying the measured op times through the pipeline model
gives the step the schedule alone explains; the rest of the measured step is
outside the modelled ops (optimizer, point-to-point waits, data, planning). So

    measured step - replayed measured ops  = overhead the model does not see
    replayed measured ops - predicted      = error of the op-time predictions
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Optional, Tuple

import numpy as np

from sparsebalance.pipeline import simulate


def _steps(directory: str, skip: int) -> Iterator[Tuple[str, dict, dict]]:
    """(file name, measured, predicted) of each logged step after the first ``skip``
    that has both files, in step order."""
    for f in sorted(glob.glob(os.path.join(directory, "step_*.measured.json")))[skip:]:
        pf = f.replace(".measured.json", ".predicted.json")
        if os.path.isfile(pf):
            with open(f) as fh, open(pf) as gh:
                yield os.path.basename(f), json.load(fh), json.load(gh)


def timeline_stats(directory: str, skip: int) -> Optional[dict]:
    """Medians over the logged steps after the first ``skip``; None without files."""
    rows = []
    for _, m, p in _steps(directory, skip):
        mf, mb = np.asarray(m["fwd_ms"]), np.asarray(m["bwd_ms"])
        qf, qb = np.asarray(p["fwd_ms"]), np.asarray(p["bwd_ms"])
        kw = dict(schedule=m.get("schedule", "1f1b"), vpp=int(m.get("vpp", 1)))
        rows.append((simulate(mf, mb, **kw).step_ms, simulate(qf, qb, **kw).step_ms,
                     float((mf + mb).sum()), float((qf + qb).sum())))
    if not rows:
        return None
    r = np.median(np.array(rows), axis=0)
    return {"replayed_ms": float(r[0]), "predicted_ops_ms": float(r[1]),
            "op_sum_measured_ms": float(r[2]), "op_sum_predicted_ms": float(r[3]),
            "steps": len(rows)}



def paired_ops(directory: str, reference: str, k0: int, skip: int) -> Optional[dict]:
    """Op-by-op comparison of a DST run with a static-top-k run on the same packing.

    Both runs must have packed the same documents (same seed and packer, e.g.
    ``sparsebalance`` and ``sab``), so op ``(step, micro-batch, stage, phase)`` is the
    same work but for its budget. Ops are grouped by the DST run's budget against the
    static ``k0`` (``cut``, ``same``, ``raised``); per group, the ratio of summed
    measured times (DST run / static run) and of summed predicted times, and the op
    count. ``same`` isolates what the budgets do not explain: an op at k0 in both runs
    is the same work in both. None without the timeline files (with budgets).
    """
    sums: dict = {}
    ref = {name: (m, p) for name, m, p in _steps(reference, 0)}
    for name, m, p in _steps(directory, skip):
        if name not in ref:
            continue
        if "budget" not in p:
            return None
        loaded = (m, ref[name][0], p, ref[name][1])  # measured, measured, predicted, predicted
        b = np.asarray(p["budget"], dtype=float)
        for phase in ("fwd_ms", "bwd_ms"):
            arrays = [np.asarray(x[phase], dtype=float) for x in loaded]
            if any(a.shape != b.shape for a in arrays):
                continue
            for key, sel in (("cut", b < k0), ("same", b == k0), ("raised", b > k0)):
                g = sums.setdefault(key, np.zeros(5))
                g += [a[sel].sum() for a in arrays] + [sel.sum()]
    if not sums:
        return None
    ratio = lambda a, b: float(a / b) if b > 0 else None  # noqa: E731
    return {k: {"measured_ratio": ratio(g[0], g[1]), "predicted_ratio": ratio(g[2], g[3]),
                "ops": int(g[4])} for k, g in sums.items()}


def noise_penalty(directory: str, skip: int, draws: int = 30, seed: int = 0) -> Optional[dict]:
    """How much op-time scatter lengthens this run's planned steps.

    The scatter is the run's own: every op's measured / predicted time, over the
    logged steps after ``skip``, divided by its median. Each step's predicted op
    times are multiplied by ``draws`` resamples of that scatter (seeded) and replayed
    through the pipeline model; ``penalty`` is the mean of the noisy step over the
    noiseless one, minus 1. A plan that balances the stages leaves no slack to absorb
    overruns, so it pays more than one whose bubbles soak them up. None without files.
    """
    pairs = [(m, p) for _, m, p in _steps(directory, skip)]
    if not pairs:
        return None
    ratios = np.concatenate([(np.asarray(m[k], float) / np.asarray(p[k], float)).ravel()
                             for m, p in pairs for k in ("fwd_ms", "bwd_ms")])
    ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
    ratios = ratios / np.median(ratios)
    rng = np.random.default_rng(seed)
    grow = []
    for m, p in pairs:
        f, b = np.asarray(p["fwd_ms"], float), np.asarray(p["bwd_ms"], float)
        kw = dict(schedule=p.get("schedule", "1f1b"), vpp=int(p.get("vpp", 1)))
        base = simulate(f, b, **kw).step_ms
        noisy = [simulate(f * rng.choice(ratios, f.shape), b * rng.choice(ratios, b.shape),
                          **kw).step_ms for _ in range(draws)]
        grow.append(float(np.mean(noisy)) / base)
    return {"op_scatter": float(np.std(ratios)), "penalty": float(np.mean(grow)) - 1.0,
            "steps": len(pairs)}


def step_tokens(timeline: dict, fallback: float) -> Tuple[float, str]:
    """Real tokens of the step a ``last_timeline`` document holds, from its run's
    summary JSON (``step_tokens_all``, beside the timeline directory); ``fallback``
    (the arm's mean tokens per step) when the summary cannot say. Returns
    ``(tokens, source)``, source "step" or "mean"."""
    f = timeline.get("file", "")
    summary = os.path.join(os.path.dirname(os.path.dirname(f)), "summary.json")
    try:
        with open(summary) as fh:
            s = json.load(fh)
        it = int(os.path.basename(f).split("_")[1].split(".")[0])
        toks, last = s["step_tokens_all"], int(s["last_iteration"])
        idx = len(toks) - 1 - (last - it)
        if 0 <= idx < len(toks) and toks[idx] > 0:
            return float(toks[idx]), "step"
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    return float(fallback), "mean"
