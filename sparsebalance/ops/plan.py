"""Block top-k routing plan shared by every kernel backend.

The plan is computed once per call (fp32 gate; ties at the k-th value keep the lower
block id) and handed to every kernel backend as small int32 tables, so all backends
select the same key blocks. The O(blocks) metadata is numpy on the host, once per
micro-batch; the gates and the choice run on q's device with no host sync: on CUDA as
three Triton kernels (:mod:`~sparsebalance.ops.route_kernels`, :func:`fused_route`; top-k
and threshold routing), on the CPU (and with ``SPARSEBALANCE_ROUTE=torch``) as batched
tensor ops over all documents in padded batches. Threshold routing's kept pairs stay on
the device until read (:class:`~sparsebalance.ops.kept.KeptPairs`).

Blocks are numbered globally over the packed batch: document ``d`` of length
``L`` contributes ``ceil(L / B)`` consecutive blocks (the last may be partial).
Because a key block of a document is also one of its query blocks, key blocks
are referenced by the same global block id.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch

from sparsebalance.ops.kept import KeptPairs

TopK = Union[int, torch.Tensor]


@dataclass
class RoutingPlan:
    """Which key blocks every (head, query block) attends to."""

    block_size: int
    """Routing block size B in tokens."""
    qb_start: torch.Tensor
    """int32 ``[NB]``: first token (global index) of each block."""
    qb_len: torch.Tensor
    """int32 ``[NB]``: tokens in each block (1..B)."""
    kv_idx: torch.Tensor
    """int32 ``[H, NB, W]``: kept key block ids, ascending; the diagonal block is the
    last valid entry of row ``(h, b)`` (at ``kv_cnt[h, b] - 1``); -1 pads the row."""
    kv_cnt: torch.Tensor
    """int32 ``[H, NB]``, contiguous: kept key blocks of each (head, query block). Always per
    head, so every kernel reads one shape: under top-k routing (and per-block threshold
    counts) the rows of all heads are equal. A plan built with an ``[NB]`` tensor (one count
    for every head) gets it expanded to ``[H, NB]`` (``__post_init__``)."""
    causal_pairs: int
    """Causal (query, key) pairs summed over heads and documents."""
    kept: KeptPairs
    """Kept pairs per document and per head and the widest head's valid ``kv_idx`` entries:
    on the host under top-k routing; threshold routing's stay on the device until first
    read (:attr:`kept_pairs` and the others below read them), so building a plan never
    waits for the device."""
    doc_end: Optional[torch.Tensor] = None
    """int32 ``[NB]``: one past the last block of each block's document (set by
    :func:`build_plan`; fa4's device descriptors read it)."""

    @property
    def kept_pairs(self) -> int:
        """Kept (query, key) pairs summed over heads and documents."""
        return self.kept.total

    @property
    def kv_nnz(self) -> Optional[int]:
        """Valid entries of ``kv_idx`` of the head with the most (``kv_cnt.sum(1).max()``;
        every head has as many under top-k routing); lets :func:`reverse_index` size its
        output without reading the table."""
        return self.kept.nnz

    @property
    def doc_kept(self) -> Optional[np.ndarray]:
        """int64 ``[n_docs]``: kept pairs of each document, summed over heads (host)."""
        return self.kept.doc

    @property
    def head_kept(self) -> Optional[np.ndarray]:
        """int64 ``[H]``: kept pairs of each head, summed over documents (host; sums to
        ``kept_pairs``)."""
        return self.kept.head

    def __post_init__(self) -> None:
        H, NB = self.kv_idx.shape[0], self.kv_idx.shape[1]
        if self.kv_cnt.dim() == 1:
            self.kv_cnt = self.kv_cnt.to(torch.int32).view(1, NB).expand(H, NB).contiguous()
        elif tuple(self.kv_cnt.shape) != (H, NB):
            raise ValueError(f"kv_cnt must be [NB={NB}] or [H={H}, NB], got {tuple(self.kv_cnt.shape)}")

    @property
    def density(self) -> float:
        """Kept pairs / causal pairs (1.0 for an empty batch)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0

    def to(self, device: torch.device) -> "RoutingPlan":
        """The same plan with its tables on ``device``."""
        mv = lambda t: t.to(device, non_blocking=True)
        return RoutingPlan(self.block_size, mv(self.qb_start), mv(self.qb_len), mv(self.kv_idx),
                           mv(self.kv_cnt), self.causal_pairs,
                           KeptPairs(head=self.head_kept, nnz=self.kv_nnz, total=self.kept_pairs))


@torch.no_grad()
def restrict_plan(plan: RoutingPlan, tokens: torch.Tensor, causal_pairs: int) -> RoutingPlan:
    """``plan`` for the query tokens ``tokens`` only (one context-parallel rank's).

    Blocks that hold none of ``tokens`` keep just their diagonal block: the kernels'
    tables stay as they are (every block is a query row, the diagonal last), the
    wasted work is one block each, and the caller discards those rows. A block with
    some of ``tokens`` runs in full. ``kept_pairs`` counts the pairs of ``tokens``.

    Args:
        tokens: int64 global token ids (any order).
        causal_pairs: causal pairs of ``tokens``, summed over heads (the plan has no
            per-token document positions to count them).
    """
    H, NB, W = plan.kv_idx.shape
    qs = plan.qb_start.to("cpu", torch.int64)
    tok = tokens.to("cpu", torch.int64)
    blk = torch.searchsorted(qs, tok, right=True) - 1
    cnt = plan.kv_cnt.to("cpu", torch.int64)  # [H, NB]
    per_head = ((cnt[:, blk] - 1) * plan.block_size + (tok - qs[blk]) + 1).sum(1)
    kept = int(per_head.sum())
    active = torch.zeros(NB, dtype=torch.bool)
    active[blk] = True
    idle = (~active).nonzero().flatten()
    dev = plan.kv_idx.device
    kv_idx, kv_cnt = plan.kv_idx.clone(), plan.kv_cnt.clone()
    if idle.numel():
        i = idle.to(dev)
        kv_idx[:, i] = -1
        kv_idx[:, i, 0] = i.to(kv_idx.dtype)
        kv_cnt[:, i] = 1
    return RoutingPlan(plan.block_size, plan.qb_start, plan.qb_len, kv_idx, kv_cnt, int(causal_pairs),
                       KeptPairs(head=per_head.numpy(), nnz=int(kv_cnt.sum(1).max()), total=kept))


@dataclass(frozen=True)
class RoutingRule:
    """How many key blocks a query block keeps besides its sink and diagonal.

    ``threshold=None`` (top-k routing): the budget ``topk`` of its document, in every head.
    A threshold ``TAU`` (threshold routing): the smallest count ``c`` such that the ``c``
    candidates with the largest gates hold at least ``TAU`` of the head's softmax over the
    candidates' gate scores, clamped to ``[topk_min, topk]`` (and to the candidates there
    are), and the head keeps its top ``c``. ``per_head=True`` (default): one count per
    (query block, head), so ``RoutingPlan.kv_cnt [H, NB]`` rows differ by head.
    ``per_head=False``: one count per query block, the largest over its heads, kept by
    every head (each head still keeps its own top ``c``); on a pretrained model that keeps
    about twice the pairs for the same coverage, for comparisons. The count follows the
    content, so equal-length documents can cost differently. ``TAU = 1`` with a cap of
    every block is dense causal attention."""

    threshold: Optional[float] = None
    """TAU in (0, 1]; None: top-k routing."""
    topk_min: int = 0
    """Threshold routing's least count of chosen blocks (besides sink and diagonal)."""
    per_head: bool = True
    """Threshold routing: a count per (query block, head); False: per query block."""

    def __post_init__(self) -> None:
        if self.threshold is not None and not 0.0 < float(self.threshold) <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if isinstance(self.topk_min, bool) or not isinstance(self.topk_min, int) or self.topk_min < 0:
            raise ValueError(f"topk_min must be an int >= 0, got {self.topk_min!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"per_head must be a bool, got {self.per_head!r}")


TOPK_RULE = RoutingRule()
_rule: contextvars.ContextVar = contextvars.ContextVar("sparsebalance_routing_rule", default=TOPK_RULE)


def current_rule() -> RoutingRule:
    """The routing rule :func:`build_plan` and the reference apply here (:func:`routing_rule`)."""
    return _rule.get()


@contextlib.contextmanager
def routing_rule(rule: Optional[RoutingRule]) -> Iterator[None]:
    """Inside the block every plan (and the reference) routes by ``rule`` (None: top-k)."""
    token = _rule.set(rule or TOPK_RULE)
    try:
        yield
    finally:
        _rule.reset(token)


class TensorCache:
    """Values built from a tensor, reused while it is the same object at the same in-place
    version (every layer of a micro-batch gets its ``cu_seqlens`` tensor), keyed further by
    ``key``; the ``size`` most recent are kept. An entry holds its tensor (and ``hold``), so
    that memory cannot be handed to another tensor while the entry lives."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list = []
        """[(tensor, its _version, key, value, hold)], most recent last."""

    def get(self, tensor: torch.Tensor, key, build: Callable[[], object], hold=None):
        """The value of ``(tensor, key)``: a cached one, or ``build()`` (then cached)."""
        for i, (t, version, k, value, _) in enumerate(self.entries):
            if t is tensor and version == tensor._version and k == key:
                self.entries.append(self.entries.pop(i))
                return value
        value = build()
        self.entries.append((tensor, tensor._version, key, value, hold))
        del self.entries[:-self.size]
        return value

    def tensors(self) -> list:
        """The tensors of the entries, oldest first."""
        return [e[0] for e in self.entries]

    def values(self) -> list:
        """The values of the entries, oldest first."""
        return [e[3] for e in self.entries]

    def clear(self) -> None:
        self.entries.clear()


MICROBATCHES_CACHED = 8
"""Micro-batches whose host copies, routing skeletons and layouts are kept (pipeline
schedules interleave a few micro-batches' forwards with earlier ones' recomputed forwards)."""
_host_cu = TensorCache(MICROBATCHES_CACHED)
"""cu_seqlens tensor -> its int64 numpy copy."""


_host_copies = 0


def host_copies() -> int:
    """Host copies :func:`host_cu` made in this process (tests: one per micro-batch)."""
    return _host_copies


def host_cu(cu_seqlens: torch.Tensor) -> np.ndarray:
    """``cu_seqlens`` as an int64 numpy array, copied to the host once per tensor: a
    tensor seen before (same object, same in-place version: the layers of one
    micro-batch) is not copied again, so a CUDA ``cu_seqlens`` syncs the host once per
    micro-batch, not once per layer. A CPU tensor (the host copy the driver attaches to
    the micro-batch) never syncs."""

    def copy() -> np.ndarray:
        global _host_copies
        _host_copies += 1
        return cu_seqlens.detach().to("cpu", torch.int64).numpy()

    return _host_cu.get(cu_seqlens, None, copy)


def per_doc_topk(topk: TopK, n_docs: int) -> torch.Tensor:
    """topk as an int64 CPU tensor of one value per document."""
    if isinstance(topk, torch.Tensor):
        t = topk.detach().to("cpu", torch.int64).reshape(-1)
        if t.numel() == 1:
            t = t.expand(n_docs)
        return t.clone()
    return torch.full((n_docs,), int(topk), dtype=torch.int64)


def _select_rows(g: torch.Tensor, k: Union[int, torch.Tensor], kmax: int,
                 host_check: Optional[bool] = None) -> torch.Tensor:
    """Column ids of the ``k`` largest entries per row of ``g``, ascending (ties: lower index).

    ``k`` is an int (then ``kmax == k > 0``) or an int64 tensor broadcastable to
    ``g.shape[:-1] + (1,)`` with values in ``0..kmax``; entries past a row's ``k`` are -1.
    With ``t`` the k-th largest value of a row, everything above ``t`` is kept and the ties
    at ``t`` are filled from the left. On the GPU this is plain tensor ops with no host
    sync; on the CPU (where a host check is free; ``host_check`` overrides) a batch
    without ties at ``t`` takes topk's ids directly. Returns int64 ``[..., kmax]``.
    """
    n = g.shape[-1]
    if isinstance(k, int):
        vals, idx = torch.topk(g, k, dim=-1, sorted=False)
        t = vals.amin(-1, keepdim=True)
    else:
        vals, idx = torch.topk(g, kmax, dim=-1, sorted=True)  # descending
        t = vals.gather(-1, (k - 1).clamp(min=0).expand(*g.shape[:-1], 1))
    del vals
    eq = g == t
    if g.device.type == "cpu" if host_check is None else host_check:
        # Rows that are all -inf (batch padding) have t == -inf; they are not looked at.
        tie = (eq.sum(-1, keepdim=True) > 1) & (t > float("-inf"))
        if not isinstance(k, int):
            tie &= k > 0
        if not bool(tie.any()):  # topk's first k ids are exactly the k largest
            if isinstance(k, int):
                return idx.sort(-1).values
            idx = torch.where(torch.arange(kmax, device=g.device) < k, idx, n).sort(-1).values
            return idx.masked_fill_(idx == n, -1)
    del idx
    gt = g > t
    need = k - gt.sum(-1, keepdim=True, dtype=torch.int32)  # rows with k == 0: need 0, gt empty
    chosen = eq.logical_and_(eq.cumsum(-1, dtype=torch.int32) <= need).logical_or_(gt)
    del gt
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, kmax)
    cols = torch.arange(n, device=g.device).expand(g.shape)
    out = torch.full(g.shape[:-1] + (kmax + 1,), -1, dtype=torch.int64, device=g.device)
    return out.scatter_(-1, slot, cols)[..., :kmax]  # non-chosen land in the dropped slot


def select_topk(g: torch.Tensor, k: int) -> torch.Tensor:
    """Column ids of the ``k`` largest entries per row of ``g``, ascending (ties: lower index).

    ``g [..., n]`` has ``-inf`` where a column is not a candidate; every row must have
    at least ``k`` candidates. Returns int64 ``[..., k]``.
    """
    if k == 0:
        return torch.zeros(g.shape[:-1] + (0,), dtype=torch.int64, device=g.device)
    return _select_rows(g, int(k), int(k))


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    # The plan is a few dozen small ops; waking torch's intra-op pool for each costs
    # more than the work (16K tokens, 2 busy cores: ~25 ms on 1 thread, ~250 ms on 2).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


_GATE_BUDGET = 1 << 24
"""Most gate entries (heads x rows x columns, padding included) routed in one batch."""
_GATHER_BUDGET = 1 << 26
"""Most token x head x dim elements copied at once to take block means (GPU)."""
_CPU_CHUNK = 1 << 19
"""The same on the CPU, where a chunk should stay in cache."""


@torch.no_grad()
def build_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    topk: TopK,
    block_size: int,
    softmax_scale: float,
    reduce_q_sums: Optional[Callable[[torch.Tensor], None]] = None,
) -> RoutingPlan:
    """Route every query block of every head (inputs assumed validated).

    Args:
        q: ``[T, H, D]``; k: ``[T, Hkv, D]``.
        cu_seqlens: int ``[n_docs + 1]`` document boundaries.
        topk: int, or int tensor ``[n_docs]`` (one budget per document).
        block_size: B, tokens per block.
        softmax_scale: scale of the gate (same as the attention's).
        reduce_q_sums: called in place on the fp32 query-block sums ``[n, H, D]`` before
            they become means (context parallelism: each rank holds some rows of ``q``,
            zeros elsewhere, and all-reduces the sums so every block's gate sees all of
            its queries). Called once when any document has a choice to make.

    Returns:
        The :class:`RoutingPlan`, tables on ``q.device``.
    """
    if q.device.type != "cpu":  # host work is numpy; the pool matters only to CPU tensors
        return _build_plan(q, k, cu_seqlens, topk, block_size, softmax_scale, reduce_q_sums)
    with _one_intra_op_thread():
        return _build_plan(q, k, cu_seqlens, topk, block_size, softmax_scale, reduce_q_sums)


def _send(parts: list, dev: torch.device) -> list:
    """Host int64 arrays -> int64 tensors on ``dev``, with one host-to-device copy."""
    sizes = [p.size for p in parts]
    flat = torch.from_numpy(np.concatenate([np.asarray(p, np.int64).ravel() for p in parts]))
    if dev.type == "cuda":  # pinned + non_blocking: no wait for the work queued on the stream
        flat = flat.pin_memory().to(dev, non_blocking=True)
    elif dev.type != "cpu":
        flat = flat.to(dev)
    return [f.view(np.shape(p)) for f, p in zip(flat.split(sizes), parts)]


class _Sums:
    """Which blocks :func:`_block_sums` sums (host side): ``starts`` ascending, ``lens`` for
    partial blocks (each < B; None: all full). ``host``: the index arrays to send;
    ``dev``: the same on the device, set before :func:`_block_sums` runs."""

    def __init__(self, starts: np.ndarray, B: int, lens: Optional[np.ndarray] = None):
        self.starts, self.lens = starts, lens
        n = len(starts)
        self.run = lens is None and n > 0 and int(starts[-1] - starts[0]) == (n - 1) * B
        if lens is None:  # window ids (block starts)
            self.host = [] if self.run else [starts]
        else:  # token ids, each block padded by repeating its last token (zeroed), and the pad mask
            off = np.arange(B)
            self.host = [starts[:, None] + np.minimum(off, lens[:, None] - 1),
                         (off >= lens[:, None]).astype(np.int64)]
        self.dev: list = []


def _block_sums(x: torch.Tensor, blocks: _Sums, B: int, out: torch.Tensor) -> torch.Tensor:
    """fp32 sums over ``blocks`` of ``x [T, h, D]`` into ``out [n, h, D]``: one sum over
    the block's tokens (a partial block zero padded to B tokens has the same sum as its
    own tokens), the order a per-document ``mean(1)`` sums in."""
    n, (T, h, D), dev = len(blocks.starts), x.shape, out.device
    if n == 0:
        return out
    # Blocks go in batches: on the GPU as many as the budget allows; on the CPU a few MB
    # at a time into reused buffers, so copies stay in cache (a fresh 100 MB buffer
    # costs more in page faults than the sum itself).
    per = min(n, max(1, (_GATHER_BUDGET if dev.type != "cpu" else _CPU_CHUNK) // (B * h * D)))
    # The GPU sums bf16 straight into fp32; the CPU converts to fp32 first, then sums
    convert = x.dtype != torch.float32 and dev.type == "cpu"
    if blocks.run and not convert:  # plain views, nothing to copy
        per = n
    if blocks.lens is None:  # every window of B tokens, as a view: win[s] is the block starting at s
        st = x.stride()
        src = x.as_strided((T - B + 1, B, h, D), (st[0], st[0], st[1], st[2]))
    else:
        tok, pad = blocks.dev
        pad = pad.view(n, B, 1, 1).bool()
    buf = None if blocks.run else x.new_empty((per, B, h, D))
    fbuf = torch.empty((per, B, h, D), device=dev) if convert else None
    for c0 in range(0, n, per):  # chunks of blocks, not documents (one on the GPU, mostly)
        m = min(per, n - c0)
        if blocks.run:
            s0 = int(blocks.starts[0]) + c0 * B
            v = x[s0:s0 + m * B].view(m, B, h, D)
        elif blocks.lens is None:
            v = torch.index_select(src, 0, blocks.dev[0][c0:c0 + m], out=buf[:m])
        else:
            v = torch.index_select(x, 0, tok[c0:c0 + m].view(-1), out=buf[:m].view(m * B, h, D))
            v = v.view(m, B, h, D).masked_fill_(pad[c0:c0 + m], 0)
        if fbuf is not None:
            v = fbuf[:m].copy_(v)
        torch.sum(v, 1, dtype=torch.float32, out=out[c0:c0 + m])
    return out


def _chunks(rows: np.ndarray, cols: np.ndarray, H: int, gpu: bool) -> list:
    """Routing batches: arrays of item ids, items of like width together, each under the budget."""
    if gpu and len(rows) * H * int(rows.max()) * int(cols.max()) <= _GATE_BUDGET:
        return [np.arange(len(rows))]  # one batch: launches cost more than the padding there
    # Items are grouped by ceil(log2(cols)) (all narrow ones together) so padding at most
    # doubles the work, then cut so each padded batch stays under _GATE_BUDGET.
    bucket = np.maximum(np.ceil(np.log2(cols)), 6).astype(np.int64)
    out = []
    for b in np.unique(bucket)[::-1]:
        ids = np.flatnonzero(bucket == b)
        per = max(1, _GATE_BUDGET // (H * int(rows[ids].max()) * int(cols[ids].max())))
        out += [ids[i:i + per] for i in range(0, len(ids), per)]
    return out


_skeletons = TensorCache(MICROBATCHES_CACHED)
"""cu_seqlens tensor, (budget, block, heads, device, minimum) -> _Skeleton."""


@dataclass
class _Skeleton:
    """Everything of a plan that depends on the documents and budgets only, not on q and
    k: built on the host once per micro-batch, uploaded once, reused by every layer."""

    doc_kept: np.ndarray
    """Kept pairs per document over heads (top-k routing; threshold: of the caps)."""
    head_kept: np.ndarray
    """Kept pairs per head (the same for every head; threshold: of the caps)."""
    kv_cnt: torch.Tensor
    """int32 ``[H, NB]`` on the device: the counts of top-k routing (threshold: the caps)."""
    meta_d: torch.Tensor
    kv_template: torch.Tensor
    route: Optional["_RouteHost"]
    sent: list
    causal_pairs: int
    kv_nnz: int
    max_blocks: int
    """Blocks of the longest document."""
    routed: bool
    """Some document has a choice to make (``route`` is None when the fused kernels make it)."""
    pair_w: torch.Tensor
    """int64 ``[NB]`` on the device: ``B * len_b``, kept pairs per kept block besides the diagonal."""
    pair_c: torch.Tensor
    """int64 ``[NB]`` on the device: ``len_b (len_b + 1) / 2 - B * len_b`` (the diagonal's pairs, less one block's)."""
    doc_of: torch.Tensor
    """int64 ``[NB]`` on the device: each block's document."""


def _topk_key(topk: TopK):
    if isinstance(topk, torch.Tensor):  # a budget tensor: by identity and version (held below)
        return ("t", id(topk), topk._version)
    return ("i", int(topk))


def _skeleton(cu_seqlens, topk, B: int, H: int, dev: torch.device,
              kmin: Optional[int] = None, host_route: bool = True) -> _Skeleton:
    """:func:`_build_skeleton`, cached per (cu_seqlens tensor, budget, block, heads, device,
    threshold routing's minimum, host route)."""
    return _skeletons.get(cu_seqlens, (_topk_key(topk), B, H, dev, kmin, host_route),
                          lambda: _build_skeleton(host_cu(cu_seqlens), topk, B, H, dev, kmin, host_route),
                          hold=topk)  # a budget tensor is keyed by its id: keep it alive


_MEMO_SIZE = 4096
"""Plans kept for a recomputation at most (layers x micro-batches in flight)."""
_memo: dict = {}
"""slot -> (owner weakref, cu_seqlens, budget key, plan): forward plans awaiting their recompute."""
_slot: contextvars.ContextVar = contextvars.ContextVar("sparsebalance_plan_slot", default=None)


@contextlib.contextmanager
def plan_slot(owner, layer: int, mode: Optional[str]) -> Iterator[None]:
    """Inside the block, :func:`build_plan` keeps (``mode="store"``: an activation-checkpointed
    forward) or takes back (``"reuse"``: its recomputation in backward) the plan of
    ``(owner, layer)``, so a recomputed layer attends to exactly the blocks its forward
    chose without routing again. ``owner``: the micro-batch's packed params (held weakly);
    ``mode=None``: no memo."""
    token = _slot.set(None if mode is None else (id(owner), int(layer), mode, weakref.ref(owner)))
    try:
        yield
    finally:
        _slot.reset(token)


_sink: contextvars.ContextVar = contextvars.ContextVar("sparsebalance_plan_sink", default=None)


@contextlib.contextmanager
def collect_plans() -> Iterator[list]:
    """Every plan :func:`build_plan` returns inside the block is appended to the yielded
    list (the attention module reads per-document kept pairs from it)."""
    got: list = []
    token = _sink.set(got)
    try:
        yield got
    finally:
        _sink.reset(token)


def _memo_plan(cu_seqlens, topk, compute: Callable[[], RoutingPlan]) -> RoutingPlan:
    slot = _slot.get()
    if slot is None:
        return compute()
    key, mode, ref = slot[:2], slot[2], slot[3]
    if mode == "reuse":
        got = _memo.pop(key, None)
        same = got is not None and got[0]() is ref() and got[1] is cu_seqlens
        if same and got[2] == (_topk_key(topk), current_rule()):
            return got[3]
        return compute()
    plan = compute()
    _memo[key] = (ref, cu_seqlens, (_topk_key(topk), current_rule()), plan)
    while len(_memo) > _MEMO_SIZE:  # a forward whose recompute never came (an aborted step)
        del _memo[next(iter(_memo))]
    return plan


def _build_plan(q, k, cu_seqlens, topk, block_size, softmax_scale, reduce_q_sums=None) -> RoutingPlan:
    """Per layer: the cached skeleton of these documents and budgets, then the gates and
    the top-k choice on the device (no host work, no host sync on a cache hit); a
    recomputed layer takes its forward's plan (:func:`plan_slot`)."""
    plan = _memo_plan(cu_seqlens, topk, lambda: _route(q, k, cu_seqlens, topk, block_size,
                                                       softmax_scale, reduce_q_sums))
    sink = _sink.get()
    if sink is not None:
        sink.append(plan)
    return plan


_ROUTES = ("auto", "fused", "torch")
FUSED_MAX_BLOCKS = 8192
"""Most blocks one document may have for the fused route (a row's gates sit in one
Triton program's registers); a micro-batch with a longer one takes the torch route."""


def fused_route(device: torch.device) -> bool:
    """Whether routing (top-k or threshold) on ``device`` runs as the Triton kernels of
    :mod:`~sparsebalance.ops.route_kernels` instead of torch ops: ``$SPARSEBALANCE_ROUTE``
    ``auto`` (default: on CUDA with triton), ``fused`` (also on CPU tensors, through
    Triton's interpreter: tests) or ``torch``."""
    mode = os.environ.get("SPARSEBALANCE_ROUTE") or "auto"
    if mode not in _ROUTES:
        raise ValueError(f"SPARSEBALANCE_ROUTE must be one of {', '.join(_ROUTES)}, got {mode!r}")
    if mode == "auto":
        if _fused_state["off"] is not None:
            return False
        if not _triton_found:
            _triton_found.append(importlib.util.find_spec("triton") is not None)
        return device.type == "cuda" and _triton_found[0]
    return mode == "fused"


_triton_found: list = []
_fused_state = {"worked": False, "off": None}
"""``worked``: a fused launch succeeded in this process; ``off``: why ``auto`` turned the
fused route off (its first launch failed), or None."""


_route_width = {"blocks": 0}
"""The fused gate's least row width in blocks (:func:`set_route_width`); 0: none."""


def set_route_width(blocks: int) -> None:
    """Make every fused routing launch of this process at least ``blocks`` wide (the
    driver sets ``--seq-length / block size``: the widest micro-batch it packs). The gate
    kernels compile once per power of two of the row width; taking it from each
    micro-batch's own length compiled again in the first shorter micro-batch after step 2
    (Run 7 at 128K). A wider row is masked, never wrong; over
    :data:`FUSED_MAX_BLOCKS` the hint is ignored."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        raise ValueError(f"blocks must be an int >= 0, got {blocks!r}")
    _route_width["blocks"] = blocks


def route_used() -> str:
    """How plans were routed in this process: ``fused`` (a fused launch ran),
    ``torch``, or ``torch (fused off: why)`` after :func:`run_fused` turned it off."""
    if _fused_state["off"] is not None:
        return f"torch (fused off: {_fused_state['off']})"
    return "fused" if _fused_state["worked"] else "torch"


def run_fused(fn: Callable, *args):
    """``fn(*args)`` (a launcher of :mod:`~sparsebalance.ops.route_kernels`). Under
    ``SPARSEBALANCE_ROUTE=auto``, if the first fused launch of the process fails (a
    Triton that cannot compile the kernels), routing warns once and stays on torch ops
    from then on (returns None); ``fused`` forced, or any later failure, raises."""
    try:
        out = fn(*args)
    except Exception as exc:  # the compiler's errors have no common base class
        if _fused_state["worked"] or (os.environ.get("SPARSEBALANCE_ROUTE") or "auto") != "auto":
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        _fused_state["off"] = f"{type(exc).__name__}: {first}"
        warnings.warn(f"fused routing failed on its first launch ({_fused_state['off']}); "
                      "routing by torch ops from here on (SPARSEBALANCE_ROUTE=torch silences this)")
        return None
    _fused_state["worked"] = True
    return out


def _route(q, k, cu_seqlens, topk, block_size, softmax_scale, reduce_q_sums=None) -> RoutingPlan:
    rule = current_rule()
    thr = rule.threshold
    kmin = None if thr is None else rule.topk_min
    fused = reduce_q_sums is None and fused_route(q.device)
    sk = _skeleton(cu_seqlens, topk, int(block_size), q.shape[1], q.device, kmin, host_route=not fused)
    kv_cnt = sk.kv_cnt  # the budget's counts; threshold routing writes its own
    kv_idx = None
    if sk.routed and sk.route is None:  # the fused kernels make the choice, every row written
        from sparsebalance.ops import route_kernels

        # the gate row's width from the micro-batch's length, not its longest document, so
        # micro-batches of one packed length share one compiled kernel
        width = -(-q.shape[0] // int(block_size))
        if width < _route_width["blocks"] <= FUSED_MAX_BLOCKS:
            width = _route_width["blocks"]
        m = sk.meta_d
        args = (q, k, m[0], m[1], m[2], m[3], m[4], sk.kv_template.shape[2],
                width if width <= FUSED_MAX_BLOCKS else sk.max_blocks, int(block_size), float(softmax_scale))
        if thr is None:
            kv_idx = run_fused(route_kernels.route_rows, *args)
        else:
            got = run_fused(route_kernels.threshold_rows, *args, float(thr), rule.topk_min, rule.per_head)
            if got is not None:
                kv_idx, kv_cnt = got
        if kv_idx is None:  # the fused route turned itself off: the torch route's skeleton
            sk = _skeleton(cu_seqlens, topk, int(block_size), q.shape[1], q.device, kmin)
    if kv_idx is None:
        kv_idx = sk.kv_template.clone()
        if sk.route:
            kv_cnt = kv_cnt if thr is None else kv_cnt.clone()
            sk.route.run(q, k, kv_idx, sk.sent[1:], float(softmax_scale), reduce_q_sums,
                         kv_cnt=kv_cnt, rule=rule)
    if thr is not None and sk.routed:  # the counts were chosen on the device: they stay there
        kept = KeptPairs(device=_device_kept(kv_cnt, sk), n_docs=len(sk.doc_kept))
    else:
        kept = KeptPairs(doc=sk.doc_kept, head=sk.head_kept, nnz=sk.kv_nnz)
    return RoutingPlan(block_size=int(block_size), qb_start=sk.meta_d[0], qb_len=sk.meta_d[1], kv_idx=kv_idx,
                       kv_cnt=kv_cnt, causal_pairs=sk.causal_pairs, kept=kept, doc_end=sk.meta_d[6])


def _device_kept(kv_cnt: torch.Tensor, sk: "_Skeleton") -> torch.Tensor:
    """int64 ``[n_docs + 2H]`` on the device (:class:`~sparsebalance.ops.kept.KeptPairs`):
    kept pairs per document and per head, each head's valid entries, from ``kv_cnt [H, NB]``
    (block ``b`` keeping ``c`` blocks holds ``(c - 1) * B * len_b + len_b (len_b + 1) / 2``
    pairs: the skeleton's ``pair_w`` and ``pair_c``)."""
    per_block = kv_cnt.long() * sk.pair_w + sk.pair_c  # [H, NB]
    per_doc = torch.zeros(len(sk.doc_kept), dtype=torch.int64, device=kv_cnt.device)
    per_doc.index_add_(0, sk.doc_of, per_block.sum(0))
    return torch.cat([per_doc, per_block.sum(1), kv_cnt.sum(1, dtype=torch.int64)])


def _build_skeleton(cu: np.ndarray, topk, B: int, H: int, dev: torch.device,
                    kmin: Optional[int] = None, host_route: bool = True) -> _Skeleton:
    """``kmin`` None: top-k routing (the counts are known here). An int: threshold routing
    with that minimum; rows with more than ``min(kmin, topk)`` candidates are routed on
    the device, which sets their counts (the ones here are the caps). ``host_route``
    False: no :class:`_RouteHost` (the fused kernels route), unless a document is longer
    than they take."""
    # Per-block metadata is O(blocks): numpy on the host, from cu_seqlens.
    starts, lens = cu[:-1], np.diff(cu)
    n_docs = len(lens)
    kd = per_doc_topk(topk, n_docs).numpy()
    nb = (lens + B - 1) // B  # blocks per document
    NB = int(nb.sum())
    doc_of = np.repeat(np.arange(n_docs), nb)
    first_block = np.cumsum(nb) - nb  # global id of each document's block 0
    fb_of = first_block[doc_of]
    i_in_doc = np.arange(NB) - fb_of
    qb_start = starts[doc_of] + i_in_doc * B
    qb_len = np.minimum(lens[doc_of] - i_in_doc * B, B)
    # kept blocks per query block: diagonal, sink (if i > 0) and min(topk, i - 1).
    kv_cnt = 1 + (i_in_doc > 0) + np.minimum(kd[doc_of], np.maximum(i_in_doc - 1, 0))
    W = int(kv_cnt.max()) if NB else 1
    full = (kv_cnt - 1) * B * qb_len + qb_len * (qb_len + 1) // 2
    kr = kd if kmin is None else np.minimum(kd, kmin)  # rows past kr + 1 make a choice
    sel = np.flatnonzero(nb > kr + 2)  # documents with a real choice
    max_blocks = int(nb.max()) if n_docs else 0
    route = None
    if len(sel) and (host_route or max_blocks > FUSED_MAX_BLOCKS):
        route = _RouteHost(sel, nb, kd, kr, first_block, qb_start, qb_len, doc_of, i_in_doc, H, B,
                           dev.type != "cpu")

    # Everything the device needs from the host, in one copy.
    meta = np.stack([qb_start, qb_len, kv_cnt, fb_of, i_in_doc, doc_of, fb_of + nb[doc_of]])
    sent = _send([meta] + (route.host() if route else []), dev)
    meta_d = sent[0].to(torch.int32)
    # Default rows (all of blocks 0..i kept) are exact wherever i <= topk + 1.
    e = torch.arange(W, device=dev, dtype=torch.int32)
    fb_d, i_d = meta_d[3].view(-1, 1), meta_d[4].view(-1, 1)
    kv_template = torch.where(e <= i_d, fb_d + e, -1).unsqueeze(0).expand(H, NB, W).contiguous()
    doc_kept = np.bincount(doc_of, weights=full, minlength=n_docs).astype(np.int64) * H
    ql = sent[0][1]
    return _Skeleton(doc_kept=doc_kept, meta_d=meta_d, kv_template=kv_template, route=route, sent=sent,
                     pair_w=ql * B, pair_c=ql * (ql + 1) // 2 - ql * B, doc_of=sent[0][5],
                     causal_pairs=int((lens * (lens + 1) // 2).sum()) * H, kv_nnz=int(kv_cnt.sum()),
                     max_blocks=max_blocks, routed=len(sel) > 0,
                     kv_cnt=meta_d[2].view(1, NB).expand(H, NB).contiguous(),
                     head_kept=np.full(H, int(full.sum()), dtype=np.int64))


class _RouteHost:
    """The top-k choice of the documents ``sel``: host-side index arrays, then the device work."""

    def __init__(self, sel, nb, kd, kr, first_block, qb_start, qb_len, doc_of, i_in_doc, H, B, gpu):
        self.B = B
        NB = len(doc_of)
        # fp32 block means (sum over the block's tokens, then / length, as a per-document
        # mean takes them, so gates are bit for bit those of the per-document reference in
        # tests/ops/test_plan.py): q of the routed rows
        # (blocks kd + 2 .. n - 1, the last maybe partial), k of the candidates (blocks
        # 1 .. n - 2, all full).
        is_sel = np.zeros(len(nb), bool)
        is_sel[sel] = True
        is_sel = is_sel[doc_of]
        qfull = np.flatnonzero(is_sel & (i_in_doc >= kr[doc_of] + 2) & (qb_len == B))
        qpart = np.flatnonzero(is_sel & (qb_len < B))  # partial blocks are never candidates
        kfull = np.flatnonzero(is_sel & (i_in_doc >= 1) & (i_in_doc <= nb[doc_of] - 2))
        qslot = np.zeros(NB, np.int64)  # global block id -> row of the q means
        qslot[qfull] = np.arange(len(qfull))
        qslot[qpart] = len(qfull) + np.arange(len(qpart))
        kslot = np.zeros(NB, np.int64)  # global block id -> row of the k means
        kslot[kfull] = np.arange(len(kfull))
        self.qsums = _Sums(qb_start[qfull], B)
        self.psums = _Sums(qb_start[qpart], B, qb_len[qpart])
        self.ksums = _Sums(qb_start[kfull], B)
        self.plen = qb_len[qpart]

        # Work items: row ranges [i0, i1) of one document (a huge document is cut in several
        # so one item fits the budget); an item's gate columns are its blocks 0 .. i1 - 2
        # (block 0 is never a candidate but keeps the GEMM shaped as it was per document).
        n_s, k_s, fb_s, kr_s = nb[sel], kd[sel], first_block[sel], kr[sel]
        r0 = kr_s + 2  # first query block with a real choice
        per = np.maximum(_GATE_BUDGET // (H * (n_s - 1)), 1)
        nseg = (n_s - r0 + per - 1) // per
        it = np.repeat(np.arange(len(sel)), nseg)
        seg = np.arange(len(it)) - (np.cumsum(nseg) - nseg)[it]
        i0 = r0[it] + seg * per[it]
        i1 = np.minimum(i0 + per[it], n_s[it])
        rows, cols, kk, fb, kl = i1 - i0, i1 - 1, k_s[it], fb_s[it], kr_s[it]
        self.batches = []
        for ids in _chunks(rows, cols, H, gpu):
            R, C = int(rows[ids].max()), int(cols[ids].max())
            a = np.arange(R)
            qrow = qslot[fb[ids, None] + np.minimum(i0[ids, None] + a, i1[ids, None] - 1)]
            # column 0 (the sink, never a candidate) and padding read block 1's k mean
            kcol = kslot[fb[ids, None] + np.maximum(np.minimum(np.arange(C), cols[ids, None] - 1), 1)]
            src = np.flatnonzero(a < rows[ids, None])  # padded (item, row) -> written rows
            dst = (fb[ids, None] + i0[ids, None] + a).ravel()[src]
            info = np.stack([i0[ids], rows[ids], kk[ids], fb[ids], kl[ids]])
            # a cap past the item's own candidates (threshold rows) keeps them all
            kmax = int(np.minimum(kk[ids], cols[ids] - 1).max())
            self.batches.append((len(ids), R, C, kmax, int(kk[ids].min()) == kmax,
                                 [qrow, kcol, src, dst, info]))

    def host(self) -> list:
        out = self.qsums.host + self.psums.host + self.ksums.host + [self.plen[:, None, None]]
        for *_, arrays in self.batches:
            out += arrays
        return out

    def run(self, q, k, kv_idx, sent: list, scale: float, reduce_q_sums=None,
            kv_cnt: Optional[torch.Tensor] = None, rule: Optional["RoutingRule"] = None) -> None:
        """Overwrite the routed rows of ``kv_idx [H, NB, W]`` (device ops only); threshold
        routing (``rule.threshold`` set) also writes their counts into ``kv_cnt [H, NB]``."""
        threshold = None if rule is None else rule.threshold
        dev, B = q.device, self.B
        H, hkv, D = q.shape[1], k.shape[1], q.shape[2]
        W = kv_idx.shape[2]
        for s in (self.qsums, self.psums, self.ksums):
            s.dev, sent = sent[:len(s.host)], sent[len(s.host):]
        plen, sent = sent[0], sent[1:]
        nf, npart = len(self.qsums.starts), len(self.psums.starts)
        qm = torch.empty((nf + npart, H, D), dtype=torch.float32, device=dev)
        _block_sums(q, self.qsums, B, qm[:nf])
        if npart:
            _block_sums(q, self.psums, B, qm[nf:])
        if reduce_q_sums is not None:
            reduce_q_sums(qm)
        qm[:nf].div_(B)
        if npart:
            qm[nf:].div_(plen)
        qm.mul_(scale)
        km = torch.empty((len(self.ksums.starts), hkv, D), dtype=torch.float32, device=dev)
        _block_sums(k, self.ksums, B, km).div_(B)
        rep = H // hkv
        for c, R, C, kmax, uniform, _ in self.batches:
            (qrow, kcol, src, dst, info), sent = sent[:5], sent[5:]
            qg = qm.index_select(0, qrow.view(-1)).view(c, R, H, D)
            kg = km.index_select(0, kcol.view(-1)).view(c, C, hkv, D)
            if rep > 1:  # kv head of q head h: h // rep
                kg = kg.unsqueeze(3).expand(c, C, hkv, rep, D).reshape(c, C, H, D)
            g = torch.einsum("sihd,sjhd->hsij", qg, kg)  # [H, c, R, C]
            del qg, kg
            info = info.to(torch.int32)
            i0, nrows, kk, fb, kl = (t.view(1, c, 1, 1) for t in info)
            i_abs = i0 + torch.arange(R, device=dev, dtype=torch.int32).view(1, 1, R, 1)  # [1, c, R, 1]
            j = torch.arange(C, device=dev, dtype=torch.int32)
            g.masked_fill_((j < 1) | (j >= i_abs) | (i_abs >= i0 + nrows), float("-inf"))
            keep = kk  # blocks chosen per row besides sink and diagonal
            if threshold is not None:  # clamped to kmax for the padding rows
                keep = _threshold_counts(g, threshold, kl, kk, i_abs - 1, rule.per_head).clamp_(max=kmax)
            if kmax == 0:
                ch = torch.empty((H, c, R, 0), dtype=torch.int32, device=dev)
            elif threshold is None:
                ch = _select_rows(g, kmax if uniform else kk.long(), kmax).to(torch.int32)
            else:
                ch = _select_rows(g, keep.long(), kmax).to(torch.int32)
            del g
            # each row: sink, chosen ascending, diagonal, -1 padding
            out = torch.full((H, c, R, W), -1, dtype=torch.int32, device=dev)
            out[..., 0] = fb[..., 0]
            out[..., 1:1 + kmax] = torch.where(ch >= 0, ch + fb, -1)
            out.scatter_(-1, (keep + 1).long().expand(H, c, R, 1), (fb + i_abs).expand(H, c, R, 1))
            kv_idx[:, dst] = out.view(H, c * R, W)[:, src]
            if threshold is not None:  # keep: [H or 1, c, R, 1]
                kv_cnt[:, dst] = (keep + 2).to(kv_cnt.dtype).expand(H, c, R, 1).reshape(H, c * R)[:, src]


def _threshold_counts(g: torch.Tensor, tau: float, kmin: torch.Tensor, kmax: torch.Tensor,
                      ncand: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """Threshold routing's count per row of gates ``g [H, ..., C]`` (``-inf`` where a
    column is not a candidate): the smallest ``c`` whose top ``c`` candidates hold at
    least ``tau`` of the head's softmax over the candidates (``per_head`` False: the
    largest such ``c`` over the heads), clamped to ``[kmin, kmax]`` and to the ``ncand``
    candidates. Returns int32 ``[H, ..., 1]`` (``per_head`` False: ``[1, ..., 1]``)."""
    p = torch.softmax(g, dim=-1).nan_to_num_(0.0)  # rows without candidates: padding rows
    mass = p.sort(dim=-1, descending=True).values.cumsum_(-1)
    c = (mass < tau).sum(-1, keepdim=True, dtype=torch.int32) + 1
    if not per_head:
        c = c.amax(0, keepdim=True)
    hi = torch.minimum(kmax, ncand.clamp(min=0))
    return torch.minimum(torch.maximum(c, torch.minimum(kmin, hi)), hi).to(torch.int32)


@torch.no_grad()
def reverse_index(plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (head, key block), the query blocks that keep it (CSR form).

    Used by the GPU backward kernels that own one key block each (no atomics).

    Returns:
        ``rev_ptr`` int32 ``[H, NB + 1]`` (offsets into ``rev_q`` for each head's row,
        relative to that head's segment) and ``rev_q`` int32 ``[H, NNZ]`` query block
        ids sorted by key block then query block. NNZ is the most valid entries of any
        head (``plan.kv_nnz``); a head with fewer (per-head threshold counts) has its
        row padded with 0 past ``rev_ptr[h, NB]``, never read.
    """
    H, NB, W = plan.kv_idx.shape
    kt = torch.int32 if NB * NB + NB < 2 ** 31 else torch.int64  # int32 keys sort faster
    kv = plan.kv_idx.to(kt)
    valid = kv >= 0
    qb = torch.arange(NB, device=kv.device, dtype=kt).view(1, NB, 1).expand(H, NB, W)
    nnz = plan.kv_nnz if plan.kv_nnz is not None else int(valid.sum((1, 2)).max())
    pad = NB * NB + NB  # sorts last; its key block NB + 1 lands in a dropped count
    keys = torch.where(valid, kv * NB + qb, pad)
    keys = torch.sort(keys.reshape(H, -1), dim=-1).values[:, :nnz]
    rev_q = torch.where(keys < pad, keys % NB, 0).to(torch.int32)
    kb = (keys // NB).long()
    counts = torch.zeros((H, NB + 2), dtype=torch.int64, device=kv.device)
    counts.scatter_add_(1, kb, torch.ones_like(kb))
    rev_ptr = torch.zeros((H, NB + 1), dtype=torch.int64, device=kv.device)
    rev_ptr[:, 1:] = torch.cumsum(counts[:, :NB], 1)
    return rev_ptr.to(torch.int32), rev_q.contiguous()


def default_scale(head_dim: int, softmax_scale: Optional[float]) -> float:
    """``softmax_scale`` or ``1 / sqrt(head_dim)``."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
