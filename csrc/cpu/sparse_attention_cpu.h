// Block top-k sparse attention on CPU (sparse_attention_cpu.cpp), as bindings.cpp
// exposes it to Python.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace sb {

// (out [T, H, D], lse2 [H, T]); lse2 is the row log-sum-exp in base 2 of the scaled logits.
std::vector<at::Tensor> sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& qb_start,
                                             const at::Tensor& qb_len, const at::Tensor& kv_idx,
                                             const at::Tensor& kv_cnt, int64_t block_size,
                                             double scale);

// (dq, dk, dv).
std::vector<at::Tensor> sparse_attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                             const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& out, const at::Tensor& lse2,
                                             const at::Tensor& qb_start, const at::Tensor& qb_len,
                                             const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                             int64_t block_size, double scale);

}  // namespace sb
