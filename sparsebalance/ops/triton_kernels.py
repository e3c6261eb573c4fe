"""Triton kernels of block top-k sparse attention (forward, backward dq, backward dk/dv).

One program per (query block, head) in the forward and dq kernels, one per
(key block, kv head) in the dk/dv kernel, which walks the reverse index of the
routing plan (no atomics: each program owns its dk/dv rows). Logits are scaled
by ``scale * log2(e)`` so the softmax uses ``exp2``; ``lse`` is kept in base 2.
Importing this module imports triton (the launcher does it lazily).

Launch parameters are autotuned per (routing block, head dim, precision) over a small
list sized for Ampere/Hopper (4 or 8 warps, 1-3 pipeline stages); every kernel only
overwrites its outputs, so the autotuner's repeated launches are harmless. Under
``TRITON_INTERPRET=1`` (CPU tests) there is one config: nothing to time.
"""

import os

import triton
import triton.language as tl


def _configs():
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)]


_autotune = triton.autotune(configs=_configs(), key=["BLOCK", "BLOCK_D", "F32"])


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
def _fwd_kernel(Q, K, V, O, LSE, QB_START, QB_LEN, KV_IDX, KV_CNT, qk_scale,
                s_qt, s_qh, s_kt, s_kh, T, NB, W, REP, D,
                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    s0 = tl.load(QB_START + b)
    ql = tl.load(QB_LEN + b)
    cnt = tl.load(KV_CNT + b)
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
        kmask = (rm[:, None] < kl) & (rd[None, :] < D)
        koff = (ks + rm)[:, None] * s_kt + hk * s_kh + rd[None, :]
        k = tl.load(K + koff, mask=kmask, other=0.0)
        v = tl.load(V + koff, mask=kmask, other=0.0)
        s = _mm(q, tl.trans(k), F32) * qk_scale
        valid = (rm[None, :] < kl) & ((rm[None, :] <= rm[:, None]) | (j != b))
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p, v, F32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + (s0 + rm)[:, None] * s_qt + h * s_qh + rd[None, :], out.to(O.dtype.element_ty), mask=qmask)
    tl.store(LSE + h * T + s0 + rm, m_i + tl.log2(l_i), mask=rm < ql)


@_autotune
@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, QB_START, QB_LEN, KV_IDX, KV_CNT, qk_scale, sm_scale,
                   s_qt, s_qh, s_kt, s_kh, T, NB, W, REP, D,
                   BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    s0 = tl.load(QB_START + b)
    ql = tl.load(QB_LEN + b)
    cnt = tl.load(KV_CNT + b)
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
        kmask = (rm[:, None] < kl) & (rd[None, :] < D)
        koff = (ks + rm)[:, None] * s_kt + hk * s_kh + rd[None, :]
        k = tl.load(K + koff, mask=kmask, other=0.0)
        v = tl.load(V + koff, mask=kmask, other=0.0)
        s = _mm(q, tl.trans(k), F32) * qk_scale
        valid = (rm[None, :] < kl) & ((rm[None, :] <= rm[:, None]) | (j != b)) & (rm[:, None] < ql)
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), F32)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds, k, F32)
    tl.store(DQ + qoff, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qmask)


@_autotune
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, QB_START, QB_LEN, REV_PTR, REV_Q, qk_scale,
                     sm_scale, s_qt, s_qh, s_kt, s_kh, T, NB, NNZ, REP, D,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    j = tl.program_id(0)
    hk = tl.program_id(1)
    ks = tl.load(QB_START + j)
    kl = tl.load(QB_LEN + j)
    rn = tl.arange(0, BLOCK)  # key rows of this block
    rm = tl.arange(0, BLOCK)  # query rows of a visiting block
    rd = tl.arange(0, BLOCK_D)
    kmask = (rn[:, None] < kl) & (rd[None, :] < D)
    koff = (ks + rn)[:, None] * s_kt + hk * s_kh + rd[None, :]
    k = tl.load(K + koff, mask=kmask, other=0.0)
    v = tl.load(V + koff, mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for r in range(0, REP):
        h = hk * REP + r
        lo = tl.load(REV_PTR + h * (NB + 1) + j)
        hi = tl.load(REV_PTR + h * (NB + 1) + j + 1)
        for idx in range(lo, hi):
            b = tl.load(REV_Q + h * NNZ + idx)
            s0 = tl.load(QB_START + b)
            ql = tl.load(QB_LEN + b)
            qmask = (rm[:, None] < ql) & (rd[None, :] < D)
            qoff = (s0 + rm)[:, None] * s_qt + h * s_qh + rd[None, :]
            q = tl.load(Q + qoff, mask=qmask, other=0.0)
            do = tl.load(DO + qoff, mask=qmask, other=0.0)
            lse = tl.load(LSE + h * T + s0 + rm, mask=rm < ql, other=0.0)
            delta = tl.load(DELTA + h * T + s0 + rm, mask=rm < ql, other=0.0)
            s = _mm(q, tl.trans(k), F32) * qk_scale  # [query, key]
            valid = (rn[None, :] < kl) & ((rn[None, :] <= rm[:, None]) | (j != b)) & (rm[:, None] < ql)
            p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
            dv += _mm(tl.trans(p), do, F32)
            dp = _mm(do, tl.trans(v), F32)
            ds = p * (dp - delta[:, None])
            dk += _mm(tl.trans(ds), q, F32)
    tl.store(DK + koff, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + koff, dv.to(DV.dtype.element_ty), mask=kmask)
