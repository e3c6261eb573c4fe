"""Model of megatron-core's 1F1B and interleaved 1F1B pipeline schedules.

``simulate(fwd_ms, bwd_ms, schedule=..., vpp=..., p2p_ms=...)`` predicts a step
from per-op durations; ``rank_order`` gives megatron's per-rank op order;
``sparsebalance.pipeline.trace`` exports Chrome traces and Gantt charts.
"""

from .schedule import all_rank_orders, rank_order, schedule_table
from .simulate import StepResult, op_id, simulate, simulate_1f1b

__all__ = ["StepResult", "all_rank_orders", "op_id", "rank_order", "schedule_table",
           "simulate", "simulate_1f1b"]
