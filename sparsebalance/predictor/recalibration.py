"""Online recalibration: a per-(stage, phase) multiplicative correction.

A profile taken on another day or node is off by a factor that mostly depends on
the stage (its extras, its GPU, its neighbours) and the phase. We track
``f[stage, phase] ~ measured / model`` as an exponential moving average of the
log-ratio: a multiplicative error is symmetric in log space (2x too slow and 2x
too fast pull equally), and a single outlier (a GC pause, a straggling NCCL
call) moves the factor by at most ``alpha * log(clip)``.

The update uses the *uncalibrated* model prediction, so it is idempotent with
respect to when the prediction was made: the planner may have used an older
factor for a whole step's micro-batches, and feeding all of them back still
moves the factor towards ``measured / model`` and never overshoots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Recalibrator:
    """EMA of log(measured / model) per (stage, phase)."""

    alpha: float = 0.2
    """EMA weight of one observation (0 < alpha <= 1); 0.2 ~ a 5-observation memory."""
    clip: float = 4.0
    """Ratios are clipped to [1/clip, clip] before averaging (outlier guard)."""
    _log: dict = field(default_factory=dict, init=False, repr=False)
    _count: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.clip <= 1.0:
            raise ValueError(f"clip must be > 1, got {self.clip}")

    def observe(self, stage: int, phase: str, model_ms: float, measured_ms: float) -> float:
        """Fold one measurement in; returns the new factor.

        Args:
            stage: pipeline stage index.
            phase: "fwd" or "bwd".
            model_ms: the uncalibrated prediction for what was measured (ms).
            measured_ms: the measured time (ms).
        """
        if phase not in ("fwd", "bwd"):
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        if not (model_ms > 0 and measured_ms > 0 and math.isfinite(model_ms)
                and math.isfinite(measured_ms)):
            raise ValueError(f"model_ms and measured_ms must be positive and finite, "
                             f"got {model_ms}, {measured_ms}")
        key = (int(stage), phase)
        r = min(max(measured_ms / model_ms, 1.0 / self.clip), self.clip)
        # The prior is the profile itself (factor 1). The first steps of a run are
        # often slow (allocator and autotuning warm-up), so they get no extra weight.
        a = self.alpha
        self._log[key] = (1.0 - a) * self._log.get(key, 0.0) + a * math.log(r)
        self._count[key] = self._count.get(key, 0) + 1
        return math.exp(self._log[key])

    def factor(self, stage: int, phase: str) -> float:
        """Current correction (1.0 before any observation)."""
        return math.exp(self._log.get((int(stage), phase), 0.0))

    def count(self, stage: int, phase: str) -> int:
        """Observations folded in for (stage, phase)."""
        return self._count.get((int(stage), phase), 0)

    def reset(self) -> None:
        """Forget all observations."""
        self._log.clear()
        self._count.clear()

    def state_dict(self) -> dict:
        """The online state as plain data (checkpoints): ``alpha``, ``clip`` and one
        ``[stage, phase, mean log-ratio, count]`` row per observed (stage, phase).
        Floats round-trip exactly, so a restored factor is bit-identical."""
        rows = [[s, ph, self._log[(s, ph)], self._count.get((s, ph), 0)] for s, ph in sorted(self._log)]
        return {"alpha": self.alpha, "clip": self.clip, "entries": rows}

    def load_state_dict(self, state: dict) -> None:
        """Replace the online state with :meth:`state_dict`'s output.

        Raises:
            ValueError: malformed state, or saved with another ``alpha`` / ``clip``
                (the EMA would continue with other dynamics than it was built with).
        """
        try:
            alpha, clip, rows = float(state["alpha"]), float(state["clip"]), list(state["entries"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"recalibration state is malformed: {e!r}") from None
        if (alpha, clip) != (self.alpha, self.clip):
            raise ValueError(f"recalibration state was saved with alpha={alpha}, clip={clip}; "
                             f"this predictor has alpha={self.alpha}, clip={self.clip}")
        log, count = {}, {}
        for row in rows:
            try:
                stage, phase, value, n = row
                key, value, n = (int(stage), phase), float(value), int(n)
                ok = phase in ("fwd", "bwd") and math.isfinite(value) and n >= 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"recalibration state has a malformed entry {row!r}")
            log[key], count[key] = value, n
        self._log, self._count = log, count
