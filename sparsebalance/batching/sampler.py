"""The packing sampler: one global step of packed micro-batches per call.

Every rank builds the same ``PackingSampler`` and calls :meth:`PackingSampler.next_step`
once per training step; the result depends only on (lengths, config, seed, steps
consumed), so no communication is needed. Rank ``r`` trains
``packing.ranks[r][m]`` as its micro-batch ``m``.

Epochs: epoch ``e`` streams the documents in the permutation drawn from
``(seed, e)`` (chunked into items of at most ``seq_length`` tokens). A step never
mixes epochs: once the stream of epoch ``e`` is exhausted, the following steps place
the remaining carried items (possibly leaving micro-batches empty) before epoch
``e + 1`` starts, so every token is trained exactly once per epoch.

Carry-over: a strategy may defer items to later steps (the ``wlb`` outlier queues,
``sab``'s selection, or simply items that did not fit); an item that has waited
``max_carry_steps`` steps is forced into the next step, and the carried tokens never
exceed half a step's capacity, which guarantees forced items fit.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

import numpy as np

from sparsebalance.batching.packing import Carried, PackContext, StepPacking
from sparsebalance.batching.strategies import get_strategy
from sparsebalance.batching.stream import EpochItems, StreamCursor, epoch_permutation

_DEFAULT = object()


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_lengths(lengths) -> np.ndarray:
    """Document lengths as a 1-D int64 array; raises ValueError naming ``lengths``."""
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("lengths must be a non-empty 1-D array of document lengths")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(arr == np.floor(arr)):
            raise ValueError("lengths must be integers")
    arr = arr.astype(np.int64)
    if arr.min() <= 0:
        raise ValueError(f"lengths must be >= 1, got {int(arr.min())} "
                         f"(document {int(np.argmin(arr))})")
    return arr


class PackingSampler:
    """Deterministic, resumable packing of documents into per-rank micro-batches.

    Args:
        lengths: [N] document lengths in tokens (document id = index).
        dp: data-parallel ranks.
        micro_batches: micro-batches per rank per step (M).
        seq_length: token capacity of a micro-batch.
        item_length: longest item: documents are chunked at this many tokens (default
            ``seq_length``; ``--micro-batch-size N`` packs N items' worth, ``seq_length`` =
            N x ``item_length``).
        strategy: megatron | concat | sorted | tokens | quadratic | wlb | sab.
        seed: seed of the per-epoch document permutation.
        shuffle: permute documents per epoch (False: dataset order every epoch).
        max_carry_steps: no item waits more than this many steps.
        predictor: LatencyPredictor; required by cost-based strategies, and used to
            attach predicted times to every packing.
        topk: attention budget to plan for; default the predictor's ``topk``.
        pp: pipeline stages used for per-rank times.
        density: optional density estimator refining attention costs (see
            :mod:`sparsebalance.batching.cost`); one with ``advance(step)`` (threshold
            routing's :class:`~sparsebalance.batching.density_feedback.ThresholdDensity`)
            is advanced before each packing, and one with ``state_dict`` is saved with the
            sampler's state.
        options: strategy knobs (see each strategy).
    """

    def __init__(self, lengths: np.ndarray, *, dp: int, micro_batches: int, seq_length: int,
                 strategy: str = "megatron", seed: int = 0, shuffle: bool = True,
                 max_carry_steps: int = 2, predictor=None, topk=_DEFAULT, pp: int = 1,
                 density=None, options: Optional[dict] = None, item_length: Optional[int] = None):
        self.lengths = check_lengths(lengths)
        self.dp = _check_int("dp", dp, 1)
        self.micro_batches = _check_int("micro_batches", micro_batches, 1)
        self.seq_length = _check_int("seq_length", seq_length, 1)
        self.item_length = self.seq_length if item_length is None else _check_int("item_length", item_length, 1)
        if self.item_length > self.seq_length:
            raise ValueError(f"item_length ({self.item_length}) must be <= seq_length ({self.seq_length})")
        self.seed = _check_int("seed", seed, 0)
        self.max_carry_steps = _check_int("max_carry_steps", max_carry_steps, 0)
        self.pp = _check_int("pp", pp, 1)
        self.shuffle = bool(shuffle)
        self.strategy = strategy
        chosen = get_strategy(strategy)
        self._pack = chosen.pack
        if chosen.predictor == "required" and predictor is None:
            raise ValueError(f"predictor is required for strategy {strategy!r}")
        self.cost = None
        if predictor is not None:
            from sparsebalance.batching.cost import CostModel

            k = getattr(predictor, "topk", None) if topk is _DEFAULT else topk
            self.cost = CostModel(predictor, topk=k, pp=self.pp, density=density)
        self.density = density
        self.options = dict(options or {})
        self._items_cache: tuple = (-1, None)
        self._epoch = 0
        self._pos = 0
        self._head = 0
        self._step = 0
        self._carried = Carried.empty()

    # -- stream --------------------------------------------------------------------------
    def _epoch_items(self, epoch: int) -> EpochItems:
        if self._items_cache[0] != epoch:
            order = epoch_permutation(self.lengths.size, self.seed, epoch, self.shuffle)
            self._items_cache = (epoch, EpochItems.build(self.lengths, order, self.item_length))
        return self._items_cache[1]

    @property
    def epoch(self) -> int:
        """Epoch of the next step."""
        return self._epoch

    @property
    def consumed_steps(self) -> int:
        """Steps produced so far."""
        return self._step

    @property
    def carried(self) -> Carried:
        """Items waiting for a later step."""
        return self._carried

    # -- stepping ------------------------------------------------------------------------
    def next_step(self) -> StepPacking:
        """Pack the next global step (identical on every rank)."""
        t0, w0 = time.thread_time(), time.perf_counter()
        if hasattr(self.density, "advance"):
            self.density.advance(self._step)
        cursor = StreamCursor(self._epoch_items(self._epoch), self._pos, self._head)
        if cursor.exhausted() and len(self._carried) == 0:
            self._epoch, self._pos, self._head = self._epoch + 1, 0, 0
            cursor = StreamCursor(self._epoch_items(self._epoch))
        K, S = self.dp * self.micro_batches, self.seq_length
        ctx = PackContext(dp=self.dp, micro_batches=self.micro_batches, seq_length=S,
                          max_carry_steps=self.max_carry_steps, flush=cursor.exhausted(),
                          carry_cap_tokens=(K * S) // 2, cost=self.cost,
                          options=self.options)
        packing = self._pack(self._carried, cursor, ctx)
        self._check(packing, ctx)
        epoch = self._epoch
        self._pos, self._head = cursor.pos, cursor.head_offset
        self._carried = packing.deferred
        bins = packing.bins
        step = StepPacking(step=self._step, epoch=epoch,
                           ranks=[bins[r * self.micro_batches:(r + 1) * self.micro_batches]
                                  for r in range(self.dp)],
                           carried_docs=len(packing.deferred))
        self._step += 1
        if self.cost is not None:
            for key, val in self.cost.packing_times(bins, self.dp, self.micro_batches).items():
                setattr(step, key, val)
        step.pack_ms = (time.thread_time() - t0) * 1e3
        step.pack_wall_ms = (time.perf_counter() - w0) * 1e3
        return step

    def __iter__(self) -> Iterator[StepPacking]:
        while True:
            yield self.next_step()

    def _check(self, packing, ctx: PackContext) -> None:
        """Capacity, forced placement and carry cap: a violation is a strategy bug."""
        if len(packing.bins) != ctx.num_bins:
            raise RuntimeError(f"strategy {self.strategy!r} returned {len(packing.bins)} bins, "
                               f"expected {ctx.num_bins}")
        tokens = [sum([s[2] for s in b]) for b in packing.bins]
        if max(tokens) > ctx.seq_length:
            raise RuntimeError(f"strategy {self.strategy!r} overfilled micro-batch "
                               f"{tokens.index(max(tokens))}")
        d = packing.deferred
        if len(d) and int(d.age.max()) > self.max_carry_steps:
            raise RuntimeError(f"strategy {self.strategy!r} deferred an item beyond "
                               f"max_carry_steps={self.max_carry_steps}")
        if ctx.flush and len(d) and len(d) >= len(self._carried):
            raise RuntimeError(f"strategy {self.strategy!r} made no progress at epoch end")

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain-Python state; with the same constructor arguments, loading it resumes
        the exact sequence of packings."""
        c = self._carried
        out = {
            "version": 1,
            "strategy": self.strategy,
            "seed": self.seed,
            "num_docs": int(self.lengths.size),
            "seq_length": self.seq_length,
            "item_length": self.item_length,
            "dp": self.dp,
            "micro_batches": self.micro_batches,
            "epoch": self._epoch,
            "pos": self._pos,
            "head_offset": self._head,
            "step": self._step,
            "carried": {"doc": c.doc.tolist(), "offset": c.offset.tolist(),
                        "length": c.length.tolist(), "age": c.age.tolist()},
        }
        if hasattr(self.density, "state_dict"):
            out["density"] = self.density.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; raises ValueError naming a mismatched setting.

        Another data-parallel size is accepted when the global batch is the same
        (``dp * micro_batches`` micro-batches of ``seq_length`` tokens, as when a job resumes
        on another number of ranks with the same ``--global-batch-size``): the state is the
        position in the epoch's document stream plus the carried items, none of it per rank,
        so the remaining documents are re-partitioned over the new ranks, none lost or
        repeated. Strategies whose bins do not depend on ``dp`` (``megatron``, ``concat``,
        ``sorted``) then pack the very same micro-batches; the others (``sab``, ``wlb``,
        ``tokens``, ...) re-plan them for the new ranks.
        """
        for key in ("strategy", "seed", "num_docs", "seq_length", "item_length"):
            mine = self.strategy if key == "strategy" else (
                int(self.lengths.size) if key == "num_docs" else getattr(self, key))
            if key == "item_length" and key not in state:  # a state from before item_length
                continue
            if state.get(key) != mine:
                raise ValueError(f"state_dict {key} is {state.get(key)!r}, sampler has {mine!r}")
        saved = (state.get("dp"), state.get("micro_batches"))
        if not all(isinstance(v, int) for v in saved) or saved[0] * saved[1] != self.dp * self.micro_batches:
            raise ValueError(f"state_dict global batch is dp {saved[0]!r} x micro_batches {saved[1]!r}, "
                             f"sampler has dp {self.dp} x micro_batches {self.micro_batches} "
                             "(another DP size needs the same global batch)")
        self._epoch = int(state["epoch"])
        self._pos = int(state["pos"])
        self._head = int(state["head_offset"])
        self._step = int(state["step"])
        if hasattr(self.density, "load_state_dict") and state.get("density") is not None:
            self.density.load_state_dict(state["density"])
        c = state["carried"]
        self._carried = Carried(*(np.asarray(c[k], dtype=np.int64).reshape(-1)
                                  for k in ("doc", "offset", "length", "age")))
