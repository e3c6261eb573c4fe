"""What every rank measured in one step, gathered to all ranks under field names.

Each step every rank contributes one :class:`RankStep` (loss, compute times, attention
pairs, memory, and the measured forward/backward ms of each of its ops); one
all-gather of their float encodings gives every rank the :class:`GatheredStep`, so
every rank knows the measured ``[dp][microbatch][stage]`` op times (the DST
predictor's recalibration input, identical everywhere) and rank 0 can report the
global loss, per-stage times, bubbles, micro-batch imbalance and density.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import List, Tuple

import numpy as np
import torch


@dataclass
class RankStep:
    """One rank's measurements of one step."""

    loss_sum: float
    """Sum of token losses over this rank's micro-batches (0 off the last stage)."""
    loss_tokens: float
    """Loss tokens behind ``loss_sum``."""
    fwd_s: float
    """Forward compute seconds of the step on this rank."""
    bwd_s: float
    """Backward compute seconds of the step on this rank."""
    pp_rank: int
    """Pipeline rank."""
    dp_rank: int
    """Data-parallel rank."""
    step_s: float
    """Wall seconds of the step on this rank."""
    kept_pairs: float
    """Attention (query, key) pairs kept by this rank's attention calls."""
    causal_pairs: float
    """Causal pairs behind ``kept_pairs``."""
    peak_mb: float
    """This process's memory high-water mark, MiB."""


_HEAD = len(fields(RankStep))


def rank_step_row(step: RankStep, op_fwd_ms: np.ndarray, op_bwd_ms: np.ndarray) -> List[float]:
    """The floats one rank sends: ``step``'s fields in order, then its per-op forward and
    backward ms ``[vpp, M]`` each."""
    return [float(x) for x in astuple(step)] + op_fwd_ms.reshape(-1).tolist() + op_bwd_ms.reshape(-1).tolist()


def comm_device() -> torch.device:
    """Where small control tensors live: NCCL only moves CUDA tensors, gloo CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_floats(row: List[float]) -> np.ndarray:
    """[world, len(row)] float64 table of every rank's row."""
    t = torch.tensor(row, dtype=torch.float64, device=comm_device())
    out = [torch.zeros_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return torch.stack(out).cpu().numpy()


class GatheredStep:
    """Every rank's :class:`RankStep` and op times of one step.

    Args:
        table: ``[world, row]`` gathered rows of :func:`rank_step_row`.
        vpp: model chunks per pipeline rank; ``microbatches``: M; ``pp``, ``dp``: sizes.
    """

    def __init__(self, table: np.ndarray, *, pp: int, dp: int, vpp: int, microbatches: int) -> None:
        self.table, self.pp, self.dp, self.vpp, self.microbatches = table, pp, dp, vpp, microbatches

    def column(self, name: str) -> np.ndarray:
        """Field ``name`` of :class:`RankStep` over ranks, ``[world]``."""
        return self.table[:, [f.name for f in fields(RankStep)].index(name)]

    def stage_times(self, name: str) -> List[float]:
        """Max over DP ranks of field ``name`` for each pipeline stage."""
        stages = self.column("pp_rank").astype(int)
        col = self.column(name)
        return [float(col[stages == s].max()) for s in range(int(stages.max()) + 1)]

    def loss(self) -> float:
        """Per-token loss over the global batch."""
        return float(self.column("loss_sum").sum() / max(self.column("loss_tokens").sum(), 1.0))

    def measured_ops(self) -> Tuple[np.ndarray, np.ndarray]:
        """Measured forward/backward ms ``[dp, M, S]`` (S = virtual stages)."""
        vpp, M, pp = self.vpp, self.microbatches, self.pp
        fwd, bwd = np.zeros((self.dp, M, pp * vpp)), np.zeros((self.dp, M, pp * vpp))
        for row, d, r in zip(self.table, self.column("dp_rank").astype(int), self.column("pp_rank").astype(int)):
            f = row[_HEAD:_HEAD + vpp * M].reshape(vpp, M)
            b = row[_HEAD + vpp * M:_HEAD + 2 * vpp * M].reshape(vpp, M)
            for c in range(vpp):  # tensor-parallel peers measure the same op: keep the slowest
                fwd[d, :, c * pp + r] = np.maximum(fwd[d, :, c * pp + r], f[c])
                bwd[d, :, c * pp + r] = np.maximum(bwd[d, :, c * pp + r], b[c])
        return fwd, bwd

    def bubbles(self) -> List[float]:
        """Per pipeline rank: 1 - busy / step time, mean over the ranks holding that stage."""
        busy = self.column("fwd_s") + self.column("bwd_s")
        frac = 1.0 - busy / np.maximum(self.column("step_s"), 1e-12)
        stages = self.column("pp_rank").astype(int)
        return [float(frac[stages == s].mean()) for s in range(self.pp)]
