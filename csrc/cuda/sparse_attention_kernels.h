// Host launch API of the block top-k sparse attention CUDA kernels
// (sparse_attention_kernels.cu). Plain C++ plus the CUDA runtime API: no torch, so the
// .cu compiles in seconds and the torch binding (sparse_attention_cuda.cpp) is built by
// the host compiler alone.
//
// Layouts (all contiguous, row-major): q, out, dout, dq [T, H, D]; k, v, dk, dv
// [T, Hkv, D] with H % Hkv == 0; lse2, delta [H, T] fp32. Routing plan tables are int32
// device arrays: qb_start, qb_len [NB] (first token and length of each query block),
// kv_idx [H, NB, W] (kept key blocks of every (head, query block), diagonal last),
// kv_cnt [H, NB] (valid entries per row of kv_idx), rev_ptr [H, NB + 1] and rev_q [H, nnz]
// (the reverse index: query blocks that keep each key block, CSR per head).
#pragma once

#include <cuda_runtime_api.h>

namespace sbcuda {

// Element type of q/k/v/out/dout/dq/dk/dv (lse2 and delta are always fp32).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

// Largest head dim the kernels support (register arrays are sized 32, 64 or 128).
constexpr int kMaxHeadDim = 128;

// Device pointers to the routing plan plus its sizes.
struct Plan {
  const int* qb_start;  // [NB]
  const int* qb_len;    // [NB]
  const int* kv_idx;    // [H][NB][W]
  const int* kv_cnt;    // [H][NB]
  int NB, W, T, H, Hkv;
};

// Forward: out = softmax(scale * q k^T, block-sparse causal) v and lse2 = base-2
// log-sum-exp of the scaled logits. Launches on `stream` of the current device; returns
// cudaErrorInvalidValue for head_dim outside [0, kMaxHeadDim], else the launch error
// (cudaGetLastError) — cudaSuccess does not mean the kernel has finished.
cudaError_t launch_sparse_attention_fwd(DType dtype, const void* q, const void* k, const void* v,
                                        void* out, float* lse2, const Plan& plan, int head_dim,
                                        float scale, cudaStream_t stream);

// Backward: dq, dk, dv for every token of the plan's blocks (the binding zero-fills them
// first). delta[h, t] = sum_d dout * out (fp32). Two kernels on
// `stream`: dq per query block, dk/dv per key block over the reverse index (no atomics).
// Error contract as for the forward.
cudaError_t launch_sparse_attention_bwd(DType dtype, const void* q, const void* k, const void* v,
                                        const void* dout, const float* lse2, const float* delta,
                                        const int* rev_ptr, const int* rev_q, int nnz, void* dq,
                                        void* dk, void* dv, const Plan& plan, int head_dim,
                                        float scale, cudaStream_t stream);

}  // namespace sbcuda
