// Block top-k sparse attention on CUDA: forward and backward (extension sparsebalance._C_cuda).
//
// Same routing plan and conventions as the CPU kernel (csrc/cpu): kv_idx lists the
// kept key blocks of every (head, query block) with the diagonal last; logits are
// scaled by scale * log2(e) and lse2 is a base-2 log-sum-exp. This is a portable
// SIMT kernel (one thread per query row in the forward and dq kernels, one per key
// row in the dk/dv kernel, key/query chunks staged in shared memory, fp32
// accumulation); the tensor-core path on GPUs is the Triton backend. The dk/dv
// kernel owns its key block and walks the reverse index, so there are no atomics.
//
// Only torch/extension.h and the CUDA runtime are included (no c10/cuda or ATen/cuda
// headers, which need cuSPARSE/cmake-generated headers a CPU torch lacks), so the
// caller passes the current stream handle and selects the device (Python launcher).
// Self-contained: compiles with nvcc and torch's include dirs alone, e.g.
//   nvcc -c -std=c++20 -O3 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
//        -I$TORCH/include -I$TORCH/include/torch/csrc/api/include -I$PYINC \
//        -DTORCH_EXTENSION_NAME=_C_cuda csrc/cuda/sparse_attention_cuda.cu -o /tmp/sa.o
// ($TORCH = the torch package dir, $PYINC = Python's include dir.)
#include <torch/extension.h>
#include <cuda_runtime.h>

#include <vector>

namespace sbcuda {

constexpr int kThreads = 64;  // rows per pass of a block
constexpr int kChunk = 32;    // keys (or queries) staged in shared memory at a time
constexpr float kLog2e = 1.4426950408889634f;

// Loops over the head dim: fully unrolled to MAXD (register arrays), guarded by the
// runtime head dim D <= MAXD.
#define SB_FOR_D(d) _Pragma("unroll") for (int d = 0; d < MAXD; ++d) if (d < D)

struct Plan {
  const int* qb_start;
  const int* qb_len;
  const int* kv_idx;  // [H][NB][W]
  const int* kv_cnt;  // [NB]
  int NB, W, T, H, Hkv;
};

template <typename scalar_t, int MAXD>
__global__ void fwd_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                           const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                           float* __restrict__ lse2, Plan p, float c, int D) {
  __shared__ float ks[kChunk][MAXD];
  __shared__ float vs[kChunk][MAXD];
  const int b = blockIdx.x, h = blockIdx.y, hk = h / (p.H / p.Hkv);
  const int s0 = p.qb_start[b], ql = p.qb_len[b], cnt = p.kv_cnt[b];
  const int* row = p.kv_idx + ((long)h * p.NB + b) * p.W;
  for (int r0 = 0; r0 < ql; r0 += kThreads) {
    const int r = r0 + threadIdx.x;
    const bool active = r < ql;
    float qr[MAXD], acc[MAXD];
    float m = -INFINITY, l = 0.f;
    SB_FOR_D(d) {
      qr[d] = active ? static_cast<float>(q[((long)(s0 + r) * p.H + h) * D + d]) * c : 0.f;
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
          ks[i / D][i % D] = static_cast<float>(k[src]);
          vs[i / D][i % D] = static_cast<float>(v[src]);
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
        out[((long)(s0 + r) * p.H + h) * D + d] = static_cast<scalar_t>(acc[d] / l);
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
  const int s0 = p.qb_start[b], ql = p.qb_len[b], cnt = p.kv_cnt[b];
  const int* row = p.kv_idx + ((long)h * p.NB + b) * p.W;
  for (int r0 = 0; r0 < ql; r0 += kThreads) {
    const int r = r0 + threadIdx.x;
    const bool active = r < ql;
    const long base = ((long)(s0 + r) * p.H + h) * D;
    float qr[MAXD], dor[MAXD], acc[MAXD];
    SB_FOR_D(d) {
      qr[d] = active ? static_cast<float>(q[base + d]) * c : 0.f;
      dor[d] = active ? static_cast<float>(dout[base + d]) : 0.f;
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
          ks[i / D][i % D] = static_cast<float>(k[src]);
          vs[i / D][i % D] = static_cast<float>(v[src]);
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
      SB_FOR_D(d) dq[base + d] = static_cast<scalar_t>(acc[d] * scale);
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
      kr[d] = active ? static_cast<float>(k[base + d]) : 0.f;
      vr[d] = active ? static_cast<float>(v[base + d]) : 0.f;
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
            qs[i / D][i % D] = static_cast<float>(q[src]) * c;
            dos[i / D][i % D] = static_cast<float>(dout[src]);
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
        dk[base + d] = static_cast<scalar_t>(dka[d] / kLog2e);
        dv[base + d] = static_cast<scalar_t>(dva[d]);
      }
  }
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const std::vector<at::Tensor>& tabs) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->is_cuda() && t->dim() == 3 && t->is_contiguous(),
                "sparse_attention cuda: q/k/v must be contiguous CUDA [T, H, D]");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "sparse_attention cuda: q/k/v dtypes differ");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "sparse_attention cuda: dtype must be float32 or bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  q.size(1) % k.size(1) == 0,
              "sparse_attention cuda: k/v must be [T, Hkv, D] with H % Hkv == 0");
  for (const auto& t : tabs)
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous(),
                "sparse_attention cuda: plan tables must be contiguous int32 CUDA tensors");
}

Plan make_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qb_start,
               const at::Tensor& qb_len, const at::Tensor& kv_idx, const at::Tensor& kv_cnt) {
  return Plan{qb_start.data_ptr<int>(), qb_len.data_ptr<int>(), kv_idx.data_ptr<int>(),
              kv_cnt.data_ptr<int>(), (int)qb_start.numel(), (int)kv_idx.size(2),
              (int)q.size(0), (int)q.size(1), (int)k.size(1)};
}

void launch_check() {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "sparse_attention cuda: launch failed: ", cudaGetErrorString(err));
}

// Register-array size for the head dim: the smallest of 32, 64, 128 that fits.
#define SB_DISPATCH_D(D_, ...)                                                  \
  if ((D_) <= 32) { constexpr int HD = 32; __VA_ARGS__; }                       \
  else if ((D_) <= 64) { constexpr int HD = 64; __VA_ARGS__; }                  \
  else if ((D_) <= 128) { constexpr int HD = 128; __VA_ARGS__; }                \
  else TORCH_CHECK(false, "sparse_attention cuda: head_dim must be <= 128");

}  // namespace sbcuda

std::vector<at::Tensor> sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& qb_start,
                                             const at::Tensor& qb_len, const at::Tensor& kv_idx,
                                             const at::Tensor& kv_cnt, int64_t block_size,
                                             double scale, int64_t stream_handle) {
  using namespace sbcuda;
  check(q, k, v, {qb_start, qb_len, kv_idx, kv_cnt});
  TORCH_CHECK(block_size >= 1, "sparse_attention cuda: block_size must be >= 1");
  auto out = at::empty_like(q);
  auto lse2 = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  const Plan p = make_plan(q, k, qb_start, qb_len, kv_idx, kv_cnt);
  if (p.NB == 0) return {out, lse2};
  const dim3 grid(p.NB, p.H);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float c = static_cast<float>(scale) * kLog2e;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "sparse_attention_fwd_cuda", [&] {
    SB_DISPATCH_D(q.size(2), fwd_kernel<scalar_t, HD><<<grid, kThreads, 0, stream>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        out.data_ptr<scalar_t>(), lse2.data_ptr<float>(), p, c, (int)q.size(2)));
  });
  launch_check();
  return {out, lse2};
}

std::vector<at::Tensor> sparse_attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                             const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& out, const at::Tensor& lse2,
                                             const at::Tensor& qb_start, const at::Tensor& qb_len,
                                             const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                             const at::Tensor& rev_ptr, const at::Tensor& rev_q,
                                             int64_t block_size, double scale,
                                             int64_t stream_handle) {
  using namespace sbcuda;
  check(q, k, v, {qb_start, qb_len, kv_idx, kv_cnt, rev_ptr, rev_q});
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.is_contiguous() &&
                  dout.scalar_type() == q.scalar_type(),
              "sparse_attention cuda: dout/out must be contiguous like q");
  TORCH_CHECK(lse2.scalar_type() == at::kFloat && lse2.is_contiguous(),
              "sparse_attention cuda: lse2 must be float32 [H, T]");
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const Plan p = make_plan(q, k, qb_start, qb_len, kv_idx, kv_cnt);
  if (p.NB == 0) return {dq, dk, dv};
  auto delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1).t().contiguous();  // [H, T]
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float c = static_cast<float>(scale) * kLog2e;
  const int nnz = (int)rev_q.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "sparse_attention_bwd_cuda", [&] {
    SB_DISPATCH_D(q.size(2),
      bwd_dq_kernel<scalar_t, HD><<<dim3(p.NB, p.H), kThreads, 0, stream>>>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          dout.data_ptr<scalar_t>(), lse2.data_ptr<float>(), delta.data_ptr<float>(),
          dq.data_ptr<scalar_t>(), p, c, static_cast<float>(scale), (int)q.size(2));
      bwd_dkdv_kernel<scalar_t, HD><<<dim3(p.NB, p.Hkv), kThreads, 0, stream>>>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          dout.data_ptr<scalar_t>(), lse2.data_ptr<float>(), delta.data_ptr<float>(),
          rev_ptr.data_ptr<int>(), rev_q.data_ptr<int>(), nnz, dk.data_ptr<scalar_t>(),
          dv.data_ptr<scalar_t>(), p, c, static_cast<float>(scale), (int)q.size(2)));
  });
  launch_check();
  return {dq, dk, dv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SparseBalance CUDA kernels: block top-k sparse attention (forward, backward)";
  m.def("sparse_attention_fwd", &sparse_attention_fwd,
        "(q, k, v, qb_start, qb_len, kv_idx, kv_cnt, block_size, scale, stream) -> [out, lse2]");
  m.def("sparse_attention_bwd", &sparse_attention_bwd,
        "(dout, q, k, v, out, lse2, qb_start, qb_len, kv_idx, kv_cnt, rev_ptr, rev_q, block_size, "
        "scale, stream) -> [dq, dk, dv]");
}
