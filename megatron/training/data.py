"""Packed THD micro-batches from a megatron-core indexed dataset.

Each step comes from the library's :class:`sparsebalance.balancer.StepPlanner` (one call
per step): the sampler's packing (``--sb-batching``), where ``packing.ranks[dp_rank][m]``
is the list of ``(doc_id, offset, length)`` segments of micro-batch ``m``, and, with a
balancer, the step's DST plan. Every pipeline and data-parallel rank runs the same
sampler and planner with the same seed, so all stages of a pipeline see the same
micro-batches and budgets without communication.

A micro-batch is a dict of ``[1, T]`` tensors, ``T`` = sum of its segment lengths:
no padding at all, because megatron's ``variable_seq_lengths`` lets each
micro-batch have its own ``T`` (p2p sends the shape first). Exception: the
interleaved schedule (``--num-layers-per-virtual-pipeline-stage``). With PP=2
its combined send/receive to the same peer posts two shape messages each way in
one batch, and gloo matches them by order, so shapes get crossed (measured on
0.16.1). There every micro-batch is padded to ``--seq-length`` with ONE trailing
padding segment: its own ``cu_seqlens`` entry (so it attends only to itself,
costing at most that segment's attention), loss mask 0, never seen by real tokens::

    tokens        int64  input ids
    labels        int64  next token of the same document (0 where there is none)
    loss_mask     float  1 where the label is a real next token, 0 at a document's last token
                  (and, with loss starts, 0 where the label lies before the document's start)
    position_ids  int64  0.. restarting at every segment (RoPE positions per document)
    cu_seqlens    int32  [n_segments + 1] segment boundaries: attention stays inside one
    budget        (optional, int) DST's top-k of the micro-batch on this chunk's stage,
                  put there by :meth:`StepBatches.iterators`; the forward step moves
                  it to the micro-batch's ``BudgetedPackedSeqParams``
    tau           (optional, float) instead, under threshold routing: DST's TAU of the
                  micro-batch on this chunk's stage (the cap stays ``--sb-topk``), carried
                  the same way
    microbatch    (int) the micro-batch's index in the step, put there by the iterators
    records       (list) the step's attention records, put there by the iterators: the
                  attention modules append to it through the packed params

With context parallelism (``--context-parallel-size N``) each rank gets its share
of every micro-batch from :func:`context_parallel_split`: every segment is padded at
its end to a multiple of ``2N`` tokens (at most ``2N - 1`` masked padding tokens per
segment) and cut into ``2N`` chunks; CP rank ``r`` keeps chunks ``r`` and
``2N - 1 - r`` of each (Megatron's head/tail layout, which megatron-core's THD RoPE
assumes). Its dict holds the local ``tokens/labels/loss_mask/position_ids`` and the
whole micro-batch's ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded``.

With sequence parallelism (``--sequence-parallel``, TP = S > 1) megatron-core splits the
tokens a rank holds over its S TP ranks, so their count must be a multiple of S: the
micro-batch's last segment is extended by masked padding tokens
(:func:`sparsebalance.cp_split.sequence_parallel_pad`: fewer than S; under CP a multiple
of ``2N`` added before the split, so each CP rank's share is a multiple of S). The
padding is never a segment of its own: ``cu_seqlens`` keeps the real lengths and
``cu_seqlens_padded`` (Megatron's convention, as under CP) the stored ones, so the
attention sees the micro-batch's documents unchanged (padding rows attend to nothing)
and RoPE splits the stored rows (:func:`sequence_parallel_pad_microbatch`).

A segment is a whole document or a ``--seq-length`` chunk of a longer one (the
chunk attends only within itself, as in Megatron); the chunk's last position is
still trained on the next token of the document when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

Segment = Tuple[int, int, int]


def split_documents(n_docs: int, fractions: Sequence[float]) -> List[np.ndarray]:
    """Contiguous train/valid/test document-id ranges for ``--split`` fractions."""
    bounds = np.rint(np.cumsum([0.0, *fractions]) * n_docs).astype(np.int64)
    bounds[-1] = n_docs
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(len(fractions))]


def build_microbatch(dataset, doc_ids: np.ndarray, segments: Sequence[Segment],
                     pad_to: Optional[int] = None,
                     loss_starts: Optional[np.ndarray] = None,
                     pad_id: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """THD micro-batch dict (see module docstring) for ``segments``.

    Args:
        dataset: megatron ``IndexedDataset``; ``doc_ids[d]`` is the dataset index of doc ``d``.
        segments: ``(doc, offset, length)`` with ``doc`` indexing ``doc_ids``.
        pad_to: append one masked padding segment up to this many tokens (None: no padding).
        loss_starts: per dataset document, the first token that is a training target
            (``--mask-prompt-loss``); None: every next token is a target.
        pad_id: a target equal to this token id carries no loss (``--null-tokenizer-pad-id``,
            as Megatron-LM's GPT dataset masks its pad token); None: no pad token.
    """
    lengths = dataset.sequence_lengths
    toks, labs, mask, pos, cu = [], [], [], [], [0]
    for doc, off, length in segments:
        idx = int(doc_ids[doc])
        doc_len = int(lengths[idx])
        if length <= 0 or off < 0 or off + length > doc_len:
            raise ValueError(f"segment {(doc, off, length)} outside document {idx} of {doc_len} tokens")
        has_next = off + length < doc_len
        ids = np.asarray(dataset.get(idx, offset=off, length=length + has_next), dtype=np.int64)
        toks.append(ids[:length])
        lab = np.zeros(length, dtype=np.int64)
        lab[: len(ids) - 1] = ids[1:]
        labs.append(lab)
        m = np.ones(length, dtype=np.float32)
        if not has_next:
            m[-1] = 0.0
        if loss_starts is not None:
            # position off + i predicts token off + i + 1: a target iff that is >= the start
            m[: max(0, min(length, int(loss_starts[idx]) - 1 - off))] = 0.0
        if pad_id is not None:
            m[lab == pad_id] = 0.0
        mask.append(m)
        pos.append(np.arange(length, dtype=np.int64))
        cu.append(cu[-1] + length)
    if pad_to is not None or not segments:
        # An empty packing (a small split at its epoch end) still has to feed the
        # schedule one micro-batch: a single masked padding token.
        pad = max((pad_to or 1) - cu[-1], 0)
    else:
        pad = 0
    if pad:
        toks.append(np.zeros(pad, dtype=np.int64))
        labs.append(np.zeros(pad, dtype=np.int64))
        mask.append(np.zeros(pad, dtype=np.float32))
        pos.append(np.arange(pad, dtype=np.int64))
        cu.append(cu[-1] + pad)
    cat = lambda xs: torch.from_numpy(np.concatenate(xs)).unsqueeze(0)
    return {
        "tokens": cat(toks),
        "labels": cat(labs),
        "loss_mask": cat(mask),
        "position_ids": cat(pos),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }


def sequence_parallel_pad_microbatch(mb: Dict[str, torch.Tensor], sp: int) -> Dict[str, torch.Tensor]:
    """A :func:`build_microbatch` dict (no CP) padded to a multiple of ``sp`` tokens for
    sequence parallelism (see module docstring): padding rows (id 0, label 0, loss mask 0,
    position 0) at the end, ``cu_seqlens`` unchanged, ``cu_seqlens_padded`` with the last
    segment extended over them."""
    from sparsebalance.cp_split import sequence_parallel_pad

    cu = mb["cu_seqlens"]
    pad = sequence_parallel_pad(int(cu[-1]), 1, sp)
    out = dict(mb)
    if pad:
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            x = mb[key]
            out[key] = torch.cat([x, x.new_zeros(1, pad)], 1)
    out["cu_seqlens_padded"] = torch.cat([cu[:-1], cu[-1:] + pad])
    return out


def context_parallel_split(mb: Dict[str, torch.Tensor], cp: int, rank: int, sp: int = 1
                           ) -> Dict[str, torch.Tensor]:
    """CP rank ``rank``'s share of a :func:`build_microbatch` dict (see module docstring).

    Padding tokens (id 0, label 0, loss mask 0, position 0) end each padded segment;
    real tokens keep their positions, labels and loss mask. ``sp``: sequence-parallel
    ranks; the last segment gets the extra padding that makes the share a multiple of it.
    """
    from sparsebalance.cp_split import local_token_index, padded_lengths, sequence_parallel_pad

    cu = mb["cu_seqlens"].long().numpy()
    lens = np.diff(cu)
    P = padded_lengths(lens, cp)
    P[-1] += sequence_parallel_pad(int(P.sum()), cp, sp)
    pstart = np.cumsum(P) - P
    doc = np.repeat(np.arange(len(lens)), P)
    pos = np.arange(int(P.sum())) - pstart[doc]
    real = pos < lens[doc]
    src = np.where(real, cu[:-1][doc] + pos, 0)  # row of the unpadded micro-batch
    take = local_token_index(P, cp, rank)
    src, real = torch.from_numpy(src[take]), torch.from_numpy(real[take])
    out = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        x = mb[key][0, src]
        out[key] = torch.where(real, x, torch.zeros((), dtype=x.dtype)).unsqueeze(0)
    out["cu_seqlens"] = mb["cu_seqlens"]
    out["cu_seqlens_padded"] = torch.from_numpy(np.concatenate([[0], np.cumsum(P)]).astype(np.int32))
    return out


class BudgetIterator:
    """One model chunk's data iterator for one step: each pull hands out the next
    micro-batch dict with its index (``microbatch``), the step's attention-record list
    (``records``) and, under DST, its top-k on this chunk's stage (``budget``), or under
    threshold routing its TAU (``tau``).

    megatron's schedules call ``forward_step_func(data_iterator, model)`` once per
    forward and pull from the iterator of the model chunk being run; each chunk's
    iterator is visited in micro-batch order 0, 1, ..., M-1 (1F1B and the interleaved
    schedule table alike), so the n-th pull is micro-batch n on virtual stage
    ``chunk * pp + pp_rank``.
    """

    def __init__(self, microbatches: Sequence[Dict[str, Any]], budgets: Optional[Sequence[int]],
                 records: list, taus: Optional[Sequence[float]] = None) -> None:
        self.microbatches, self.budgets, self.records = microbatches, budgets, records
        self.taus = taus
        self.pulled = 0
        """Micro-batches handed out so far (= index of the next one)."""

    def __iter__(self) -> "BudgetIterator":
        return self

    def __next__(self) -> Dict[str, Any]:
        m = self.pulled
        if m >= len(self.microbatches):
            raise RuntimeError(f"the step has {len(self.microbatches)} micro-batches; "
                               "the schedule pulled one more")
        self.pulled += 1
        out = {**self.microbatches[m], "microbatch": m, "records": self.records}
        if self.budgets is not None:
            out["budget"] = int(self.budgets[m])
        if self.taus is not None:
            out["tau"] = float(self.taus[m])
        return out


@dataclass
class StepBatches:
    """This rank's micro-batches of one step plus what the logs need."""

    microbatches: List[Dict[str, torch.Tensor]]
    """M micro-batch dicts in pipeline order."""
    global_tokens: int
    """Tokens in the whole global batch (all DP ranks), for throughput."""
    global_docs: int
    """Segments in the global batch."""
    planned: Any = None
    """The library's :class:`~sparsebalance.balancer.PlannedStep` (packing, lengths as
    trained, static density, forecast)."""
    dp_rank: int = 0
    """This rank's data-parallel index (row of the budget table)."""
    pp_rank: int = 0
    """This rank's pipeline index."""
    pp: int = 1
    """Pipeline ranks."""
    records: list = field(default_factory=list)
    """Attention records of this step's calls on this rank (``AttentionRecord``), filled
    by the attention modules through each micro-batch's packed params."""

    @property
    def packing(self):
        """The sampler's ``StepPacking`` of the whole step (every DP rank's segments)."""
        return self.planned.packing

    @property
    def budget(self) -> Optional[np.ndarray]:
        """DST budget table ``[dp][microbatch][virtual stage]`` top-k (the plan's own,
        checked by the library); None: every layer's static ``--sb-topk``."""
        forecast = None if self.planned is None else self.planned.forecast
        return None if forecast is None else forecast.budget

    @property
    def tau(self) -> Optional[np.ndarray]:
        """DST's TAU table ``[dp][microbatch][virtual stage]`` under threshold routing (the
        plan's own, checked by the library); None: every layer's static ``--sb-threshold``."""
        forecast = None if self.planned is None else self.planned.forecast
        return getattr(forecast, "tau", None)

    def iterators(self, num_chunks: int) -> List[BudgetIterator]:
        """One iterator per model chunk: every virtual stage walks the same micro-batches,
        chunk ``c`` with the budgets (or TAUs) of virtual stage ``c * pp + pp_rank``."""
        b, t = self.budget, self.tau
        col = lambda x, c: None if x is None else x[self.dp_rank, :, c * self.pp + self.pp_rank]  # noqa: E731
        return [BudgetIterator(self.microbatches, col(b, c), self.records, col(t, c)) for c in range(num_chunks)]


class PackedDataLoader:
    """Steps of packed micro-batches for one DP rank, as the library's ``StepPlanner``
    packs (and plans) them.

    Args:
        dataset: megatron ``IndexedDataset``.
        doc_ids: dataset indices of the documents this loader draws from (a split).
        dp, dp_rank: data-parallel size and this rank's index.
        micro_batches: micro-batches per rank per step.
        seq_length: token capacity of a micro-batch (``--micro-batch-size`` x ``--seq-length``).
        item_length: documents are chunked at this many tokens (``--seq-length``; default
            ``seq_length``).
        strategy: ``--sb-batching`` name.
        seed: sampler seed (same on every rank).
        shuffle: shuffle the document order per epoch.
        vocab_size: token ids must be below this (checked per micro-batch).
        pad_to: pad every micro-batch to this many tokens (interleaved schedule only).
        max_carry_steps: no deferred document waits longer than this many steps.
        predictor: LatencyPredictor for the cost-based strategies (sab, wlb).
        balancer: the run's ``sparsebalance.balancer.Balancer`` (None: no DST plan or
            forecast); it plans (and looks ahead) inside the library's ``StepPlanner``.
        attention: the run's ``AttentionConfig`` (sparse: each step's static density).
        pp, pp_rank: pipeline ranks and this rank's index (the packer predicts per-rank pipeline times).
        loss_starts: per dataset document, the first target token (``--mask-prompt-loss``).
        cp, cp_rank: context-parallel size and this rank's index (:func:`context_parallel_split`).
        sp: sequence-parallel ranks (TP under ``--sequence-parallel``; 1: off): micro-batches
            are padded for them (module docstring).
        pad_id: targets equal to this id carry no loss (:func:`build_microbatch`).
        density: threshold routing's per-document density estimator for the packer's costs
            (:class:`sparsebalance.batching.density_feedback.ThresholdDensity`, learnt from
            :func:`megatron.training.doc_features.feedback` after each step); None: none.
        sensitivity: DST's per-micro-batch sensitivity weights
            (:class:`sparsebalance.balancer.SensitivityWeights`, ``--sb-dst-sensitivity``); None: none.
    """

    def __init__(self, dataset, doc_ids: np.ndarray, *, dp: int, dp_rank: int, micro_batches: int,
                 seq_length: int, strategy: str, seed: int, shuffle: bool = True,
                 vocab_size: Optional[int] = None, pad_to: Optional[int] = None,
                 max_carry_steps: int = 2, predictor=None, pp: int = 1, pp_rank: int = 0,
                 loss_starts: Optional[np.ndarray] = None, cp: int = 1, cp_rank: int = 0,
                 pad_id: Optional[int] = None, item_length: Optional[int] = None, balancer=None,
                 attention=None, sp: int = 1, density=None, sensitivity=None) -> None:
        from sparsebalance.balancer import StepPlanner
        from sparsebalance.batching.sampler import PackingSampler

        if len(doc_ids) == 0:
            raise ValueError("doc_ids: the split has no documents")
        self.dataset = dataset
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.dp_rank = dp_rank
        self.vocab_size = vocab_size
        self.pad_to = pad_to
        self.loss_starts = loss_starts
        self.pad_id = pad_id
        self.pp, self.pp_rank = pp, pp_rank
        self.cp, self.cp_rank, self.sp = cp, cp_rank, sp
        lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)[self.doc_ids]
        sampler = PackingSampler(lengths, dp=dp, micro_batches=micro_batches, seq_length=seq_length,
                                 strategy=strategy, seed=seed, shuffle=shuffle, max_carry_steps=max_carry_steps,
                                 predictor=predictor, pp=pp, item_length=item_length, density=density)
        self.density = density
        self.planner = StepPlanner(sampler, balancer, pad_to=pad_to, attention=attention,
                                   sensitivity=sensitivity)

    def next_step(self, more: bool = True) -> StepBatches:
        """The library plans the next step (identically on every rank); build this rank's
        micro-batches. ``more``: another step follows (it may be planned ahead)."""
        planned = self.planner.next_step(more)
        packing = planned.packing
        mine = packing.ranks[self.dp_rank]
        all_segments = [seg for rank in packing.ranks for mb in rank for seg in mb]
        microbatches = [build_microbatch(self.dataset, self.doc_ids, mb, self.pad_to, self.loss_starts,
                                         self.pad_id) for mb in mine]
        if self.cp > 1:
            microbatches = [context_parallel_split(mb, self.cp, self.cp_rank, self.sp) for mb in microbatches]
        elif self.sp > 1:
            microbatches = [sequence_parallel_pad_microbatch(mb, self.sp) for mb in microbatches]
        if self.vocab_size is not None:
            top = max(int(mb["tokens"].max()) for mb in microbatches)
            if top >= self.vocab_size:
                raise ValueError(f"data has token id {top} >= vocab size {self.vocab_size} "
                                 "(wrong --tokenizer-type / --vocab-size for this dataset?)")
        return StepBatches(
            microbatches=microbatches,
            global_tokens=int(sum(s[2] for s in all_segments)),
            global_docs=len(all_segments),
            planned=planned,
            dp_rank=self.dp_rank,
            pp_rank=self.pp_rank,
            pp=self.pp,
        )

    def state_dict(self) -> dict:
        """The sampler's state at the first step not yet handed out."""
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)
