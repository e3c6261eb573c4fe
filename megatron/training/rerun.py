"""Megatron-LM's result validation (``--rerun-mode validate_results``) on any backend.

A step whose loss is rejected (non-finite on any rank, or an error injected by
``--error-injection-rate`` / ``--error-injection-type``) is run again, before the
optimizer step, from the same parameters on the same micro-batches (the step's grads are
zeroed and its data replayed; nothing else changes between the two runs). The re-run's
loss is compared with the first one's as Megatron-LM compares them (equal, or both NaN):

* not reproduced -> a transient error: a warning names the iteration and the step goes
  on with the re-run's result (Megatron-LM's non-fatal path);
* reproduced -> a persistent error: the run stops with one line naming the iteration,
  before the optimizer step, so nothing non-finite is applied or saved. Megatron-LM would
  save and ask for a resume on a different GPU to tell a faulty device from a correct
  result; one process cannot move devices, so the reproduced error stops the run here.

As in Megatron-LM, the first iteration a job runs is not validated, and an injection draws
``(randint(0, rate - 1) + rank) % rate == 0`` on each rank once per validated step (from a
generator seeded by ``--seed``, so runs repeat); an injected ``transient_error`` makes the
re-run miscompare, ``persistent_error`` and ``correct_result`` make it match.
``disabled`` (the default) checks nothing and runs nothing twice.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MODES = ("disabled", "validate_results")
"""``--rerun-mode`` choices."""
INJECTION_TYPES = {"correct_result": "Expected result", "transient_error": "Transient error",
                   "persistent_error": "Persistent error"}
"""``--error-injection-type`` choices -> the name Megatron-LM logs for each."""


@dataclass
class RerunConfig:
    """What the driver's flags ask of :class:`ResultValidator`."""

    mode: str = "disabled"
    """``--rerun-mode``: ``disabled`` or ``validate_results``."""
    injection_rate: int = 0
    """``--error-injection-rate``: inject into about one validated step in this many per rank (0: never;
    as in Megatron-LM, nothing is injected with ``disabled``)."""
    injection_type: str = "transient_error"
    """``--error-injection-type``: which diagnostic an injected error must end in."""
    seed: int = 1234
    """Seed of the injection draws (``--seed``)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--rerun-mode {self.mode}: choose one of {', '.join(MODES)}")
        if self.injection_type not in INJECTION_TYPES:
            raise ValueError(f"--error-injection-type {self.injection_type}: choose one of "
                             f"{', '.join(INJECTION_TYPES)}")
        if self.injection_rate < 0:
            raise ValueError(f"--error-injection-rate {self.injection_rate}: must be >= 0")


def same_result(a: float, b: float) -> bool:
    """Megatron-LM's comparison at tolerance 0: equal, or both NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


class ResultValidator:
    """Validates each step's loss and re-runs a rejected step once (see the module docstring).

    ``warn`` prints one line (rank 0 of the driver); ``rank`` is this process's global rank.
    """

    def __init__(self, config: RerunConfig, rank: int, warn: Callable[[str], None]) -> None:
        self.config, self.rank, self.warn = config, rank, warn
        self.rng = random.Random(config.seed)
        self.first_iteration_done = False
        self.announced = False

    @property
    def enabled(self) -> bool:
        return self.config.mode == "validate_results"

    def _inject(self) -> Optional[str]:
        rate = self.config.injection_rate
        if not rate or (self.rng.randint(0, rate - 1) + self.rank) % rate != 0:
            return None
        print(f"rank {self.rank}: injecting error type {INJECTION_TYPES[self.config.injection_type]}", flush=True)
        return self.config.injection_type

    def check(self, iteration: int, loss: float, rerun: Callable[[], float], device: torch.device) -> float:
        """The loss the step goes on with: ``loss`` (this rank's loss sum, 0 off the last
        stage) if accepted, else the loss of ``rerun()`` (which runs the step again) when the
        re-run does not reproduce it; raises ``ValueError`` (one line) when it does.
        Collective: every rank calls it once per step."""
        if not self.enabled:
            return loss
        if not self.announced:
            self.announced = True
            self.warn("result validation enabled (--rerun-mode validate_results)")
        if not self.first_iteration_done:  # Megatron-LM: never on a job's first iteration
            self.first_iteration_done = True
            return loss
        injected = self._inject()
        rejected = injected is not None or not math.isfinite(loss)
        if not _any_rank(rejected, device):
            return loss
        what = f"injected {injected}" if injected else (f"loss {loss}" if rejected else "")
        self.warn(f"iteration {iteration}: unexpected result ({what or 'on another rank'}); "
                  "re-running the step from the same state on the same data")
        again = rerun()
        if injected is not None:  # Megatron-LM's injector decides the comparison
            differs = injected == "transient_error"
        else:
            differs = rejected and not same_result(loss, again)
        if _any_rank(differs, device):
            self.warn(f"iteration {iteration}: first rerun: unexpected result is not reproducible "
                      f"(possible transient error); the step goes on with the re-run's result")
            return again
        raise ValueError(f"iteration {iteration}: the unexpected result ({what or 'on another rank'}) was "
                         "reproduced by a re-run from the same state on the same data (persistent error, "
                         "--rerun-mode validate_results); stopped before its optimizer step, nothing of it saved")


def _any_rank(flag: bool, device: torch.device) -> bool:
    if not torch.distributed.is_initialized():  # one process (unit tests): nothing to agree on
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())
