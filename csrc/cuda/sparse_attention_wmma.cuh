// Tensor-core (WMMA, bf16 in, fp32 accumulate) kernels of block top-k sparse attention:
// forward, backward dq, backward dk/dv. Included by sparse_attention_kernels.cu, which
// dispatches bf16 inputs with head dim % 8 == 0 here and everything else to the SIMT
// kernels.
//
// Tiling: a CTA of 4 warps works on 64 rows at a time (query rows in fwd/dq, key rows
// in dk/dv; warp w owns rows 16w..16w+15) against 64-row chunks of the other side,
// staged in shared memory as bf16 (head dim padded with zeros to DP = 32, 64 or 128).
// Products go through 16x16x16 WMMA fragments; the softmax, masks and dS are computed
// by two threads per row (lanes 2r, 2r+1 of the warp that owns row r, so the warp that
// writes a row of P is the warp that multiplies it: __syncwarp suffices there).
// The forward keeps the output accumulator in shared memory (fp32) so that rows can be
// rescaled by the online-softmax factor; dq and dk/dv keep theirs in fragments.
// dk/dv: one CTA per (key block, kv head) walks the reverse index, so no atomics.
#pragma once

#include <cuda_bf16.h>
#include <mma.h>

namespace sbcuda {
namespace wmma_kernels {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kRows = 64;     // rows per pass (4 warps x 16)
constexpr int kWarps = 4;
constexpr int kThreadsTC = kWarps * 32;
constexpr int kTile = 16;
constexpr float kLog2eTC = 1.4426950408889634f;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragAcol = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major>;
using FragBrow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBcol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// rows [0, n) of a [kRows][DP] bf16 tile from global rows (row0 + i) * stride + col0
// (head dim D, D % 8 == 0); rows >= n and columns >= D are zero. 16-byte vectors.
template <int DP>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* __restrict__ src, long row0,
                                          long stride, long col0, int n, int D) {
  constexpr int kVec = 8;
  constexpr int kPerRow = DP / kVec;
  for (int i = threadIdx.x; i < kRows * kPerRow; i += blockDim.x) {
    const int r = i / kPerRow, c = (i % kPerRow) * kVec;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < n && c < D) val = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride + col0 + c);
    *reinterpret_cast<uint4*>(dst + r * DP + c) = val;
  }
}

// Per-row fp32 values (lse2 / delta) of rows [0, n), zero beyond.
__device__ __forceinline__ void load_rowvec(float* dst, const float* __restrict__ src, int n) {
  for (int i = threadIdx.x; i < kRows; i += blockDim.x) dst[i] = i < n ? src[i] : 0.f;
}

// C[16 x 64] (warp's rows, fp32, ldc 64) = A[16 x DP] (row-major, lda DP) * B^T, B stored
// row-major [64][DP] (so B^T is col-major with ld DP).
template <int DP>
__device__ __forceinline__ void warp_abt(float* c, const bf16* a, const bf16* b) {
  FragA fa;
  FragBcol fb;
  FragC acc[kRows / kTile];
#pragma unroll
  for (int n = 0; n < kRows / kTile; ++n) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int kk = 0; kk < DP; kk += kTile) {
    wmma::load_matrix_sync(fa, a + kk, DP);
#pragma unroll
    for (int n = 0; n < kRows / kTile; ++n) {
      wmma::load_matrix_sync(fb, b + n * kTile * DP + kk, DP);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kRows / kTile; ++n)
    wmma::store_matrix_sync(c + n * kTile, acc[n], kRows, wmma::mem_row_major);
}

// acc[16 x DP] += A[16 x 64] (a warp's rows, bf16 row-major, ld 64) * B[64 x DP]
// (bf16 row-major, ld DP): the P V / dS K / P^T dO / dS^T Q products.
template <int DP>
__device__ __forceinline__ void warp_ab_acc(FragC (&acc)[DP / kTile], const bf16* a, const bf16* b) {
  FragA fa;
  FragBrow fb;
#pragma unroll
  for (int kk = 0; kk < kRows; kk += kTile) {
    wmma::load_matrix_sync(fa, a + kk, kRows);
#pragma unroll
    for (int n0 = 0; n0 < DP / kTile; ++n0) {
      wmma::load_matrix_sync(fb, b + kk * DP + n0 * kTile, DP);
      wmma::mma_sync(acc[n0], fa, fb, acc[n0]);
    }
  }
}

// Write a warp's 16 accumulator rows [16 x DP] (times `mul`, as bf16) to global memory
// through the warp's 16 x 64 fp32 staging area: the thread pair of row `row` (`half` 0/1)
// writes that row's first D values at `dst` (only if `row_ok`).
template <int DP>
__device__ __forceinline__ void store_warp_rows(FragC (&acc)[DP / kTile], float* stage, bf16* dst,
                                                int row, int half, bool row_ok, float mul, int D) {
#pragma unroll
  for (int n0 = 0; n0 < DP / kTile; n0 += kRows / kTile) {
#pragma unroll
    for (int t = 0; t < kRows / kTile; ++t)
      if (n0 + t < DP / kTile)
        wmma::store_matrix_sync(stage + t * kTile, acc[n0 + t], kRows, wmma::mem_row_major);
    __syncwarp();
    if (row_ok)
      for (int d = half; d < kRows && n0 * kTile + d < D; d += 2)
        dst[n0 * kTile + d] =
            __float2bfloat16(stage[(row % kTile) * kRows + d] * mul);
    __syncwarp();
  }
}

template <int DP>
struct FwdSmem {
  bf16 q[kRows * DP], k[kRows * DP], v[kRows * DP], p[kRows * kRows];
  float s[kRows * kRows], o[kRows * DP];
};

template <int DP>
__global__ void __launch_bounds__(kThreadsTC)
fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
           bf16* __restrict__ out, float* __restrict__ lse2, Plan p, float c, int D) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<FwdSmem<DP>*>(smem_raw);
  const int b = blockIdx.x, h = blockIdx.y, hk = h / (p.H / p.Hkv);
  const int warp = threadIdx.x / 32, row = threadIdx.x / 2, half = threadIdx.x % 2;
  const int s0 = p.qb_start[b], ql = p.qb_len[b], cnt = p.kv_cnt[(long)h * p.NB + b];
  const int* kv_row = p.kv_idx + ((long)h * p.NB + b) * p.W;
  for (int r0 = 0; r0 < ql; r0 += kRows) {
    __syncthreads();  // the previous pass is done with every tile
    load_tile<DP>(sm.q, q, s0 + r0, (long)p.H * D, (long)h * D, ql - r0, D);
    for (int i = threadIdx.x; i < kRows * DP; i += blockDim.x) sm.o[i] = 0.f;
    float m = -INFINITY, l = 0.f;  // row `row`, the same in both threads of the pair
    const bool row_ok = r0 + row < ql;
    for (int e = 0; e < cnt; ++e) {
      const int j = kv_row[e];
      const int ks0 = p.qb_start[j], kl = p.qb_len[j];
      const bool diag = j == b;
      for (int c0 = 0; c0 < kl; c0 += kRows) {
        if (diag && c0 > r0 + kRows - 1) break;  // later keys are in no row's causal past
        const int n = min(kRows, kl - c0);
        __syncthreads();
        load_tile<DP>(sm.k, k, ks0 + c0, (long)p.Hkv * D, (long)hk * D, n, D);
        load_tile<DP>(sm.v, v, ks0 + c0, (long)p.Hkv * D, (long)hk * D, n, D);
        __syncthreads();
        warp_abt<DP>(sm.s + warp * kTile * kRows, sm.q + warp * kTile * DP, sm.k);
        __syncwarp();
        // online softmax of row `row`, columns half*32 .. +32
        float* srow = sm.s + row * kRows;
        const int lim = !row_ok ? 0 : diag ? min(n, r0 + row - c0 + 1) : n;
        float mx = -INFINITY;
        for (int t = half * 32; t < half * 32 + 32; ++t)
          if (t < lim) mx = fmaxf(mx, srow[t] * c);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m - m_use);
        float sum = 0.f;
        for (int t = half * 32; t < half * 32 + 32; ++t) {
          const float pr = t < lim ? exp2f(srow[t] * c - m_use) : 0.f;
          sum += pr;
          sm.p[row * kRows + t] = __float2bfloat16(pr);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        float* orow = sm.o + row * DP;
        for (int d = half * (DP / 2); d < (half + 1) * (DP / 2); ++d) orow[d] *= alpha;
        __syncwarp();
        // O[warp rows] += P[warp rows, 64] * V[64, DP]
        FragA fa;
        FragBrow fb;
        FragC acc;
#pragma unroll
        for (int n0 = 0; n0 < DP; n0 += kTile) {
          float* otile = sm.o + warp * kTile * DP + n0;
          wmma::load_matrix_sync(acc, otile, DP, wmma::mem_row_major);
#pragma unroll
          for (int kk = 0; kk < kRows; kk += kTile) {
            wmma::load_matrix_sync(fa, sm.p + warp * kTile * kRows + kk, kRows);
            wmma::load_matrix_sync(fb, sm.v + kk * DP + n0, DP);
            wmma::mma_sync(acc, fa, fb, acc);
          }
          wmma::store_matrix_sync(otile, acc, DP, wmma::mem_row_major);
        }
      }
    }
    __syncwarp();
    if (row_ok) {
      const float inv = 1.f / l;
      const long base = ((long)(s0 + r0 + row) * p.H + h) * D;
      for (int d = half; d < D; d += 2) out[base + d] = __float2bfloat16(sm.o[row * DP + d] * inv);
      if (half == 0) lse2[(long)h * p.T + s0 + r0 + row] = m + log2f(l);
    }
  }
}

template <int DP>
struct DqSmem {
  bf16 q[kRows * DP], dout[kRows * DP], k[kRows * DP], v[kRows * DP], ds[kRows * kRows];
  float s[kRows * kRows], dp[kRows * kRows], lse[kRows], delta[kRows];
};

template <int DP>
__global__ void __launch_bounds__(kThreadsTC)
bwd_dq_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
              const bf16* __restrict__ dout, const float* __restrict__ lse2,
              const float* __restrict__ delta, bf16* __restrict__ dq, Plan p, float c,
              float scale, int D) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<DqSmem<DP>*>(smem_raw);
  const int b = blockIdx.x, h = blockIdx.y, hk = h / (p.H / p.Hkv);
  const int warp = threadIdx.x / 32, row = threadIdx.x / 2, half = threadIdx.x % 2;
  const int s0 = p.qb_start[b], ql = p.qb_len[b], cnt = p.kv_cnt[(long)h * p.NB + b];
  const int* kv_row = p.kv_idx + ((long)h * p.NB + b) * p.W;
  for (int r0 = 0; r0 < ql; r0 += kRows) {
    __syncthreads();
    load_tile<DP>(sm.q, q, s0 + r0, (long)p.H * D, (long)h * D, ql - r0, D);
    load_tile<DP>(sm.dout, dout, s0 + r0, (long)p.H * D, (long)h * D, ql - r0, D);
    load_rowvec(sm.lse, lse2 + (long)h * p.T + s0 + r0, ql - r0);
    load_rowvec(sm.delta, delta + (long)h * p.T + s0 + r0, ql - r0);
    FragC acc[DP / kTile];
#pragma unroll
    for (int n0 = 0; n0 < DP / kTile; ++n0) wmma::fill_fragment(acc[n0], 0.f);
    const bool row_ok = r0 + row < ql;
    for (int e = 0; e < cnt; ++e) {
      const int j = kv_row[e];
      const int ks0 = p.qb_start[j], kl = p.qb_len[j];
      const bool diag = j == b;
      for (int c0 = 0; c0 < kl; c0 += kRows) {
        if (diag && c0 > r0 + kRows - 1) break;
        const int n = min(kRows, kl - c0);
        __syncthreads();
        load_tile<DP>(sm.k, k, ks0 + c0, (long)p.Hkv * D, (long)hk * D, n, D);
        load_tile<DP>(sm.v, v, ks0 + c0, (long)p.Hkv * D, (long)hk * D, n, D);
        __syncthreads();
        warp_abt<DP>(sm.s + warp * kTile * kRows, sm.q + warp * kTile * DP, sm.k);
        warp_abt<DP>(sm.dp + warp * kTile * kRows, sm.dout + warp * kTile * DP, sm.v);
        __syncwarp();
        const int lim = !row_ok ? 0 : diag ? min(n, r0 + row - c0 + 1) : n;
        const float lse = sm.lse[row], dl = sm.delta[row];
        for (int t = half * 32; t < half * 32 + 32; ++t) {
          const int i = row * kRows + t;
          const float pr = t < lim ? exp2f(sm.s[i] * c - lse) : 0.f;
          sm.ds[i] = __float2bfloat16(pr * (sm.dp[i] - dl));
        }
        __syncwarp();
        warp_ab_acc<DP>(acc, sm.ds + warp * kTile * kRows, sm.k);  // dQ += dS K
      }
    }
    // stage the warp's dq rows through its (now free) part of sm.s, then write
    __syncthreads();
    store_warp_rows<DP>(acc, sm.s + warp * kTile * kRows, dq + ((long)(s0 + r0 + row) * p.H + h) * D,
                        row, half, row_ok, scale, D);
  }
}

template <int DP>
struct DkdvSmem {
  bf16 k[kRows * DP], v[kRows * DP], q[kRows * DP], dout[kRows * DP], pt[kRows * kRows],
      dst[kRows * kRows];
  float st[kRows * kRows], dpt[kRows * kRows], lse[kRows], delta[kRows];
};

template <int DP>
__global__ void __launch_bounds__(kThreadsTC)
bwd_dkdv_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                const bf16* __restrict__ dout, const float* __restrict__ lse2,
                const float* __restrict__ delta, const int* __restrict__ rev_ptr,
                const int* __restrict__ rev_q, int nnz, bf16* __restrict__ dk,
                bf16* __restrict__ dv, Plan p, float c, float scale, int D) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<DkdvSmem<DP>*>(smem_raw);
  const int j = blockIdx.x, hk = blockIdx.y, rep = p.H / p.Hkv;
  const int warp = threadIdx.x / 32, row = threadIdx.x / 2, half = threadIdx.x % 2;
  const int ks0 = p.qb_start[j], kl = p.qb_len[j];
  for (int r0 = 0; r0 < kl; r0 += kRows) {  // key rows r0 .. r0 + 63 of block j
    __syncthreads();
    load_tile<DP>(sm.k, k, ks0 + r0, (long)p.Hkv * D, (long)hk * D, kl - r0, D);
    load_tile<DP>(sm.v, v, ks0 + r0, (long)p.Hkv * D, (long)hk * D, kl - r0, D);
    FragC acc_dk[DP / kTile], acc_dv[DP / kTile];
#pragma unroll
    for (int n0 = 0; n0 < DP / kTile; ++n0) {
      wmma::fill_fragment(acc_dk[n0], 0.f);
      wmma::fill_fragment(acc_dv[n0], 0.f);
    }
    const bool row_ok = r0 + row < kl;  // key row
    for (int hh = hk * rep; hh < (hk + 1) * rep; ++hh) {
      const int lo = rev_ptr[(long)hh * (p.NB + 1) + j], hi = rev_ptr[(long)hh * (p.NB + 1) + j + 1];
      for (int idx = lo; idx < hi; ++idx) {
        const int b = rev_q[(long)hh * nnz + idx];
        const int s0 = p.qb_start[b], ql = p.qb_len[b];
        const bool diag = b == j;
        for (int c0 = 0; c0 < ql; c0 += kRows) {  // query rows c0 .. c0 + 63 of block b
          if (diag && c0 + kRows - 1 < r0) continue;  // all before this pass's keys
          const int n = min(kRows, ql - c0);
          __syncthreads();
          load_tile<DP>(sm.q, q, s0 + c0, (long)p.H * D, (long)hh * D, n, D);
          load_tile<DP>(sm.dout, dout, s0 + c0, (long)p.H * D, (long)hh * D, n, D);
          load_rowvec(sm.lse, lse2 + (long)hh * p.T + s0 + c0, n);
          load_rowvec(sm.delta, delta + (long)hh * p.T + s0 + c0, n);
          __syncthreads();
          // S^T[key rows, queries] = K Q^T; dP^T = V dO^T
          warp_abt<DP>(sm.st + warp * kTile * kRows, sm.k + warp * kTile * DP, sm.q);
          warp_abt<DP>(sm.dpt + warp * kTile * kRows, sm.v + warp * kTile * DP, sm.dout);
          __syncwarp();
          // key r0 + row is seen by queries c0 + t with t < n and (not diag or c0 + t >= r0 + row)
          const int first = !row_ok ? kRows : diag ? max(0, r0 + row - c0) : 0;
          for (int t = half * 32; t < half * 32 + 32; ++t) {
            const int i = row * kRows + t;
            const bool ok = t >= first && t < n;
            const float pr = ok ? exp2f(sm.st[i] * c - sm.lse[t]) : 0.f;
            sm.pt[i] = __float2bfloat16(pr);
            sm.dst[i] = __float2bfloat16(pr * (sm.dpt[i] - sm.delta[t]));
          }
          __syncwarp();
          // dV[warp key rows] += P^T dO; dK += dS^T Q
          warp_ab_acc<DP>(acc_dv, sm.pt + warp * kTile * kRows, sm.dout);
          warp_ab_acc<DP>(acc_dk, sm.dst + warp * kTile * kRows, sm.q);
        }
      }
    }
    __syncthreads();
    bf16* krow = dk + ((long)(ks0 + r0 + row) * p.Hkv + hk) * D;
    store_warp_rows<DP>(acc_dk, sm.st + warp * kTile * kRows, krow, row, half, row_ok, scale, D);
    store_warp_rows<DP>(acc_dv, sm.st + warp * kTile * kRows,
                        dv + ((long)(ks0 + r0 + row) * p.Hkv + hk) * D, row, half, row_ok, 1.f, D);
  }
}

}  // namespace wmma_kernels
}  // namespace sbcuda
