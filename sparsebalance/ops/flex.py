"""The ``flex`` backend: the routing plan run by PyTorch's FlexAttention.

The selection is :func:`~sparsebalance.ops.plan.build_plan`'s, the one every backend
uses; this file only turns it into FlexAttention's inputs.

Layout. Our blocks are document-local (block ``i`` of a document starts ``i * B``
tokens after the document's first token); FlexAttention's blocks are aligned over the
sequence. The tokens are therefore gathered into a buffer where the plan's global block
``b`` fills rows ``[b * B, (b + 1) * B)``: every document starts on a block boundary and
its last block is zero padded. The buffer is then padded to a *bucket* of blocks (8
sizes per octave, :func:`bucket_blocks`), so that shapes take few distinct values.
:func:`padding_ratio` gives the cost of both paddings (buffer rows / real tokens).

Mask. Query block ``b`` keeps the key blocks ``kv_idx[h, b, :kv_cnt[b]]``, the diagonal
last. Every kept block before the diagonal lies in the same document and holds ``B``
real tokens (only a document's last block can be short, and it is never a candidate),
so it is a FlexAttention *full* block: no mask inside. The diagonal is the one *partial*
block, masked causally (``q >= kv`` in buffer rows; a short block's padding keys sit
after all of its real queries). A block never holds two documents, so no document mask
is needed. Bucket padding blocks keep their own diagonal (zero keys: finite rows, which
are discarded).

Compilation. On CUDA ``flex_attention`` runs through one ``torch.compile`` callable
(``dynamic=False``). The index tensors have full width (the bucket's block count) and
the token count is the bucket's, so a step with new budgets or new documents in the same
bucket reuses the compiled kernels; :func:`compile_count` counts the graphs compiled by
our calls so a test can fail on a recompilation. A compiled call also reuses a bucket it
compiled before when that costs at most :data:`REUSE_PAD` x the blocks it needs (padding
blocks cost one diagonal block each): SAB packs micro-batches of unequal token counts,
which would otherwise reach a new bucket, and compile for tens of seconds, every few
steps (measured on an H200, docs/gpu.md).

Layout cache. The layout depends only on ``cu_seqlens`` and the block size, and every
layer of a micro-batch gets the same ``cu_seqlens`` tensor: the last layout is kept
(:class:`~sparsebalance.ops.plan.TensorCache`) and reused while that tensor object is
unchanged (same object, same in-place version), so
its host copy and index upload happen once per micro-batch, not once per layer.

Eager (the CPU). Eager ``flex_attention`` applies the ``mask_mod`` to every score (it
materialises them) and ignores the block lists, so the eager path's ``mask_mod`` also
looks up the kept blocks. FlexAttention has no CPU backward: on the CPU this backend is
forward only.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from sparsebalance.ops.plan import RoutingPlan, TensorCache, TopK, build_plan, host_cu

_compiled: dict = {}
_compiles = 0
_buckets_used: dict = {}
"""(block size, device type) -> padded block counts compiled calls have used."""
_layout_cache = TensorCache(1)
"""cu_seqlens tensor, (block size, device, reuse, bucket) -> FlexLayout: the last one."""
REUSE_PAD = 4.0
"""A compiled bucket is reused for a batch needing at least 1 / REUSE_PAD of its blocks: a
padding block costs one diagonal block of compute and its rows of the gather, against
tens of seconds of compilation for a new shape."""


def bucket_blocks(n: int) -> int:
    """Smallest ``m * 2**e >= n`` with ``8 <= m < 16`` (``n`` itself below 16): at most
    1/8 more blocks than ``n``, and few distinct values, so few compilations."""
    if n <= 16:
        return max(int(n), 1)
    step = 1 << (int(n).bit_length() - 4)
    return -(-int(n) // step) * step


@dataclass
class FlexLayout:
    """Where each token sits in the block-aligned buffer."""

    block_size: int
    """B, tokens per block (the routing block)."""
    tokens: int
    """T, real tokens."""
    blocks: int
    """The plan's block count (sum over documents of ceil(L / B))."""
    padded_blocks: int
    """:func:`bucket_blocks` of ``blocks``: the buffer's block count."""
    pos: torch.Tensor
    """int64 ``[T]``: buffer row of each token."""
    src: torch.Tensor
    """int64 ``[padded_blocks * B]``: token of each buffer row, ``T`` for padding."""

    @property
    def padded_tokens(self) -> int:
        """Buffer rows (tokens after both paddings)."""
        return self.padded_blocks * self.block_size

    @property
    def padding_ratio(self) -> float:
        """Buffer rows / real tokens (>= 1)."""
        return self.padded_tokens / self.tokens if self.tokens else 1.0


def _host_layout(cu_seqlens: torch.Tensor, block_size: int):
    cu = host_cu(cu_seqlens)
    lens = np.diff(cu)
    nb = (lens + block_size - 1) // block_size
    return cu, lens, nb, int(nb.sum())


def padding_ratio(cu_seqlens: torch.Tensor, block_size: int) -> float:
    """Rows of the flex buffer / real tokens for these documents (1.0 = no padding)."""
    cu, _, _, NB = _host_layout(cu_seqlens, block_size)
    T = int(cu[-1])
    return bucket_blocks(NB) * block_size / T if T else 1.0


def reused_bucket(blocks: int, key) -> int:
    """The padded block count of a compiled call needing ``blocks``: the smallest bucket
    used before under ``key`` that holds them within :data:`REUSE_PAD`, else their own
    :func:`bucket_blocks` (recorded for the next calls)."""
    own = bucket_blocks(blocks)
    used = _buckets_used.setdefault(key, set())
    fits = [b for b in used if own <= b <= REUSE_PAD * max(blocks, 1)]
    if fits:
        return min(fits)
    used.add(own)
    return own


def reset_buckets() -> None:
    """Forget the buckets used so far and the cached layout (tests)."""
    _buckets_used.clear()
    _layout_cache.clear()


def flex_layout(cu_seqlens: torch.Tensor, block_size: int, device: torch.device,
                reuse: bool = False, bucket: bool = True) -> FlexLayout:
    """The block-aligned buffer of these documents, index tensors on ``device``.
    ``reuse``: pad to a bucket used before when it fits (:func:`reused_bucket`; the
    compiled path), else to this batch's own bucket. ``bucket=False``: no bucket padding
    (the buffer is exactly the blocks; the fa4 backend, whose kernels take any length)."""
    cu, lens, nb, NB = _host_layout(cu_seqlens, block_size)
    T, B = int(cu[-1]), int(block_size)
    first_block = np.cumsum(nb) - nb
    pos = np.arange(T, dtype=np.int64) + np.repeat(first_block * B - cu[:-1], lens)
    if not bucket:
        NBp = max(NB, 1)
    else:
        NBp = reused_bucket(NB, (B, torch.device(device).type)) if reuse else bucket_blocks(NB)
    src = np.full(NBp * B, T, dtype=np.int64)
    src[pos] = np.arange(T)
    both = torch.from_numpy(np.concatenate([pos, src])).to(device)
    return FlexLayout(B, T, NB, NBp, both[:T], both[T:])


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _kept_and_causal(keep: torch.Tensor, B: int) -> Callable:
    """mask_mod of the eager path: block kept (``keep [H, NBp, NBp]``) and causal."""

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[h, q_idx // B, kv_idx // B] & (q_idx >= kv_idx)

    return mask_mod


def flex_block_mask(plan: RoutingPlan, layout: FlexLayout, exact_mask_mod: bool = False):
    """The FlexAttention ``BlockMask`` of ``plan`` over ``layout``'s buffer.

    Full blocks: the kept blocks before the diagonal; partial: the diagonal. Both index
    tensors are ``[1, H, NBp, NBp]`` int32 (full width, so their shape depends only on
    the bucket). ``exact_mask_mod``: the mask_mod also checks the kept blocks (eager
    flex_attention applies only the mask_mod).
    """
    from torch.nn.attention.flex_attention import BlockMask

    H, NB, W = plan.kv_idx.shape
    NBp, B, dev = layout.padded_blocks, plan.block_size, plan.kv_idx.device
    i32 = dict(dtype=torch.int32, device=dev)
    full_n = torch.zeros((1, H, NBp), **i32)
    full_n[0, :, :NB] = plan.kv_cnt.to(**i32) - 1  # [H, NB]: per head
    full_i = torch.zeros((1, H, NBp, NBp), **i32)
    if W > 1:  # entries past a row's count (its diagonal, the -1 padding) are not read
        full_i[0, :, :NB, :W - 1] = plan.kv_idx[:, :, :W - 1].clamp(min=0)
    part_n = torch.ones((1, H, NBp), **i32)
    part_i = torch.zeros((1, H, NBp, NBp), **i32)
    part_i[0, :, :, 0] = torch.arange(NBp, **i32)
    mask_mod = _causal
    if exact_mask_mod:
        keep = torch.zeros((H, NBp, NBp + 1), dtype=torch.bool, device=dev)
        idx = plan.kv_idx.long().masked_fill(plan.kv_idx < 0, NBp)
        keep[:, :NB].scatter_(-1, idx, True)
        keep = keep[..., :NBp].contiguous()
        pad = torch.arange(NB, NBp, device=dev)
        keep[:, pad, pad] = True
        mask_mod = _kept_and_causal(keep, B)
    Tp = layout.padded_tokens
    return BlockMask.from_kv_blocks(part_n, part_i, full_n, full_i, BLOCK_SIZE=B,
                                    mask_mod=mask_mod, seq_lengths=(Tp, Tp))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_count() -> int:
    """Graphs torch.compile built during this process's compiled flex calls."""
    return _compiles


def _compiled_flex(block_size: int, device: torch.device, dtype: torch.dtype) -> Callable:
    """The compiled ``flex_attention`` for this block size and dtype.

    Inductor compiles one default tile config per kernel unless autotuning. On Hopper its
    16-bit backward default uses 128-wide tiles, which must divide the block (fp32's
    default is 16-wide), so a 16-bit block under 128 tokens on CUDA compiles with
    autotuning (whose config list has 32- and 64-wide tiles; slower to compile, once per
    shape bucket). ``SPARSEBALANCE_FLEX_MAX_AUTOTUNE=1`` forces it everywhere.
    """
    from torch.nn.attention.flex_attention import flex_attention

    tune = (device.type == "cuda" and block_size < 128 and dtype in (torch.bfloat16, torch.float16)) \
        or os.environ.get("SPARSEBALANCE_FLEX_MAX_AUTOTUNE") == "1"
    mode = "max-autotune-no-cudagraphs" if tune else None
    if mode not in _compiled:
        _compiled[mode] = torch.compile(flex_attention, dynamic=False, mode=mode)
    return _compiled[mode]


_RECOMPILE_LIMIT = 64
"""Compiled shapes allowed per process (one per bucket, dtype and head count)."""


@contextlib.contextmanager
def _no_silent_eager(compiled: bool) -> Iterator[None]:
    """Past dynamo's recompile limit a compiled function silently runs eagerly, and eager
    flex_attention ignores the block lists the compiled path relies on (its mask_mod is
    only causal): that would be dense attention. Raise the limit to one bucket per shape
    seen, and make hitting it an error instead of a wrong answer."""
    if not compiled:
        yield
        return
    import torch._dynamo.config as dc

    # names of torch >= 2.7; an older dynamo keeps its defaults (cache_size_limit: 8)
    opts = {k: v for k, v in (("recompile_limit", max(getattr(dc, "recompile_limit", 0), _RECOMPILE_LIMIT)),
                              ("fail_on_recompile_limit_hit", True)) if hasattr(dc, k)}
    with dc.patch(**opts):
        yield


def _kernel_options(block_size: int, compiled: bool) -> Optional[dict]:
    """Forward tiles for short blocks: they must divide the block (Inductor raises
    otherwise; its Hopper default is 128 query rows) and be powers of two >= 16 (Triton's
    dot). Raises ValueError for a block size no such tile divides."""
    if not compiled:
        return None
    t = block_size & -block_size  # the largest power of two dividing the block
    if t < 16:
        raise ValueError(f"backend 'flex' (compiled) needs a block size divisible by 16, got {block_size}")
    return None if block_size % 128 == 0 else {"fwd_BLOCK_M": min(t, 64), "fwd_BLOCK_N": min(t, 64)}


def flex_prepare(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, topk: TopK,
                 block_size: int, scale: float, compiled: bool):
    """Routing and everything FlexAttention needs before the kernel: ``(plan, layout, mask)``."""
    plan = build_plan(q, k, cu_seqlens, topk, block_size, scale)
    layout = cached_layout(cu_seqlens, block_size, q.device, reuse=compiled)
    return plan, layout, flex_block_mask(plan, layout, exact_mask_mod=not compiled)


def cached_layout(cu_seqlens: torch.Tensor, block_size: int, device: torch.device,
                  reuse: bool, bucket: bool = True) -> FlexLayout:
    """:func:`flex_layout`, reused while ``cu_seqlens`` is the same tensor object with the
    same in-place version (the layers of one micro-batch); the cache holds that tensor, so
    its memory cannot be handed to another tensor meanwhile."""
    key = (int(block_size), torch.device(device), bool(reuse), bool(bucket))
    return _layout_cache.get(cu_seqlens, key,
                             lambda: flex_layout(cu_seqlens, block_size, device, reuse=reuse, bucket=bucket))


def flex_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: FlexLayout, mask,
             scale: float, compiled: bool) -> torch.Tensor:
    """``q [T, H, D]``, ``k, v [T, Hkv, D]`` through the buffer and FlexAttention:
    ``out [T, H, D]``, differentiable in q, k, v (compiled only: no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiles
    Tp, idx = layout.padded_tokens, layout.src

    def to_buffer(x):  # [T, h, D] -> [1, h, Tp, D]; row T of the source is zeros
        x = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
        return x.index_select(0, idx).view(Tp, x.shape[1], x.shape[2]).permute(1, 0, 2).unsqueeze(0)

    fn = _compiled_flex(layout.block_size, q.device, q.dtype) if compiled else flex_attention
    if expand_kv() and k.shape[1] != q.shape[1]:
        # K/V repeated to the query heads: the backward's dk/dv kernel then owns one query
        # head per program instead of looping over the group (the sink x GQA floor, docs/gpu.md)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    before = _graphs() if compiled else 0
    with warnings.catch_warnings(), _no_silent_eager(compiled):
        # eager is deliberate on the CPU path, not a missed compile
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(to_buffer(q), to_buffer(k), to_buffer(v), block_mask=mask, scale=scale,
                 enable_gqa=q.shape[1] != k.shape[1],
                 kernel_options=_kernel_options(layout.block_size, compiled))
    if compiled:
        _compiles += _graphs() - before
    return out[0].permute(1, 0, 2).index_select(0, layout.pos)


def expand_kv() -> bool:
    """``SPARSEBALANCE_FLEX_EXPAND_KV=1``: flex gets K/V expanded to the query heads (a
    measurement of the GQA backward floor; same results, more K/V memory)."""
    return os.environ.get("SPARSEBALANCE_FLEX_EXPAND_KV") == "1"


def use_compiled(device: torch.device) -> bool:
    """Compiled on CUDA; eager elsewhere unless ``SPARSEBALANCE_FLEX_COMPILE=1``."""
    return device.type == "cuda" or os.environ.get("SPARSEBALANCE_FLEX_COMPILE") == "1"


def flex_sparse_attention(q, k, v, cu_seqlens, topk, block_size, scale):
    """Backend ``flex`` (the registry's signature): ``(out [T, H, D], the plan's KeptPairs)``."""
    if q.shape[0] == 0:
        return q.clone(), 0
    if q.device.type != "cuda" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                               or v.requires_grad):
        raise ValueError("backend 'flex' has no backward off CUDA (FlexAttention's CPU path is "
                         "forward only): use 'cpu' or 'reference', or no_grad")
    compiled = use_compiled(q.device)
    _kernel_options(block_size, compiled)  # an unsupported block size fails before routing
    plan, layout, mask = flex_prepare(q, k, cu_seqlens, topk, block_size, scale, compiled)
    return flex_run(q, k, v, layout, mask, scale, compiled), plan.kept
