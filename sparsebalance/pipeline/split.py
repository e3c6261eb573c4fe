"""The layer split over pipeline stages that equalises their predicted times.

A stage's time for a micro-batch is ``layers x layer_ms + extras_ms`` (the latency
predictor's decomposition, :mod:`sparsebalance.predictor.base`): the first stage adds the
embedding, the last the output layer and loss. Averaged over the run's micro-batches
(forward + backward), stage ``s`` holding ``n_s`` layers takes ``n_s x layer + extra_s``
(linear in ``n_s``), so the split that minimises the slowest stage's mean time is found by
giving one layer at a time to the stage that is fastest so far (identical items on machines
with fixed start loads: the greedy order is optimal for the maximum). Ties go to the earlier
stage, so the split is a deterministic function of its inputs.

A stage may end up with no layer (a small model whose output layer alone outweighs a stage's
share): Megatron-LM's layout string expresses that (``"E|ttt|ttt|tttL"``-like stages), the
uneven first/last flags do not. :func:`megatron_flags` prints the simplest Megatron-LM flags
for a split.

Budget cuts are for imbalance that changes from micro-batch to micro-batch; this split
answers the imbalance every micro-batch shares (``sparsebalance.tuning.critical_path``'s
per-stage floor leaves it alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

PHASES = ("fwd", "bwd")


@dataclass(frozen=True)
class StageCosts:
    """Mean per-micro-batch costs (ms, forward + backward) a split is priced with."""

    layer_ms: float
    """One transformer layer."""
    extra_ms: Tuple[float, ...]
    """Each stage's extras: the embedding on the first, the output layer and loss on the last."""

    def __post_init__(self) -> None:
        if not self.layer_ms > 0 or not self.extra_ms or min(self.extra_ms) < 0:
            raise ValueError(f"need layer_ms > 0 and extras >= 0 for >= 1 stage, got {self.layer_ms}, "
                             f"{list(self.extra_ms)}")

    def stage_ms(self, stage_layers: Sequence[int]) -> np.ndarray:
        """[pp] predicted mean time of each stage holding ``stage_layers`` layers."""
        if len(stage_layers) != len(self.extra_ms):
            raise ValueError(f"{len(stage_layers)} stage counts for {len(self.extra_ms)} stages")
        return np.asarray(stage_layers, dtype=float) * self.layer_ms + np.asarray(self.extra_ms)


def stage_costs(predictor, microbatches: Sequence[Sequence[int]], pp: int,
                topk: Optional[int] = None) -> StageCosts:
    """Mean costs over ``microbatches`` (each a list of document lengths, tokens) at budget
    ``topk`` (None: dense), from ``predictor`` (uncalibrated: the layout is fixed for the run)."""
    if pp < 1 or not microbatches:
        raise ValueError(f"need pp >= 1 and >= 1 micro-batch, got pp {pp} and {len(microbatches)}")
    layer = np.mean([sum(predictor.layer_ms(mb, topk, ph) for ph in PHASES) for mb in microbatches])
    extra = [float(np.mean([sum(predictor.extras_ms(mb, s, pp, ph) for ph in PHASES) for mb in microbatches]))
             for s in range(pp)]
    return StageCosts(layer_ms=float(layer), extra_ms=tuple(extra))


def propose_split(costs: StageCosts, num_layers: int) -> Tuple[int, ...]:
    """Layers per stage minimising the slowest stage's mean time (see the module docstring)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    counts = [0] * len(costs.extra_ms)
    times = list(costs.extra_ms)
    for _ in range(num_layers):
        s = min(range(len(counts)), key=lambda j: (times[j] + costs.layer_ms, j))
        counts[s] += 1
        times[s] += costs.layer_ms
    return tuple(counts)


def spread(stage_ms: Sequence[float]) -> float:
    """How much the slowest stage's time exceeds the fastest's: max / min - 1 (inf: a stage at 0)."""
    t = np.asarray(stage_ms, dtype=float)
    return float(t.max() / t.min() - 1.0) if t.min() > 0 else float("inf")


def near_even_split(num_layers: int, pp: int) -> Tuple[int, ...]:
    """Megatron-LM's default split (even), or as even as it goes with the first stages taking
    the extra layer when ``num_layers`` does not divide (the split a layout-blind run uses)."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (s < extra) for s in range(pp))


def layout_string(stage_layers: Sequence[int]) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for the split (runs of equal middle
    stages written ``(tttt|)*k``)."""
    stages = ["t" * int(n) for n in stage_layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    if len(stages) == 1:
        return stages[0]
    out, middle, i = [stages[0] + "|"], stages[1:-1], 0
    while i < len(middle):
        run = 1
        while i + run < len(middle) and middle[i + run] == middle[i]:
            run += 1
        out.append(f"({middle[i]}|)*{run}," if run > 1 else middle[i] + "|")
        i += run
    return "".join(out) + stages[-1]


def megatron_flags(stage_layers: Sequence[int]) -> list:
    """The simplest Megatron-LM flags that place ``stage_layers``: none for the even split,
    ``--decoder-first/last-pipeline-num-layers`` when the middle stages are even and the ends
    hold a layer, else ``--pipeline-model-parallel-layout``."""
    counts = [int(n) for n in stage_layers]
    pp = len(counts)
    if len(set(counts)) == 1:
        return []
    middle = set(counts[1:-1])
    if min(counts[0], counts[-1]) >= 1 and len(middle) <= 1 and min(middle, default=1) >= 1:
        if pp == 2:
            return ["--decoder-first-pipeline-num-layers", str(counts[0])]
        m = middle.pop()
        flags = []
        if counts[0] != m:
            flags += ["--decoder-first-pipeline-num-layers", str(counts[0])]
        if counts[-1] != m:
            flags += ["--decoder-last-pipeline-num-layers", str(counts[-1])]
        return flags
    return ["--pipeline-model-parallel-layout", layout_string(counts)]


def pack_in_order(lengths: Sequence[int], tokens: int, count: int) -> list:
    """Up to ``count`` micro-batches of at most ``tokens`` tokens, whole documents in order
    (a longer one cut to ``tokens``), as Megatron's sequential packing fills them; the
    micro-batches a split is priced over."""
    out, cur, used = [], [], 0
    for n in (min(int(n), tokens) for n in lengths if int(n) > 0):
        if used + n > tokens:
            out.append(cur)
            cur, used = [], 0
            if len(out) == count:
                return out
        cur.append(n)
        used += n
    return out + [cur] if cur and len(out) < count else out
