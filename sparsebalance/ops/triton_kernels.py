"""Triton kernels of block top-k sparse attention (forward, backward dq, backward dk/dv).

One program per (query block, head) in the forward and dq kernels; they walk the kept
key blocks of their row of the plan. The dk/dv kernel runs one program per *work item*:
a slice of the (query block, head) visits of one (key block, kv head) segment, as
FlashAttention-2 splits its backward into a dq pass and a dk/dv pass. A segment with
one item writes dk/dv directly; a heavy one (the sink block is read by every query
block) is cut into several items whose fp32 partial sums a reduce kernel adds in a
fixed order, so the result is deterministic and no atomics are used. Logits are scaled
by ``scale * log2(e)`` so the softmax uses ``exp2``; ``lse`` is kept in base 2.
Importing this module imports triton (the launcher does it lazily).

Launch parameters are autotuned per (routing block, head dim, precision) over a small
list sized for Ampere/Hopper (``GPU_CONFIGS``): the routing block is walked in ``SPLIT``
sub-tiles (keys in fwd/dq, queries in dk/dv: smaller tiles keep the fp32 accumulators
in registers), 4 or 8 warps, 2-3 pipeline stages. Every kernel only overwrites its outputs, so the
autotuner's repeated launches are harmless. ``SPARSEBALANCE_TRITON_AUTOTUNE=0`` (the
GPU correctness tests) and ``TRITON_INTERPRET=1`` (CPU tests) use one config: nothing
to time, and the interpreter's config takes the sub-tile path wherever it can.
"""

import os

import triton
import triton.language as tl


def _configs():
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"SPLIT": 2}, num_warps=4, num_stages=1)]
    if os.environ.get("SPARSEBALANCE_TRITON_AUTOTUNE", "1") == "0":  # 8 warps: no spills at bf16/128/128
        return [triton.Config({"SPLIT": 2}, num_warps=8, num_stages=2)]
    return [triton.Config({"SPLIT": sp}, num_warps=w, num_stages=s)
            for sp, w, s in GPU_CONFIGS]


GPU_CONFIGS = ((1, 4, 2), (1, 8, 2), (2, 4, 2), (2, 4, 3), (2, 8, 2))
"""(SPLIT, num_warps, num_stages) tried by the autotuner on a GPU: five, since each is
compiled for every (block, head dim, precision) key a process meets; ``_prune`` keeps
the two 8-warp ones for 16-bit inputs at block 128."""


def _prune(configs, named_args, **kwargs):
    """Drop sub-tiles under 16 rows (tl.dot's minimum), and 4-warp configs for 16-bit
    inputs at a 128 routing block with head dim >= 64 (they spill); keep at least one config.

    Spills per thread (ptxas -v, sm_90, bf16, bytes of spill stores; from
    benchmarks/triton_resource_audit.py), 4 warps vs 8 warps over the SPLIT/stage configs:
        block 128, D 128: fwd 520-780 vs 0, dq 1128-2812 vs 0-20, dkdv 3360-4056 vs 168-932;
        block 128, D 64:  fwd 76-144 vs 0, dq 128-1356 vs 0, dkdv 1048-1248 vs 0-324.
    All run at 255 registers and 160-193 KB of shared memory there (1 CTA/SM), so 4 warps
    also halves the warps/SM; (1, 4, 2) even gets its wgmma serialized for lack of registers. At
    block 64 fwd/dq do not spill with 4 warps and fit more CTAs/SM, so all configs stay.
    """
    block = kwargs.get("BLOCK", named_args.get("BLOCK"))
    block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    f32 = kwargs.get("F32", named_args.get("F32", True))
    kept = [c for c in configs if block // c.kwargs["SPLIT"] >= 16]
    if block >= 128 and block_d is not None and block_d >= 64 and not f32:
        kept = [c for c in kept if c.num_warps >= 8] or kept
    if kept:
        return kept
    c = configs[0]
    return [triton.Config({"SPLIT": 1}, num_warps=c.num_warps, num_stages=c.num_stages)]


_autotune = triton.autotune(configs=_configs(), key=["BLOCK", "BLOCK_D", "F32"],
                            prune_configs_by={"early_config_prune": _prune})


@triton.jit
def _mm(a, b, F32: tl.constexpr):
    # F32: exact fp32 products (fp32 inputs, and Triton's CPU interpreter, whose
    # bf16 tl.dot is wrong in triton 3.9); otherwise native bf16 tensor-core dots.
    if F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")
    else:  # P / dS (fp32) are rounded to the input dtype for the tensor-core dot
        return tl.dot(a.to(b.dtype), b)


@_autotune
@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, QB_START, QB_LEN, KV_IDX, KV_CNT, qk_scale,
                s_qt, s_qh, s_kt, s_kh, T, NB, W, REP, D,
                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr,
                SPLIT: tl.constexpr):
    BN: tl.constexpr = BLOCK // SPLIT
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    s0 = tl.load(QB_START + b)
    ql = tl.load(QB_LEN + b)
    cnt = tl.load(KV_CNT + h * NB + b)  # [H, NB]
    rm = tl.arange(0, BLOCK)
    rd = tl.arange(0, BLOCK_D)
    qmask = (rm[:, None] < ql) & (rd[None, :] < D)
    q = tl.load(Q + (s0 + rm)[:, None] * s_qt + h * s_qh + rd[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for e in range(0, cnt):
        j = tl.load(KV_IDX + (h * NB + b) * W + e)
        ks = tl.load(QB_START + j)
        kl = tl.load(QB_LEN + j)
        for sub in tl.static_range(SPLIT):
            rn = sub * BN + tl.arange(0, BN)
            kmask = (rn[:, None] < kl) & (rd[None, :] < D)
            koff = (ks + rn)[:, None] * s_kt + hk * s_kh + rd[None, :]
            k = tl.load(K + koff, mask=kmask, other=0.0)
            v = tl.load(V + koff, mask=kmask, other=0.0)
            s = _mm(q, tl.trans(k), F32) * qk_scale
            valid = (rn[None, :] < kl) & ((rn[None, :] <= rm[:, None]) | (j != b))
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _mm(p, v, F32)
            m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + (s0 + rm)[:, None] * s_qt + h * s_qh + rd[None, :], out.to(Out.dtype.element_ty), mask=qmask)
    tl.store(LSE + h * T + s0 + rm, m_i + tl.log2(l_i), mask=rm < ql)


@_autotune
@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, QB_START, QB_LEN, KV_IDX, KV_CNT, qk_scale, sm_scale,
                   s_qt, s_qh, s_kt, s_kh, T, NB, W, REP, D,
                   BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr,
                   SPLIT: tl.constexpr):
    BN: tl.constexpr = BLOCK // SPLIT
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    s0 = tl.load(QB_START + b)
    ql = tl.load(QB_LEN + b)
    cnt = tl.load(KV_CNT + h * NB + b)  # [H, NB]
    rm = tl.arange(0, BLOCK)
    rd = tl.arange(0, BLOCK_D)
    qmask = (rm[:, None] < ql) & (rd[None, :] < D)
    qoff = (s0 + rm)[:, None] * s_qt + h * s_qh + rd[None, :]
    q = tl.load(Q + qoff, mask=qmask, other=0.0)
    do = tl.load(DO + qoff, mask=qmask, other=0.0)
    lse = tl.load(LSE + h * T + s0 + rm, mask=rm < ql, other=0.0)
    delta = tl.load(DELTA + h * T + s0 + rm, mask=rm < ql, other=0.0)
    dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for e in range(0, cnt):
        j = tl.load(KV_IDX + (h * NB + b) * W + e)
        ks = tl.load(QB_START + j)
        kl = tl.load(QB_LEN + j)
        for sub in tl.static_range(SPLIT):
            rn = sub * BN + tl.arange(0, BN)
            kmask = (rn[:, None] < kl) & (rd[None, :] < D)
            koff = (ks + rn)[:, None] * s_kt + hk * s_kh + rd[None, :]
            k = tl.load(K + koff, mask=kmask, other=0.0)
            v = tl.load(V + koff, mask=kmask, other=0.0)
            s = _mm(q, tl.trans(k), F32) * qk_scale
            valid = (rn[None, :] < kl) & ((rn[None, :] <= rm[:, None]) | (j != b)) & (rm[:, None] < ql)
            p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
            dp = _mm(do, tl.trans(v), F32)
            ds = p * (dp - delta[:, None])
            dq += _mm(ds, k, F32)
    tl.store(DQ + qoff, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qmask)


@_autotune
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, WS_DK, WS_DV, LSE, DELTA, QB_START, QB_LEN,
                     ITEM_SEG, ITEM_LO, ITEM_HI, ITEM_SLOT, VISITS, qk_scale, sm_scale,
                     s_qt, s_qh, s_kt, s_kh, T, NB, REP, D,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr,
                     SPLIT: tl.constexpr):
    # One work item: visits [lo, hi) of segment (kv head hk, key block j); a visit is
    # (query head h, query block b) packed as h * NB + b.
    BM: tl.constexpr = BLOCK // SPLIT
    it = tl.program_id(0)
    seg = tl.load(ITEM_SEG + it)
    lo = tl.load(ITEM_LO + it)
    hi = tl.load(ITEM_HI + it)
    slot = tl.load(ITEM_SLOT + it)
    hk = seg // NB
    j = seg % NB
    ks = tl.load(QB_START + j)
    kl = tl.load(QB_LEN + j)
    rn = tl.arange(0, BLOCK)  # key rows of this block
    rd = tl.arange(0, BLOCK_D)
    kmask = (rn[:, None] < kl) & (rd[None, :] < D)
    koff = (ks + rn)[:, None] * s_kt + hk * s_kh + rd[None, :]
    k = tl.load(K + koff, mask=kmask, other=0.0)
    v = tl.load(V + koff, mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for idx in range(lo, hi):
        hb = tl.load(VISITS + idx)
        h = hb // NB
        b = hb % NB
        s0 = tl.load(QB_START + b)
        ql = tl.load(QB_LEN + b)
        for sub in tl.static_range(SPLIT):
            rm = sub * BM + tl.arange(0, BM)  # query rows of the visiting block
            qmask = (rm[:, None] < ql) & (rd[None, :] < D)
            qoff = (s0 + rm)[:, None] * s_qt + h * s_qh + rd[None, :]
            q = tl.load(Q + qoff, mask=qmask, other=0.0)
            do = tl.load(DO + qoff, mask=qmask, other=0.0)
            lse = tl.load(LSE + h * T + s0 + rm, mask=rm < ql, other=0.0)
            delta = tl.load(DELTA + h * T + s0 + rm, mask=rm < ql, other=0.0)
            # Transposed scores S^T = K Q^T [key, query]: P^T and dS^T come out in the
            # accumulator layout and are the A operands of the dv/dk dots as they are
            # (trans(p) / trans(ds) went through shared memory and spilled registers).
            sT = _mm(k, tl.trans(q), F32) * qk_scale
            validT = (rn[:, None] < kl) & ((rn[:, None] <= rm[None, :]) | (j != b)) & (rm[None, :] < ql)
            pT = tl.where(validT, tl.exp2(sT - lse[None, :]), 0.0)
            dv += _mm(pT, do, F32)
            dpT = _mm(v, tl.trans(do), F32)
            dsT = pT * (dpT - delta[None, :])
            dk += _mm(dsT, q, F32)
    if slot < 0:  # the segment's only item: final values
        tl.store(DK + koff, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask)
        tl.store(DV + koff, dv.to(DV.dtype.element_ty), mask=kmask)
    else:  # one of several: an fp32 partial for _reduce_kernel
        woff = slot * BLOCK * BLOCK_D + rn[:, None] * BLOCK_D + rd[None, :]
        tl.store(WS_DK + woff, dk)
        tl.store(WS_DV + woff, dv)


@triton.jit
def _reduce_kernel(DK, DV, WS_DK, WS_DV, QB_START, QB_LEN, RED_SEG, RED_FIRST, RED_N, sm_scale,
                   s_kt, s_kh, NB, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    # Sum one split segment's partials in slot order (deterministic) and write dk/dv.
    r = tl.program_id(0)
    seg = tl.load(RED_SEG + r)
    first = tl.load(RED_FIRST + r)
    n = tl.load(RED_N + r)
    hk = seg // NB
    j = seg % NB
    ks = tl.load(QB_START + j)
    kl = tl.load(QB_LEN + j)
    rn = tl.arange(0, BLOCK)
    rd = tl.arange(0, BLOCK_D)
    tile = rn[:, None] * BLOCK_D + rd[None, :]
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for i in range(0, n):
        dk += tl.load(WS_DK + (first + i) * BLOCK * BLOCK_D + tile)
        dv += tl.load(WS_DV + (first + i) * BLOCK * BLOCK_D + tile)
    kmask = (rn[:, None] < kl) & (rd[None, :] < D)
    koff = (ks + rn)[:, None] * s_kt + hk * s_kh + rd[None, :]
    tl.store(DK + koff, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + koff, dv.to(DV.dtype.element_ty), mask=kmask)
