"""Dynamic sparsity tuning (DST): per-micro-batch, per-stage attention budgets.

Planners are pure functions of an :class:`Instance` (predicted op times and
retained attention as functions of the budget) returning a :class:`Plan`:
``anchor_plan`` (the paper's anchor-guided thresholding) and
``critical_path_plan`` (pipeline-aware); ``sensitivity`` refines any plan toward the
micro-batches whose loss suffers most per dropped pair; ``equal_time_plan`` keeps the most
attention that fits the static plan's step time. The driver's data iterators put each
plan's entries on the micro-batches (docs/design.md). CLI: ``python -m sparsebalance.tuning plan ...``.
"""

from .anchor import anchor_indices, anchor_plan
from .critical_path import critical_path_indices, critical_path_plan, raise_indices
from .equal_time import equal_time_indices, equal_time_plan
from .instance import Instance, instance_from_json, instance_to_json
from .plan import Plan, make_plan, static_plan

__all__ = ["Instance", "Plan", "anchor_indices", "anchor_plan", "critical_path_indices",
           "critical_path_plan", "equal_time_indices", "equal_time_plan", "instance_from_json",
           "instance_to_json", "make_plan", "raise_indices", "static_plan"]
