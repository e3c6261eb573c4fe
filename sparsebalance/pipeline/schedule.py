"""Per-rank op order of megatron-core's pipeline schedules (training, no p2p overlap).

Reproduces the order in which ``forward_backward_pipelining_without_interleaving``
and ``forward_backward_pipelining_with_interleaving`` (megatron-core 0.16) call the
forward step and the backward step on each pipeline rank:

* 1F1B: ``w = min(pp - rank - 1, M)`` warm-up forwards, then ``M - w`` pairs
  (forward ``w + i``, backward ``i``), then ``w`` cool-down backwards.
  ``pp == 1`` is megatron's no-pipelining path (F0 B0 F1 B1 ...), the same order.
* Interleaved: micro-batches are visited in the schedule table of
  ``get_schedule_table`` (groups of ``microbatch_group_size_per_vp_stage``
  micro-batches per model chunk); warm-up is
  ``min((pp - rank - 1) * 2 + (vpp - 1) * group, M * vpp)`` forwards; then pairs
  (forward ``warmup + k``, backward ``k``), then the remaining backwards. The
  backward of virtual id ``k`` runs chunk ``vpp - 1 - chunk(k)`` on micro-batch
  ``microbatch(k)``.

An op is ``(phase, microbatch, chunk)`` with phase "F" or "B"; the global
(virtual) stage of chunk ``c`` on rank ``r`` is ``c * pp + r``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

RankOp = Tuple[str, int, int]
"""(phase "F"|"B", micro-batch index, model chunk index)."""

SCHEDULES = ("1f1b", "interleaved")


def schedule_table(num_microbatches: int, vpp: int, group: int) -> List[Tuple[int, int]]:
    """(micro-batch, chunk) per virtual micro-batch id, as megatron's schedule table."""
    table: List[Tuple[int, int]] = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table.extend((m, c) for c in range(vpp) for m in range(lo, hi))
    return table


def check_schedule(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
                   group: Optional[int] = None) -> int:
    """Validate a schedule configuration; returns the effective micro-batch group size.

    Raises ValueError naming the argument, with megatron-core's own constraints for
    the interleaved schedule (``pp <= group <= M``, final group 0 or >= pp).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if vpp < 1:
        raise ValueError(f"vpp must be >= 1, got {vpp}")
    if schedule == "1f1b":
        if vpp != 1:
            raise ValueError(f"vpp must be 1 for schedule '1f1b', got {vpp}")
        return 1
    if pp < 2:
        raise ValueError("schedule 'interleaved' needs pp >= 2 (megatron runs pp=1 unpipelined)")
    g = pp if group is None else int(group)
    if not pp <= g <= num_microbatches:
        raise ValueError(
            f"microbatch group size must be in [pp={pp}, M={num_microbatches}], got {g}")
    rem = num_microbatches % g
    if 0 < rem < pp:
        raise ValueError(
            f"M % group must be 0 or >= pp (M={num_microbatches}, group={g}, pp={pp})")
    return g


def rank_order(schedule: str, pp: int, rank: int, num_microbatches: int, vpp: int = 1,
               group: Optional[int] = None) -> List[RankOp]:
    """Op order on pipeline ``rank`` for one training step (see module docstring)."""
    g = check_schedule(schedule, pp, num_microbatches, vpp, group)
    if not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    M = num_microbatches
    if schedule == "1f1b":
        w = min(pp - rank - 1, M)
        ops: List[RankOp] = [("F", m, 0) for m in range(w)]
        for i in range(M - w):
            ops += [("F", w + i, 0), ("B", i, 0)]
        ops += [("B", M - w + i, 0) for i in range(w)]
        return ops
    table = schedule_table(M, vpp, g)
    total = M * vpp
    warm = min((pp - rank - 1) * 2 + (vpp - 1) * g, total)

    def fwd(k: int) -> RankOp:
        return ("F", table[k][0], table[k][1])

    def bwd(k: int) -> RankOp:
        return ("B", table[k][0], vpp - 1 - table[k][1])

    ops = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        ops += [fwd(warm + k), bwd(k)]
    ops += [bwd(k) for k in range(total - warm, total)]
    return ops


def all_rank_orders(schedule: str, pp: int, num_microbatches: int, vpp: int = 1,
                    group: Optional[int] = None) -> List[List[RankOp]]:
    """``rank_order`` for every rank, indexed by rank."""
    return [rank_order(schedule, pp, r, num_microbatches, vpp, group) for r in range(pp)]
