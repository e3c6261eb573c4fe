"""Per-micro-batch, per-stage budgets into megatron-core's real schedules.

megatron's schedules call ``forward_step_func(data_iterator, model)`` once per
forward, and the forward step pulls the next micro-batch from the iterator of the
model chunk being run. Each chunk's iterator is visited in micro-batch order
0, 1, ..., M-1 (for 1F1B and for the interleaved schedule table alike), so the
n-th pull from chunk ``c``'s iterator on pipeline rank ``r`` is micro-batch ``n``
on virtual stage ``c * pp + r``. :class:`BudgetIterator` wraps that iterator: on
each pull it returns a copy of the micro-batch dict with ``budget`` (that
micro-batch's top-k on that stage, an int) and ``microbatch`` (its index) added.
The driver's forward step moves both onto the micro-batch's
:class:`~sparsebalance.attention.packed.BudgetedPackedSeqParams`, which megatron-core
hands to every layer's attention: the budget's only carrier, no global state. The
schedules themselves run unchanged.

The budget has one form from planner to kernel: the plan's table
``[dp][microbatch][virtual stage]`` of ints (``tuning.plan.Plan.budget``, passed on
as is), whose entries ride on the micro-batches. :func:`stage_budgets` is where a
table is checked (shape, ranks, non-negative); nothing downstream checks again.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping, Sequence

import numpy as np


class BudgetIterator:
    """Iterator wrapper: each pull attaches its budget to the micro-batch (a dict) it returns."""

    def __init__(self, inner: Iterator[Any], budgets: Sequence[int]) -> None:
        """``budgets[m]``: top-k of micro-batch ``m`` on this iterator's stage (checked by
        :func:`stage_budgets`)."""
        self.inner = iter(inner)
        self.budgets = list(budgets)
        self.pulled = 0
        """Micro-batches handed out so far (= index of the next one)."""

    def __iter__(self) -> "BudgetIterator":
        return self

    def __next__(self) -> Any:
        m = self.pulled
        if m >= len(self.budgets):
            raise RuntimeError(f"budget plan covers {len(self.budgets)} micro-batches; "
                               "the schedule pulled one more")
        batch = next(self.inner)
        if not isinstance(batch, Mapping):
            raise TypeError(f"micro-batches must be dicts to carry a budget, got {type(batch).__name__}")
        self.pulled += 1
        return {**batch, "budget": self.budgets[m], "microbatch": m}


def stage_budgets(budget: Any, dp_rank: int, pp_rank: int, pp: int, vpp: int = 1
                  ) -> List[List[int]]:
    """Per model chunk of this rank, the budgets of micro-batches 0..M-1 (Python ints).

    Args:
        budget: plan table ``[dp][microbatch][stage]`` (stage = ``chunk * pp + rank``).

    Raises:
        ValueError: the table's shape does not fit the layout, the ranks lie outside
            it, or a budget is negative.
    """
    b = np.asarray(budget, dtype=np.int64)
    if b.ndim != 3 or b.shape[2] != pp * vpp:
        raise ValueError(f"budget must be [dp][microbatch][{pp * vpp} stages], got {b.shape}")
    if not 0 <= dp_rank < b.shape[0] or not 0 <= pp_rank < pp:
        raise ValueError(f"dp_rank {dp_rank} / pp_rank {pp_rank} outside the plan")
    if (b < 0).any():
        raise ValueError(f"budgets must be >= 0, got {int(b.min())}")
    return [b[dp_rank, :, c * pp + pp_rank].tolist() for c in range(vpp)]


def wrap_data_iterators(iterators: Sequence[Iterator[Any]], budget: Any, dp_rank: int,
                        pp_rank: int, pp: int) -> List[BudgetIterator]:
    """Wrap this rank's per-chunk data iterators for one step (one per model chunk)."""
    rows = stage_budgets(budget, dp_rank, pp_rank, pp, vpp=len(iterators))
    return [BudgetIterator(it, r) for it, r in zip(iterators, rows)]
