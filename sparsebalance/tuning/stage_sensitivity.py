"""Stage-aware DST: which pipeline stage's layers pay most per dropped (query, key) pair.

On a pretrained model the loss a budget cut costs depends on WHICH layers are cut, not only on
which documents: on SmolLM2-135M the last layers pay far more per dropped pair than the first
ones, while slack-only DST cuts the last stage (the one holding the output layer, hence the
critical one). A *stage profile* (``benchmarks/stage_sensitivity.py``, ``--sb-stage-sensitivity``)
gives each stage of a P-stage split its measured loss per dropped pair; :func:`op_weights` turns
it into the per-op weights ``[D, M, S]`` that
:func:`sparsebalance.tuning.sensitivity.sensitivity_indices` refines any plan by: among moves of
equal planned step time (it never lets the step time grow), a level goes from an op whose
layers pay little to one whose layers pay much.

Profile JSON (``benchmarks/stage_sensitivity.py`` writes it; only these keys are read)::

    {"format": "sb-stage-sensitivity", "version": 1, "num_layers": N,
     "profiles": [{"stages": P, "nats_per_pair": [float per stage],
                   "layer_ranges": [[first, last] per stage] (optional, 1-based)}, ...]}

``nats_per_pair[s]``: loss (nats, summed over scored tokens) per kept pair dropped (one head,
one layer) in stage ``s``'s layers; a negative measurement (noise) counts as 0. Stage ``s`` of a
P-stage split is the ``s``-th range of the model's layers in order (the first stages take the
extra layer), which is also the interleaved schedule's virtual stage ``s``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

FORMAT = "sb-stage-sensitivity"


@dataclass(frozen=True)
class StageProfile:
    """Measured loss per dropped pair of each stage, for one or more stage counts."""

    num_layers: int
    """Transformer layers of the model the profile was measured on."""
    stages: Dict[int, Tuple[float, ...]]
    """Stage count P -> P values of nats per dropped pair (one head, one layer)."""
    layers: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    """Stage count P -> layers of each stage where the profile says (its ``layer_ranges``)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.stages:
            raise ValueError("a stage profile needs at least one profile")
        for P, vals in self.stages.items():
            if len(vals) != P or not all(np.isfinite(vals)):
                raise ValueError(f"the {P}-stage profile must have {P} finite values")
            if not any(v > 0 for v in vals):
                raise ValueError(f"the {P}-stage profile has no stage with a positive sensitivity")

    def weights(self, stages: int, num_layers: Optional[int] = None,
                stage_layers: Optional[Sequence[int]] = None) -> np.ndarray:
        """[stages] weights of a ``stages``-stage split, negatives as 0, scaled to mean 1
        (only their ratios steer DST). ValueError if the profile has no such split, was
        measured on a model of another depth (``num_layers``) or split its layers otherwise
        (``stage_layers``: layers of each stage of the run)."""
        if num_layers is not None and num_layers != self.num_layers:
            raise ValueError(f"the stage profile was measured on a {self.num_layers}-layer model, "
                             f"this one has {num_layers} layers")
        if stages not in self.stages:
            raise ValueError(f"the stage profile has no {stages}-stage split (it has "
                             f"{', '.join(str(p) for p in sorted(self.stages))})")
        got = self.layers.get(stages)
        if stage_layers is not None and got is not None and tuple(stage_layers) != got:
            raise ValueError(f"the stage profile split the layers {list(got)}, this run "
                             f"{list(stage_layers)}")
        w = np.maximum(np.asarray(self.stages[stages], dtype=float), 0.0)
        return w / w.mean()


def parse_stage_profile(d: Any) -> StageProfile:
    """The profile of a parsed JSON object; ValueError (one line) on bad input."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"not a stage profile (format {FORMAT!r}; benchmarks/stage_sensitivity.py writes one)")
    n = d.get("num_layers")
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError("'num_layers' must be an integer")
    profiles = d.get("profiles")
    if not isinstance(profiles, list) or not profiles:
        raise ValueError("'profiles' must be a non-empty list")
    stages, layers = {}, {}
    for i, p in enumerate(profiles):
        P = p.get("stages") if isinstance(p, dict) else None
        vals = p.get("nats_per_pair") if isinstance(p, dict) else None
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"profiles[{i}]: 'stages' must be an integer >= 1")
        if not isinstance(vals, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in vals):
            raise ValueError(f"profiles[{i}]: 'nats_per_pair' must be a list of numbers")
        if P in stages:
            raise ValueError(f"profiles[{i}]: a second {P}-stage profile")
        stages[P] = tuple(float(v) for v in vals)
        ranges = p.get("layer_ranges")
        if ranges is not None:
            ok = isinstance(ranges, list) and len(ranges) == P and all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                and 1 <= r[0] <= r[1] for r in ranges)
            if not ok:
                raise ValueError(f"profiles[{i}]: 'layer_ranges' must be {P} [first, last] layer pairs")
            layers[P] = tuple(r[1] - r[0] + 1 for r in ranges)
    return StageProfile(num_layers=n, stages=stages, layers=layers)


def read_stage_profile(path: str) -> StageProfile:
    """:func:`parse_stage_profile` of the file ``path``; ValueError (one line) naming it."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    try:
        return parse_stage_profile(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def op_weights(stage_weight: np.ndarray, dp: int, microbatches: int,
               microbatch_weight: Optional[np.ndarray] = None) -> np.ndarray:
    """[dp, microbatches, S] op weights: each stage's ``stage_weight`` [S], times its
    micro-batch's ``microbatch_weight`` [dp, microbatches] where given (the two sensitivities
    taken as independent)."""
    s = np.asarray(stage_weight, dtype=float)
    w = np.broadcast_to(s[None, None, :], (dp, microbatches, len(s)))
    if microbatch_weight is not None:
        w = w * np.asarray(microbatch_weight, dtype=float)[:, :, None]
    return np.array(w)
