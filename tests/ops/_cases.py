"""Shared input grid for the backend-vs-reference tests (sizes kept small for CI)."""

from __future__ import annotations

import torch

# name -> (doc lengths, H, Hkv, D, block_size, topk)
CASES = {
    "short-doc": ([50], 2, 2, 32, 64, 2),
    "ragged-gqa-single-tokens": ([200, 1, 1, 77, 333], 4, 2, 32, 32, 2),
    "many-docs": ([20] * 30 + [500], 2, 1, 16, 16, 1),
    "topk0": ([600], 2, 2, 64, 64, 0),
    "topk1": ([1000], 2, 2, 64, 64, 1),
    "topk-large": ([700], 2, 2, 32, 32, 100),
    "per-doc-topk": ([400, 300, 500], 2, 1, 32, 32, torch.tensor([0, 3, 1])),
    "odd-block-and-dim": ([300, 45], 2, 2, 24, 20, 2),
    "dim80-block48": ([260], 3, 1, 80, 48, 1),
}


def make_inputs(lens, H, Hkv, D, dtype=torch.float32, seed=0):
    """Random q [T,H,D], k/v [T,Hkv,D] (values representable in bf16), cu_seqlens, dout."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(dtype)
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32)
    return mk(T, H, D), mk(T, Hkv, D), mk(T, Hkv, D), cu, mk(T, H, D)


def structured_inputs(lens, H, Hkv, D, B, seed=0, dtype=torch.float32):
    """:func:`make_inputs` with block structure, for threshold routing: every block's tokens
    share a random direction (so block-mean gates spread, as a trained model's do, instead
    of averaging out), each query head sees it at its own strength (heads from peaked to
    flat: per-head counts differ). Values stay representable in bf16."""
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    blk = torch.cat([torch.arange(L) // B + i * 10 ** 6 for i, L in enumerate(lens)])
    _, blk = torch.unique(blk, return_inverse=True)
    n = int(blk.max()) + 1 if blk.numel() else 0
    strength = torch.linspace(2.0, 0.25, H).view(1, H, 1)
    q = (q + torch.randn(n, 1, D, generator=g)[blk] * strength).to(torch.bfloat16).to(q.dtype)
    k = (k + torch.randn(n, Hkv, D, generator=g)[blk]).to(torch.bfloat16).to(k.dtype)
    return q, k, v, cu, dout


def expects_selection(lens, block_size, topk) -> bool:
    """Whether some document has more than topk + 2 blocks (so routing really drops blocks)."""
    ks = topk.tolist() if isinstance(topk, torch.Tensor) else [topk] * len(lens)
    return any(-(-L // block_size) > k + 2 for L, k in zip(lens, ks))


def run(backend, q, k, v, cu, dout, topk, block_size, **routing):
    """(out, dq, dk, dv, density) of one backend; ``routing``: threshold routing's keyword
    arguments of :func:`~sparsebalance.ops.sparse_attention` (threshold, topk_min, per_head)."""
    from sparsebalance.ops import sparse_attention

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, dens = sparse_attention(q, k, v, cu, topk=topk, block_size=block_size, backend=backend,
                                 return_density=True, **routing)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return (out.detach(), *grads, dens)


def descriptor_mask(d, direction: str = "forward") -> torch.Tensor:
    """The token-level keep mask ``[H, NB * B, NB * B]`` (query row, key row of the buffer)
    that the descriptors of ``direction`` ask FA4 for: full blocks whole, the mask block
    causal (the fa4 backend's :class:`~sparsebalance.ops.fa4.FA4Descriptors`): what the
    tests compare with the reference selection."""
    if direction == "forward":
        cnt, idx = d.fwd_full_cnt[0], d.fwd_full_idx[0]
    elif direction == "backward":
        cnt, idx = d.bwd_full_cnt[0], d.bwd_full_idx[0]
    else:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    H, NB = cnt.shape
    B = d.block_size
    blk = torch.zeros((H, NB, NB + 1), dtype=torch.bool, device=cnt.device)
    valid = torch.arange(idx.shape[-1], device=cnt.device).view(1, 1, -1) < cnt.unsqueeze(-1)
    blk.scatter_(2, torch.where(valid, idx.long(), NB), True)
    blk = blk[:, :, :NB]
    if direction == "backward":  # rows were key blocks: back to [query block, key block]
        blk = blk.transpose(1, 2)
    d_rows = d.diag_idx[0, :, :, 0].long()  # the diagonal: block m keeps block d_rows[m]
    diag = torch.zeros_like(blk)
    diag.scatter_(2, d_rows.unsqueeze(-1), True)
    if direction == "backward":
        diag = diag.transpose(1, 2)
    full = blk.repeat_interleave(B, 1).repeat_interleave(B, 2)
    part = diag.repeat_interleave(B, 1).repeat_interleave(B, 2)
    rows = torch.arange(NB * B, device=cnt.device)
    causal = rows.view(-1, 1) >= rows.view(1, -1)
    return full | (part & causal)


def plan_rows_checked(plan):
    """Every (head, query block) row of ``plan``: its count of live entries (``kv_cnt`` is
    ``[H, NB]``, one count per head), live entries first and -1 after, ascending (the sink
    first when kept), the diagonal block last."""
    kv, cnt = plan.kv_idx.long(), plan.kv_cnt.long()
    H, NB, W = kv.shape
    assert tuple(cnt.shape) == (H, NB), (tuple(cnt.shape), (H, NB))
    live = torch.arange(W, device=kv.device) < cnt.unsqueeze(-1)
    assert bool(((kv >= 0) == live).all()), "a row's -1 padding disagrees with its count"
    assert bool((kv[..., 1:] > kv[..., :-1])[live[..., 1:]].all()), "a row is not ascending"
    rows = cnt > 0
    diag = kv.gather(2, (cnt - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    blocks = torch.arange(NB, device=kv.device).expand(H, NB)
    assert torch.equal(diag[rows], blocks[rows]), "a row does not end at its diagonal block"


def fused_descriptors_checked(plan):
    """fa4's descriptors of ``plan`` by the fused kernels, after checking every table
    equals the torch-built one."""
    import os

    from sparsebalance.ops.fa4 import fa4_descriptors, torch_descriptors

    os.environ["SPARSEBALANCE_ROUTE"] = "fused"
    try:
        fused = fa4_descriptors(plan)
    finally:
        del os.environ["SPARSEBALANCE_ROUTE"]
    plain = torch_descriptors(plan)
    for f in ("fwd_full_cnt", "fwd_full_idx", "bwd_full_cnt", "bwd_full_idx", "diag_cnt", "diag_idx"):
        assert torch.equal(getattr(fused, f), getattr(plain, f)), f
    return fused
