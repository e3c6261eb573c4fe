"""Triton kernels of the routing plan on the GPU: the whole per-layer choice in three launches.

The torch route (:func:`~sparsebalance.ops.plan._route`) takes block means, gates, top-k
and the row layout in a few dozen small tensor ops per layer; at 64K tokens on an H200
those cost ~3 ms of host launch work against ~20 ms of sparse attention (Runs 4-5,
docs/gpu.md). Here the same plan is three kernels:

- :func:`_block_means_kernel` (twice, for q and k): the fp32 mean of every block of
  every head, over the block's real tokens (q's also times the softmax scale);
- :func:`_route_kernel`: one program per (query block, head) writes its whole
  ``kv_idx`` row: a row without a choice keeps blocks ``0 .. i`` of its document; a
  routed row takes the gates of its candidates (blocks ``1 .. i - 1``), finds the k-th
  largest by bisection on the gates' order-preserving integer keys (32 passes over the
  row, whatever k), keeps everything above it and the ties at it from the left (the torch
  route's rule), and writes sink, chosen blocks ascending, diagonal and -1 padding;
- :func:`_threshold_kernel` (threshold routing, in place of the route kernel): the same
  program per (query block, head) takes the softmax of its gates over its candidates and
  finds its count, the fewest candidates (gates descending, ties from the left) holding
  TAU, by bisection on the same keys (the largest key whose gates at or above it hold
  TAU, 33 passes; then the ties at it from the left), clamped to the minimum and the
  budget; per-head counts write the row at once, per-block ones only the count: their
  largest over heads (one torch op) then feeds the route kernel;
- :func:`_bwd_desc_kernel` (the ``fa4`` backend): FlashAttention-4's query-direction
  lists, one program per (key block, head) scanning the rows after it in its document.

The choice equals the torch route's wherever the gates do; the gates' fp32 sums run in
another order, so a near tie at the k-th gate (relative gap ~1e-6) may go the other way;
so may a threshold count whose softmax mass lies within ~1e-6 of TAU (the torch route
takes a cumulative sum of the sorted softmax, the kernel masked sums of it).
Compile keys: the block size, the head dim, and powers of two at least the micro-batch's
blocks and the plan's row width; the row width itself is not specialised on, so
micro-batches of one packed length and new budgets reuse the compiled kernels.
Importing this module imports triton (:mod:`sparsebalance.ops.plan` imports it lazily).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _block_means_kernel(X, OUT, QB_START, QB_LEN, s_xt, s_xh, scale,
                        NH, D, B: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """``OUT[b, h, :]`` = mean of ``X[start_b : start_b + len_b, h, :]`` (fp32) x ``scale``."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(QB_START + b).to(tl.int64)
    n = tl.load(QB_LEN + b)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, ROWS)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(0, B, ROWS):
        rows = r0 + r
        ptr = X + (start + rows[:, None]) * s_xt + h * s_xh + d[None, :]
        x = tl.load(ptr, mask=(rows[:, None] < n) & (d[None, :] < D), other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    mean = acc / n.to(tl.float32) * scale
    tl.store(OUT + (b * NH + h) * D + d, mean, mask=d < D)


@triton.jit
def _gates(QM, KM, m, h, fb, i, H, REP, D, C_P2: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Gates of query block ``m`` (head ``h``, block ``i`` of a document whose block 0 is
    ``fb``) against its candidates, blocks ``1 .. i - 1``: ``(g, key, valid, c)`` over
    columns ``c = 0 .. C_P2 - 1``; ``key`` the gates' order-preserving integer keys,
    every non-candidate below every candidate."""
    c = tl.arange(0, C_P2)
    valid = (c >= 1) & (c < i)
    hk = h // REP
    g = tl.zeros((C_P2,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_DC):
        dd = d0 + tl.arange(0, BLOCK_DC)
        qv = tl.load(QM + (m * H + h) * D + dd, mask=dd < D, other=0.0)
        kp = KM + ((fb + c[:, None]).to(tl.int64) * (H // REP) + hk) * D + dd[None, :]
        kv = tl.load(kp, mask=valid[:, None] & (dd[None, :] < D), other=0.0)
        g += tl.sum(kv * qv[None, :], axis=1)
    g = tl.where(g == 0.0, 0.0, g)  # -0.0 ties with +0.0 as in torch, not below it
    bits = g.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.where(valid, key, -(1 << 40))
    return g, key, valid, c


@triton.jit
def _chosen_row(row, e, W, fb, i, c, key, valid, k):
    """Row ``i``'s entries of ``KV_IDX`` (``row`` points at entry 0) keeping the ``k`` best
    candidates: the k-th largest key by bisection (33 passes over the row, whatever k),
    everything above it and the ties at it from the left (the torch route's rule); then
    sink, chosen ascending, diagonal at ``k + 1``, -1 padding up to ``W``."""
    lo = tl.min(tl.where(valid, key, 1 << 40), axis=0)  # count(key >= lo) >= k always
    hi = tl.max(key, axis=0)
    for _ in range(33):  # the largest t with count(key >= t) >= k: the k-th largest key
        mid = lo + (hi - lo + 1) // 2
        ok = tl.sum((key >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    gt = key > lo
    eq = key == lo
    need = k - tl.sum(gt.to(tl.int32), axis=0)
    keep = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(keep.to(tl.int32), axis=0)  # 1 .. k for the kept, ascending
    tl.store(row + pos, fb + c, mask=keep)
    tl.store(row + e, tl.where(e == 0, fb, tl.where(e == k + 1, fb + i, -1)),
             mask=(e < W) & ((e == 0) | (e > k)))


@triton.jit(do_not_specialize=["W"])  # W follows the budgets: no recompile when it moves
def _route_kernel(QM, KM, KV_IDX, KV_CNT, FIRST, IDX, H, REP, W, D,
                  C_P2: tl.constexpr, W_P2: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Row ``KV_IDX[h, m, :W]`` of query block ``m`` (block ``i`` of a document whose block 0
    is ``fb``) keeping ``KV_CNT[m]`` blocks: all of ``0 .. i`` when that is ``i + 1`` blocks,
    else the sink, the ``cnt - 2`` best candidates by gate, and the diagonal."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    NB = tl.num_programs(0)
    fb = tl.load(FIRST + m)
    i = tl.load(IDX + m)
    cnt = tl.load(KV_CNT + m)
    e = tl.arange(0, W_P2)
    row = KV_IDX + (h.to(tl.int64) * NB + m) * W
    if cnt == i + 1:  # no choice: blocks 0 .. i of the document
        tl.store(row + e, tl.where(e <= i, fb + e, -1), mask=e < W)
    else:
        g, key, valid, c = _gates(QM, KM, m, h, fb, i, H, REP, D, C_P2, BLOCK_DC)
        _chosen_row(row, e, W, fb, i, c, key, valid, cnt - 2)


@triton.jit(do_not_specialize=["W", "kmin"])
def _threshold_kernel(QM, KM, KV_IDX, CAP, CNT, FIRST, IDX, H, REP, W, D, tau, kmin,
                      C_P2: tl.constexpr, W_P2: tl.constexpr, BLOCK_DC: tl.constexpr,
                      ROWS: tl.constexpr):
    """Threshold routing of query block ``m``, head ``h``: ``CNT[h, m]`` = 2 + the fewest
    candidates, gates descending (ties from the left), whose share of the head's softmax
    over its candidates reaches ``tau``, clamped to ``[min(kmin, cap), cap]`` with ``cap =
    CAP[m] - 2`` (the budget, at most the candidates); rows without candidates keep blocks
    ``0 .. i``. ``ROWS``: also write the row of ``KV_IDX`` as :func:`_route_kernel` does.

    The count: the largest key ``t`` whose gates at or above it hold ``tau`` (bisection, 33
    passes), then the ties at ``t`` from the left until the mass reaches ``tau``."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    NB = tl.num_programs(0)
    fb = tl.load(FIRST + m)
    i = tl.load(IDX + m)
    cnt = i + 1
    g, key, valid, c = _gates(QM, KM, m, h, fb, i, H, REP, D, C_P2, BLOCK_DC)
    if i >= 2:
        top = tl.load(CAP + m) - 2
        ex = tl.where(valid, tl.exp(g - tl.max(tl.where(valid, g, float("-inf")), axis=0)), 0.0)
        p = ex / tl.sum(ex, axis=0)
        lo = tl.min(tl.where(valid, key, 1 << 40), axis=0)  # all the mass; less than tau: all
        hi = tl.max(key, axis=0)
        for _ in range(33):
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum(tl.where(key >= mid, p, 0.0), axis=0) >= tau
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        gt = key > lo
        eq = key == lo
        above = tl.sum(tl.where(gt, p, 0.0), axis=0)
        ties = tl.sum((eq & (above + tl.cumsum(tl.where(eq, p, 0.0), axis=0) < tau)).to(tl.int32), axis=0)
        n = tl.sum(gt.to(tl.int32), axis=0) + tl.minimum(ties + 1, tl.sum(eq.to(tl.int32), axis=0))
        cnt = tl.minimum(tl.maximum(n, tl.minimum(kmin, top)), top) + 2
    tl.store(CNT + h.to(tl.int64) * NB + m, cnt)
    if ROWS:
        e = tl.arange(0, W_P2)
        row = KV_IDX + (h.to(tl.int64) * NB + m) * W
        if cnt == i + 1:
            tl.store(row + e, tl.where(e <= i, fb + e, -1), mask=e < W)
        else:
            _chosen_row(row, e, W, fb, i, c, key, valid, cnt - 2)


@triton.jit(do_not_specialize=["W"])
def _bwd_desc_kernel(KV_IDX, DOC_END, BWD_CNT, BWD_IDX, W,
                     W_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """``BWD_IDX[h, n, :]``: the query blocks after ``n`` in its document whose row of
    ``KV_IDX`` keeps ``n`` (as a full block: a later row's diagonal is never ``n``),
    ascending; ``BWD_CNT[h, n]`` their number. Entries past the count are left as they are."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    NB = tl.num_programs(0)
    end = tl.load(DOC_END + n)
    e = tl.arange(0, W_P2)
    r = tl.arange(0, BLOCK_M)
    base = h.to(tl.int64) * NB
    count = 0
    for m0 in range(n + 1, end, BLOCK_M):
        m = m0 + r
        live = m < end
        tile = tl.load(KV_IDX + (base + m[:, None]) * W + e[None, :],
                       mask=live[:, None] & (e[None, :] < W), other=-1)
        hit = (tl.sum((tile == n).to(tl.int32), axis=1) > 0) & live
        pos = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(BWD_IDX + (base + n) * NB + pos, m, mask=hit)
        count += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(BWD_CNT + base + n, count)


_keys: set = set()
"""(kernel, compile-time arguments, input dtype) launched in this process."""


def compile_count() -> int:
    """Distinct compile-time argument sets this process launched (Triton compiles each
    once; its own specialisations on pointer alignment are not counted)."""
    return len(_keys)


def _launch_means(x: torch.Tensor, qb_start, qb_len, B: int, scale: float) -> torch.Tensor:
    """fp32 ``[NB, h, D]``: every block's mean of ``x [T, h, D]``, times ``scale``."""
    NB, (nh, D) = qb_start.shape[0], x.shape[1:]
    out = torch.empty((NB, nh, D), dtype=torch.float32, device=x.device)
    if NB:
        ce = dict(B=B, ROWS=min(B, 32), BLOCK_D=triton.next_power_of_2(D))
        _keys.add(("means", tuple(ce.items()), x.dtype))
        _block_means_kernel[(NB, nh)](x, out, qb_start, qb_len, x.stride(0), x.stride(1), scale, nh, D, **ce)
    return out


def _gate_means(q, k, qb_start, qb_len, block_size: int, scale: float, width: int, W: int):
    """(q means x scale, k means, compile-time arguments of the row kernels)."""
    D = q.shape[2]
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    qm = _launch_means(q, qb_start, qb_len, block_size, scale)
    km = _launch_means(k, qb_start, qb_len, block_size, 1.0)
    C = max(16, triton.next_power_of_2(width))
    ce = dict(C_P2=C, W_P2=max(16, triton.next_power_of_2(W)),
              BLOCK_DC=max(1, min(triton.next_power_of_2(D), 8192 // C)))
    return qm, km, ce


def route_rows(q: torch.Tensor, k: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor,
               kv_cnt: torch.Tensor, first: torch.Tensor, idx: torch.Tensor, W: int,
               width: int, block_size: int, scale: float) -> torch.Tensor:
    """``kv_idx [H, NB, W]`` (int32) of ``q [T, H, D]``, ``k [T, Hkv, D]`` for blocks with
    starts ``qb_start``, lengths ``qb_len``, counts ``kv_cnt``, document block 0 ``first``
    and index in the document ``idx`` (int32 ``[NB]`` each, on q's device); ``width``: at
    least the blocks of the longest document, at most
    :data:`~sparsebalance.ops.plan.FUSED_MAX_BLOCKS` (one compiled kernel per power of two)."""
    (H, D), NB = q.shape[1:], qb_start.shape[0]
    kv_idx = torch.empty((H, NB, W), dtype=torch.int32, device=q.device)
    if NB == 0:
        return kv_idx
    qm, km, ce = _gate_means(q, k, qb_start, qb_len, block_size, scale, width, W)
    _keys.add(("route", tuple(ce.items())))
    _route_kernel[(NB, H)](qm, km, kv_idx, kv_cnt, first, idx, H, H // k.shape[1], W, D, **ce)
    return kv_idx


def threshold_rows(q: torch.Tensor, k: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor,
                   cap: torch.Tensor, first: torch.Tensor, idx: torch.Tensor, W: int, width: int,
                   block_size: int, scale: float, tau: float, kmin: int, per_head: bool) -> tuple:
    """Threshold routing (:class:`~sparsebalance.ops.plan.RoutingRule`): ``(kv_idx [H, NB, W],
    kv_cnt [H, NB])`` int32, arguments as :func:`route_rows` with ``cap`` the budget's
    counts (int32 ``[NB]``: sink, diagonal and at most the budget's candidates). Per head:
    one row kernel that counts and writes. ``per_head`` False: the counts kernel, their
    largest over heads (torch ops on the device), then :func:`route_rows`' kernel with it."""
    (H, D), NB = q.shape[1:], qb_start.shape[0]
    kv_idx = torch.empty((H, NB, W), dtype=torch.int32, device=q.device)
    kv_cnt = torch.empty((H, NB), dtype=torch.int32, device=q.device)
    if NB == 0:
        return kv_idx, kv_cnt
    qm, km, ce = _gate_means(q, k, qb_start, qb_len, block_size, scale, width, W)
    _keys.add(("threshold", tuple(ce.items()), per_head))
    _threshold_kernel[(NB, H)](qm, km, kv_idx, cap, kv_cnt, first, idx, H, H // k.shape[1], W, D,
                               float(tau), int(kmin), ROWS=per_head, **ce)
    if not per_head:
        kv_cnt = kv_cnt.amax(0, keepdim=True)
        _keys.add(("route", tuple(ce.items())))
        _route_kernel[(NB, H)](qm, km, kv_idx, kv_cnt, first, idx, H, H // k.shape[1], W, D, **ce)
        kv_cnt = kv_cnt.expand(H, NB).contiguous()
    return kv_idx, kv_cnt


def bwd_descriptors(kv_idx: torch.Tensor, doc_end: torch.Tensor) -> tuple:
    """FA4's query-direction lists of ``kv_idx [H, NB, W]``: ``(cnt [H, NB], idx [H, NB, NB])``
    int32, ``idx`` zero past each count (``doc_end``: int32 ``[NB]``, one past the last
    block of each block's document)."""
    H, NB, W = kv_idx.shape
    cnt = torch.empty((H, NB), dtype=torch.int32, device=kv_idx.device)
    idx = torch.zeros((H, NB, NB), dtype=torch.int32, device=kv_idx.device)
    if NB:
        ce = dict(W_P2=max(16, triton.next_power_of_2(W)), BLOCK_M=16)
        _keys.add(("bwd", tuple(ce.items())))
        _bwd_desc_kernel[(NB, H)](kv_idx, doc_end, cnt, idx, W, **ce)
    return cnt, idx
