"""Model of megatron-core's 1F1B and interleaved 1F1B pipeline schedules.

``simulate(fwd_ms, bwd_ms, schedule=..., vpp=..., p2p_ms=...)`` predicts a step's
timeline from per-op durations and ``step_ms`` the step time of a batch of
instances (one engine: the project's only step-time model; ``step_ms_rows`` and
``step_ms_scaled`` the same for instances assembled from a table of micro-batches or scaled
from one); ``rank_order`` gives
megatron's per-rank op order; ``sparsebalance.pipeline.trace`` exports Chrome traces
and Gantt charts.
"""

from .schedule import all_rank_orders, rank_order, schedule_table
from .simulate import PipelineTimeline, op_id, simulate, step_ms, step_ms_rows, step_ms_scaled

__all__ = ["PipelineTimeline", "all_rank_orders", "op_id", "rank_order", "schedule_table",
           "simulate", "step_ms", "step_ms_rows",
           "step_ms_scaled"]
