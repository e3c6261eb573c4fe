"""Throughput ratios between arms over interleaved rounds, with bootstrap intervals.

A shared machine drifts, so arms are run in rounds (every arm once per round,
alternating order) and compared within a round: the ratio of round ``r`` is
``tokens/s(arm, r) / tokens/s(reference, r)``. The reported ratio is the median of
the per-round ratios; its 95% interval is a two-level bootstrap: rounds are
resampled with replacement, and inside each drawn round each arm's measured steps
are resampled with replacement too, so the interval covers both the round-to-round
drift that interleaving leaves and the step-to-step noise inside a run (with one
round, the interval is the step-level one alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class RunSteps:
    """The measured (post-warm-up) steps of one run of one arm."""

    round: int
    """Round the run belongs to."""
    step_ms: np.ndarray
    """Wall time of each measured step, ms."""
    tokens: np.ndarray
    """Tokens trained in each measured step."""

    @property
    def tokens_per_s(self) -> float:
        return float(self.tokens.sum() / self.step_ms.sum() * 1e3)


def run_steps(summary: dict, round_index: int) -> RunSteps:
    """Measured steps of a driver ``--summary-json`` (skipping its warm-up steps).

    Summaries without per-step token counts (older drivers) get the run's mean rate
    spread over its steps.
    """
    skip = int(summary.get("warmup_steps_skipped", 0))
    ms = np.asarray(summary["step_ms_all"][skip:], dtype=float)
    if summary.get("step_tokens_all") is not None:
        tok = np.asarray(summary["step_tokens_all"][skip:], dtype=float)
    else:
        tok = ms * float(summary["tokens_per_s"]) / 1e3
    if ms.size == 0 or ms.size != tok.size:
        raise ValueError(f"summary has {ms.size} measured steps and {tok.size} token counts")
    return RunSteps(round_index, ms, tok)


def _by_round(runs: Sequence[RunSteps]) -> Dict[int, List[RunSteps]]:
    out: Dict[int, List[RunSteps]] = {}
    for r in runs:
        out.setdefault(r.round, []).append(r)
    return out


def _rate(runs: Sequence[RunSteps], rng: Optional[np.random.Generator]) -> float:
    """Tokens/s of the pooled steps of ``runs`` (resampled with ``rng``)."""
    ms = np.concatenate([r.step_ms for r in runs])
    tok = np.concatenate([r.tokens for r in runs])
    if rng is not None:
        i = rng.integers(0, ms.size, ms.size)
        ms, tok = ms[i], tok[i]
    return float(tok.sum() / ms.sum() * 1e3)


@dataclass(frozen=True)
class RatioEstimate:
    """Throughput of an arm relative to a reference arm."""

    median: float
    """Median over rounds of the per-round ratio."""
    low: float
    """2.5th percentile of the bootstrap distribution."""
    high: float
    """97.5th percentile of the bootstrap distribution."""
    per_round: List[float]
    """Ratio of each round both arms ran in, in round order."""

    @property
    def beyond_noise(self) -> bool:
        """The 95% interval excludes 1 (no difference)."""
        return self.low > 1.0 or self.high < 1.0

    def as_dict(self) -> dict:
        return {"median": self.median, "ci95": [self.low, self.high],
                "per_round": self.per_round, "beyond_noise": self.beyond_noise}


def ratio_estimate(arm: Sequence[RunSteps], reference: Sequence[RunSteps],
                   samples: int = 2000, seed: int = 0) -> RatioEstimate:
    """Per-round throughput ratio ``arm / reference`` with a two-level bootstrap interval.

    Only rounds in which both arms have runs count. Raises ValueError if none do.
    """
    a, b = _by_round(arm), _by_round(reference)
    rounds = sorted(set(a) & set(b))
    if not rounds:
        raise ValueError("the two arms share no round")
    per_round = [_rate(a[r], None) / _rate(b[r], None) for r in rounds]
    rng = np.random.default_rng(seed)
    boot = np.empty(samples)
    for s in range(samples):
        drawn = rng.integers(0, len(rounds), len(rounds))
        boot[s] = np.median([_rate(a[rounds[i]], rng) / _rate(b[rounds[i]], rng) for i in drawn])
    low, high = np.percentile(boot, [2.5, 97.5])
    return RatioEstimate(float(np.median(per_round)), float(low), float(high),
                         [float(x) for x in per_round])
