"""The driver's thin adapter over the SparseBalance coordinator
(:class:`sparsebalance.balancer.Balancer`, which documents planning, planning ahead,
recalibration and checkpoint state).

It turns the loader's :class:`~megatron.training.data.StepBatches` into document
lengths (as trained: padded under the interleaved schedule) and attaches the
planned budget table to them, which their data iterators hand, per micro-batch and
stage, to the forward step (``sparsebalance.tuning.hook``).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from sparsebalance.balancer import Balancer, StepForecast
from sparsebalance.config import SparseBalanceConfig


def build_predictor(args, vocab_size: int, warn=None):
    """The latency predictor of ``--sb-profile`` / ``--sb-cost-model`` (None if neither);
    raises as :func:`sparsebalance.balancer.build_predictor`. Reads only the flags the
    predictor depends on (model shape, attention, predictor, parallel layout)."""
    from megatron.training import sb_config as C
    from sparsebalance.balancer import build_predictor as build

    config = SparseBalanceConfig(model=C.model_config(args, vocab_size), attention=C.attention_config(args),
                                 predictor=C.predictor_config(args), parallel=C.parallel_config(args))
    return build(config, warn=warn)


def attention_backend_choice(args) -> dict:
    """The kernel backend this run's attention resolves to and why (``{"backend", "reason",
    ...}``): the training log line and the summary JSON's ``attention_backend`` /
    ``attention_backend_reason``."""
    from megatron.training.sb_config import attention_config, parallel_config
    from sparsebalance.balancer import attention_backend_choice as choose

    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    return choose(attention_config(args), parallel_config(args), head_dim, bool(args.bf16))


class BatchBalancer:
    """:class:`sparsebalance.balancer.Balancer` fed with the loader's step batches.

    Args:
        config: the run's configuration.
        predictor: LatencyPredictor whose correction the balancer updates.
        pad_to: micro-batch padding of the data loader (interleaved schedule).
    """

    def __init__(self, config: SparseBalanceConfig, predictor, pad_to: Optional[int]) -> None:
        self.core = Balancer(config, predictor)
        self.pad_to = pad_to

    @property
    def ahead(self) -> bool:
        """Plans are made one step ahead."""
        return self.core.ahead

    @property
    def predictor(self):
        """The predictor whose correction the balancer updates."""
        return self.core.predictor

    @property
    def stages(self) -> int:
        """Virtual pipeline stages."""
        return self.core.stages

    def lengths(self, batches) -> List[List[List[int]]]:
        """Segment lengths ``[dp][microbatch]`` of a step's packing, as trained."""
        from megatron.training.data import microbatch_lengths

        return [[microbatch_lengths(mb, self.pad_to) for mb in rank] for rank in batches.packing.ranks]

    def plan(self, batches) -> StepForecast:
        """Plan ``batches`` now (sets ``batches.budget`` under DST)."""
        return self._attach(batches, self.core.plan(self.lengths(batches)))

    def forecast(self, batches) -> StepForecast:
        """This step's plan (planned ahead or now); sets ``batches.budget`` under DST."""
        return self._attach(batches, self.core.forecast(batches, self.lengths(batches)))

    def plan_ahead(self, batches) -> None:
        """Start planning the next step's ``batches`` in the background."""
        if self.core.ahead:
            self.core.plan_ahead(batches, self.lengths(batches))

    def observe(self, forecast: StepForecast, measured_fwd_ms: np.ndarray,
                measured_bwd_ms: np.ndarray) -> None:
        """Fold the step's measured ``[dp, M, S]`` op times into the correction."""
        self.core.observe(forecast, measured_fwd_ms, measured_bwd_ms)

    def state_dict(self) -> dict:
        """Checkpoint state (:meth:`sparsebalance.balancer.Balancer.state_dict`)."""
        return self.core.state_dict()

    def load_state_dict(self, state: Optional[dict], warn=None) -> None:
        """Restore :meth:`state_dict`'s output (see the library's method)."""
        self.core.load_state_dict(state, warn=warn)

    @staticmethod
    def _attach(batches, forecast: StepForecast) -> StepForecast:
        if forecast.budget is not None:
            batches.budget = forecast.budget
        return forecast
