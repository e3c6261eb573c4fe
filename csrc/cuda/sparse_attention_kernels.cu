// Block top-k sparse attention on CUDA: the kernels and their host launchers (raw
// pointers, no torch; the torch binding is sparse_attention_cuda.cpp).
//
// Same routing plan and conventions as the CPU kernel (csrc/cpu): kv_idx lists the
// kept key blocks of every (head, query block) with the diagonal last; logits are
// scaled by scale * log2(e) and lse2 is a base-2 log-sum-exp. Two kernel families:
// * tensor cores (sparse_attention_wmma.cuh: WMMA bf16 x bf16 -> fp32, 64-row tiles
//   in shared memory, online softmax) for bf16 inputs with head dim % 8 == 0 and
//   16-byte aligned tensors, opt-in for now (see use_wmma);
// * a portable SIMT kernel (one thread per query row in the forward and dq kernels,
//   one per key row in the dk/dv kernel, fp32 accumulation) for fp32 and every other
//   shape.
// Both dk/dv kernels own their key block and walk the reverse index: no atomics.
//
// Only CUDA headers are included, so nvcc compiles kernels, not torch's headers
// (one line):
//   nvcc -c -std=c++17 -O3 -gencode arch=compute_80,code=sm_80
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/sparse_attention_kernels.cu -o /tmp/k.o
#include "sparse_attention_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "sparse_attention_wmma.cuh"

namespace sbcuda {
namespace {

constexpr int kThreads = 64;  // rows per pass of a block
constexpr int kChunk = 32;    // keys (or queries) staged in shared memory at a time
constexpr float kLog2e = 1.4426950408889634f;

// Explicit conversions: torch's nvcc flags (__CUDA_NO_BFLOAT16_CONVERSIONS__) remove
// __nv_bfloat16's implicit ones. Round-to-nearest-even, as c10::BFloat16 does on CUDA.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Loops over the head dim: fully unrolled to MAXD (register arrays), guarded by the
// runtime head dim D <= MAXD.
#define SB_FOR_D(d) _Pragma("unroll") for (int d = 0; d < MAXD; ++d) if (d < D)

template <typename scalar_t, int MAXD>
__global__ void fwd_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                           const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                           float* __restrict__ lse2, Plan p, float c, int D) {
  __shared__ float ks[kChunk][MAXD];
  __shared__ float vs[kChunk][MAXD];
  const int b = blockIdx.x, h = blockIdx.y, hk = h / (p.H / p.Hkv);
  const int s0 = p.qb_start[b], ql = p.qb_len[b], cnt = p.kv_cnt[(long)h * p.NB + b];
  const int* row = p.kv_idx + ((long)h * p.NB + b) * p.W;
  for (int r0 = 0; r0 < ql; r0 += kThreads) {
    const int r = r0 + threadIdx.x;
    const bool active = r < ql;
    float qr[MAXD], acc[MAXD];
    float m = -INFINITY, l = 0.f;
    SB_FOR_D(d) {
      qr[d] = active ? to_float(q[((long)(s0 + r) * p.H + h) * D + d]) * c : 0.f;
      acc[d] = 0.f;
    }
    for (int e = 0; e < cnt; ++e) {
      const int j = row[e];
      const int ks0 = p.qb_start[j], kl = p.qb_len[j];
      const bool diag = j == b;
      for (int c0 = 0; c0 < kl; c0 += kChunk) {
        const int n = min(kChunk, kl - c0);
        __syncthreads();
        for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
          const long src = ((long)(ks0 + c0 + i / D) * p.Hkv + hk) * D + i % D;
          ks[i / D][i % D] = to_float(k[src]);
          vs[i / D][i % D] = to_float(v[src]);
        }
        __syncthreads();
        if (!active) continue;
        const int lim = diag ? min(n, r - c0 + 1) : n;  // token-causal on the diagonal
        for (int t = 0; t < lim; ++t) {
          float s = 0.f;
          SB_FOR_D(d) s += qr[d] * ks[t][d];
          const float mn = fmaxf(m, s);
          const float alpha = exp2f(m - mn), pr = exp2f(s - mn);
          l = l * alpha + pr;
          SB_FOR_D(d) acc[d] = acc[d] * alpha + pr * vs[t][d];
          m = mn;
        }
      }
    }
    if (active) {
      SB_FOR_D(d)
        out[((long)(s0 + r) * p.H + h) * D + d] = from_float<scalar_t>(acc[d] / l);
      lse2[(long)h * p.T + s0 + r] = m + log2f(l);
    }
  }
}

template <typename scalar_t, int MAXD>
__global__ void bwd_dq_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                              const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                              const float* __restrict__ lse2, const float* __restrict__ delta,
                              scalar_t* __restrict__ dq, Plan p, float c, float scale,
                              int D) {
  __shared__ float ks[kChunk][MAXD];
  __shared__ float vs[kChunk][MAXD];
  const int b = blockIdx.x, h = blockIdx.y, hk = h / (p.H / p.Hkv);
  const int s0 = p.qb_start[b], ql = p.qb_len[b], cnt = p.kv_cnt[(long)h * p.NB + b];
  const int* row = p.kv_idx + ((long)h * p.NB + b) * p.W;
  for (int r0 = 0; r0 < ql; r0 += kThreads) {
    const int r = r0 + threadIdx.x;
    const bool active = r < ql;
    const long base = ((long)(s0 + r) * p.H + h) * D;
    float qr[MAXD], dor[MAXD], acc[MAXD];
    SB_FOR_D(d) {
      qr[d] = active ? to_float(q[base + d]) * c : 0.f;
      dor[d] = active ? to_float(dout[base + d]) : 0.f;
      acc[d] = 0.f;
    }
    const float lse = active ? lse2[(long)h * p.T + s0 + r] : 0.f;
    const float dl = active ? delta[(long)h * p.T + s0 + r] : 0.f;
    for (int e = 0; e < cnt; ++e) {
      const int j = row[e];
      const int ks0 = p.qb_start[j], kl = p.qb_len[j];
      const bool diag = j == b;
      for (int c0 = 0; c0 < kl; c0 += kChunk) {
        const int n = min(kChunk, kl - c0);
        __syncthreads();
        for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
          const long src = ((long)(ks0 + c0 + i / D) * p.Hkv + hk) * D + i % D;
          ks[i / D][i % D] = to_float(k[src]);
          vs[i / D][i % D] = to_float(v[src]);
        }
        __syncthreads();
        if (!active) continue;
        const int lim = diag ? min(n, r - c0 + 1) : n;
        for (int t = 0; t < lim; ++t) {
          float s = 0.f, dp = 0.f;
          SB_FOR_D(d) {
            s += qr[d] * ks[t][d];
            dp += dor[d] * vs[t][d];
          }
          const float ds = exp2f(s - lse) * (dp - dl);
          SB_FOR_D(d) acc[d] += ds * ks[t][d];
        }
      }
    }
    if (active)
      SB_FOR_D(d) dq[base + d] = from_float<scalar_t>(acc[d] * scale);
  }
}

template <typename scalar_t, int MAXD>
__global__ void bwd_dkdv_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                                const float* __restrict__ lse2, const float* __restrict__ delta,
                                const int* __restrict__ rev_ptr, const int* __restrict__ rev_q,
                                int nnz, scalar_t* __restrict__ dk, scalar_t* __restrict__ dv, Plan p,
                                float c, float scale, int D) {
  __shared__ float qs[kChunk][MAXD];
  __shared__ float dos[kChunk][MAXD];
  __shared__ float ls[kChunk], dls[kChunk];
  const int j = blockIdx.x, hk = blockIdx.y, rep = p.H / p.Hkv;
  const int ks0 = p.qb_start[j], kl = p.qb_len[j];
  for (int r0 = 0; r0 < kl; r0 += kThreads) {
    const int r = r0 + threadIdx.x;  // key row in block j
    const bool active = r < kl;
    const long base = ((long)(ks0 + r) * p.Hkv + hk) * D;
    float kr[MAXD], vr[MAXD], dka[MAXD], dva[MAXD];
    SB_FOR_D(d) {
      kr[d] = active ? to_float(k[base + d]) : 0.f;
      vr[d] = active ? to_float(v[base + d]) : 0.f;
      dka[d] = dva[d] = 0.f;
    }
    for (int h = hk * rep; h < (hk + 1) * rep; ++h) {
      const int lo = rev_ptr[(long)h * (p.NB + 1) + j], hi = rev_ptr[(long)h * (p.NB + 1) + j + 1];
      for (int idx = lo; idx < hi; ++idx) {
        const int b = rev_q[(long)h * nnz + idx];
        const int s0 = p.qb_start[b], ql = p.qb_len[b];
        const bool diag = b == j;
        for (int c0 = 0; c0 < ql; c0 += kChunk) {
          const int n = min(kChunk, ql - c0);
          __syncthreads();
          for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
            const long src = ((long)(s0 + c0 + i / D) * p.H + h) * D + i % D;
            qs[i / D][i % D] = to_float(q[src]) * c;
            dos[i / D][i % D] = to_float(dout[src]);
          }
          for (int i = threadIdx.x; i < n; i += blockDim.x) {
            ls[i] = lse2[(long)h * p.T + s0 + c0 + i];
            dls[i] = delta[(long)h * p.T + s0 + c0 + i];
          }
          __syncthreads();
          if (!active) continue;
          // On the diagonal, key r is seen by queries r .. ql-1 only.
          for (int t = diag ? max(0, r - c0) : 0; t < n; ++t) {
            float s = 0.f, dp = 0.f;
            SB_FOR_D(d) {
              s += qs[t][d] * kr[d];
              dp += dos[t][d] * vr[d];
            }
            const float pr = exp2f(s - ls[t]);
            const float ds = pr * (dp - dls[t]);
            SB_FOR_D(d) {
              dva[d] += pr * dos[t][d];
              dka[d] += ds * qs[t][d];
            }
          }
        }
      }
    }
    if (active)
      SB_FOR_D(d) {
        // qs holds c * q, so dk = scale * ds^T q = ds^T (c q) / log2(e).
        dk[base + d] = from_float<scalar_t>(dka[d] / kLog2e);
        dv[base + d] = from_float<scalar_t>(dva[d]);
      }
  }
}

#undef SB_FOR_D

// Calls fn(scalar_t{}, std::integral_constant<int, MAXD>{}) for the element type and the
// smallest register-array size of 32, 64, 128 that fits the head dim; returns the launch
// error of whatever fn launched.
template <typename Fn>
cudaError_t dispatch(DType dtype, int head_dim, Fn&& fn) {
  if (head_dim < 0 || head_dim > kMaxHeadDim) return cudaErrorInvalidValue;
  auto by_dim = [&](auto zero) {
    if (head_dim <= 32) fn(zero, std::integral_constant<int, 32>{});
    else if (head_dim <= 64) fn(zero, std::integral_constant<int, 64>{});
    else fn(zero, std::integral_constant<int, 128>{});
  };
  switch (dtype) {
    case DType::kFloat32: by_dim(float{}); break;
    case DType::kBFloat16: by_dim(__nv_bfloat16{}); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Whether the tensor-core kernels take these inputs. They have compiled (sm_80, sm_90)
// but not yet run on a GPU, so they are opt-in until `make gpu-check` has passed them:
// SPARSEBALANCE_CUDA_TENSOR_CORES=1 turns them on (tests/ops/test_gpu_backends.py does).
bool use_wmma(DType dtype, int head_dim, std::initializer_list<const void*> ptrs) {
  const char* on = std::getenv("SPARSEBALANCE_CUDA_TENSOR_CORES");
  if (on == nullptr || std::strcmp(on, "1") != 0) return false;
  if (dtype != DType::kBFloat16 || head_dim < 8 || head_dim > kMaxHeadDim || head_dim % 8) return false;
  for (const void* ptr : ptrs)
    if (reinterpret_cast<std::uintptr_t>(ptr) % 16) return false;
  return true;
}

// Calls fn(std::integral_constant<int, DP>{}) for the padded head dim DP of 32, 64, 128.
template <typename Fn>
cudaError_t dispatch_wmma(int head_dim, Fn&& fn) {
  if (head_dim <= 32) fn(std::integral_constant<int, 32>{});
  else if (head_dim <= 64) fn(std::integral_constant<int, 64>{});
  else fn(std::integral_constant<int, 128>{});
  return cudaGetLastError();
}

// Launches a tensor-core kernel with `smem` bytes of dynamic shared memory (> 48 KiB
// needs the opt-in attribute).
template <typename Kernel, typename... Args>
void launch_tc(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, Args... args) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  kernel<<<grid, wmma_kernels::kThreadsTC, smem, stream>>>(args...);
}

}  // namespace

cudaError_t launch_sparse_attention_fwd(DType dtype, const void* q, const void* k, const void* v,
                                        void* out, float* lse2, const Plan& plan, int head_dim,
                                        float scale, cudaStream_t stream) {
  if (plan.NB == 0) return cudaSuccess;
  const float c = scale * kLog2e;
  if (use_wmma(dtype, head_dim, {q, k, v, out})) {
    using wmma_kernels::bf16;
    return dispatch_wmma(head_dim, [&](auto dp) {
      constexpr int DP = decltype(dp)::value;
      launch_tc(wmma_kernels::fwd_kernel<DP>, dim3(plan.NB, plan.H),
                sizeof(wmma_kernels::FwdSmem<DP>), stream, static_cast<const bf16*>(q),
                static_cast<const bf16*>(k), static_cast<const bf16*>(v), static_cast<bf16*>(out),
                lse2, plan, c, head_dim);
    });
  }
  return dispatch(dtype, head_dim, [&](auto zero, auto maxd) {
    using scalar_t = decltype(zero);
    fwd_kernel<scalar_t, decltype(maxd)::value><<<dim3(plan.NB, plan.H), kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(q), static_cast<const scalar_t*>(k),
        static_cast<const scalar_t*>(v), static_cast<scalar_t*>(out), lse2, plan, c, head_dim);
  });
}

cudaError_t launch_sparse_attention_bwd(DType dtype, const void* q, const void* k, const void* v,
                                        const void* dout, const float* lse2, const float* delta,
                                        const int* rev_ptr, const int* rev_q, int nnz, void* dq,
                                        void* dk, void* dv, const Plan& plan, int head_dim,
                                        float scale, cudaStream_t stream) {
  if (plan.NB == 0) return cudaSuccess;
  const float c = scale * kLog2e;
  if (use_wmma(dtype, head_dim, {q, k, v, dout, dq, dk, dv})) {
    using wmma_kernels::bf16;
    return dispatch_wmma(head_dim, [&](auto dp) {
      constexpr int DP = decltype(dp)::value;
      const auto* qp = static_cast<const bf16*>(q);
      const auto* kp = static_cast<const bf16*>(k);
      const auto* vp = static_cast<const bf16*>(v);
      const auto* dop = static_cast<const bf16*>(dout);
      launch_tc(wmma_kernels::bwd_dq_kernel<DP>, dim3(plan.NB, plan.H),
                sizeof(wmma_kernels::DqSmem<DP>), stream, qp, kp, vp, dop, lse2, delta,
                static_cast<bf16*>(dq), plan, c, scale, head_dim);
      launch_tc(wmma_kernels::bwd_dkdv_kernel<DP>, dim3(plan.NB, plan.Hkv),
                sizeof(wmma_kernels::DkdvSmem<DP>), stream, qp, kp, vp, dop, lse2, delta, rev_ptr,
                rev_q, nnz, static_cast<bf16*>(dk), static_cast<bf16*>(dv), plan, c, scale,
                head_dim);
    });
  }
  return dispatch(dtype, head_dim, [&](auto zero, auto maxd) {
    using scalar_t = decltype(zero);
    constexpr int MAXD = decltype(maxd)::value;
    const auto* qp = static_cast<const scalar_t*>(q);
    const auto* kp = static_cast<const scalar_t*>(k);
    const auto* vp = static_cast<const scalar_t*>(v);
    const auto* dop = static_cast<const scalar_t*>(dout);
    bwd_dq_kernel<scalar_t, MAXD><<<dim3(plan.NB, plan.H), kThreads, 0, stream>>>(
        qp, kp, vp, dop, lse2, delta, static_cast<scalar_t*>(dq), plan, c, scale, head_dim);
    bwd_dkdv_kernel<scalar_t, MAXD><<<dim3(plan.NB, plan.Hkv), kThreads, 0, stream>>>(
        qp, kp, vp, dop, lse2, delta, rev_ptr, rev_q, nnz, static_cast<scalar_t*>(dk),
        static_cast<scalar_t*>(dv), plan, c, scale, head_dim);
  });
}

}  // namespace sbcuda
