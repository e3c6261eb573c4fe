// Torch binding of the block top-k sparse attention CUDA kernels (extension
// sparsebalance._C_cuda): input validation, allocation, dtype dispatch; the kernels and
// their launchers are in sparse_attention_kernels.cu (CUDA headers only), so nvcc never
// parses torch's headers. Built by the host compiler as part of setup.py's CUDAExtension.
//
// No c10/cuda or ATen/cuda headers (a CPU torch lacks some of what they need), so the
// caller passes the current stream handle and selects the device (Python launcher,
// sparsebalance/ops/cuda.py). Syntax check without a CUDA torch ($TORCH = the torch
// package dir, $PYINC = Python's include dir, all on one line):
//   g++ -fsyntax-only -std=c++20 -I$TORCH/include -I$TORCH/include/torch/csrc/api/include
//       -I$PYINC -I$CUDA_HOME/include -DTORCH_EXTENSION_NAME=_C_cuda
//       csrc/cuda/sparse_attention_cuda.cpp
#include <torch/extension.h>

#include <vector>

#include "sparse_attention_kernels.h"

namespace {

using sbcuda::DType;
using sbcuda::Plan;

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
  const int64_t NB = qb_start.numel();
  TORCH_CHECK(qb_len.numel() == NB && kv_idx.dim() == 3 && kv_idx.size(0) == q.size(1) &&
                  kv_idx.size(1) == NB,
              "sparse_attention cuda: kv_idx must be [H, NB, W]");
  TORCH_CHECK(kv_cnt.dim() == 2 && kv_cnt.size(0) == q.size(1) && kv_cnt.size(1) == NB,
              "sparse_attention cuda: kv_cnt must be [H, NB]");
  return Plan{qb_start.data_ptr<int>(), qb_len.data_ptr<int>(), kv_idx.data_ptr<int>(),
              kv_cnt.data_ptr<int>(), (int)qb_start.numel(), (int)kv_idx.size(2),
              (int)q.size(0), (int)q.size(1), (int)k.size(1)};
}

// check() admits float32 and bfloat16 only.
DType dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

void check_head_dim(const at::Tensor& q) {
  TORCH_CHECK(q.size(2) <= sbcuda::kMaxHeadDim, "sparse_attention cuda: head_dim must be <= ",
              sbcuda::kMaxHeadDim);
}

void launch_check(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "sparse_attention cuda: launch failed: ", cudaGetErrorString(err));
}

}  // namespace

std::vector<at::Tensor> sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& qb_start,
                                             const at::Tensor& qb_len, const at::Tensor& kv_idx,
                                             const at::Tensor& kv_cnt, int64_t block_size,
                                             double scale, int64_t stream_handle) {
  check(q, k, v, {qb_start, qb_len, kv_idx, kv_cnt});
  TORCH_CHECK(block_size >= 1, "sparse_attention cuda: block_size must be >= 1");
  auto out = at::empty_like(q);
  auto lse2 = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  const Plan p = make_plan(q, k, qb_start, qb_len, kv_idx, kv_cnt);
  if (p.NB == 0) return {out, lse2};
  check_head_dim(q);
  launch_check(sbcuda::launch_sparse_attention_fwd(
      dtype_of(q), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
      lse2.data_ptr<float>(), p, (int)q.size(2), static_cast<float>(scale),
      reinterpret_cast<cudaStream_t>(stream_handle)));
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
  check(q, k, v, {qb_start, qb_len, kv_idx, kv_cnt, rev_ptr, rev_q});
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.is_contiguous() &&
                  dout.scalar_type() == q.scalar_type(),
              "sparse_attention cuda: dout/out must be contiguous like q");
  TORCH_CHECK(lse2.scalar_type() == at::kFloat && lse2.is_contiguous(),
              "sparse_attention cuda: lse2 must be float32 [H, T]");
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const Plan p = make_plan(q, k, qb_start, qb_len, kv_idx, kv_cnt);
  if (p.NB == 0) return {dq, dk, dv};
  check_head_dim(q);
  auto delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1).t().contiguous();  // [H, T]
  launch_check(sbcuda::launch_sparse_attention_bwd(
      dtype_of(q), q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(),
      lse2.data_ptr<float>(), delta.data_ptr<float>(), rev_ptr.data_ptr<int>(),
      rev_q.data_ptr<int>(), (int)rev_q.size(1), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), p,
      (int)q.size(2), static_cast<float>(scale), reinterpret_cast<cudaStream_t>(stream_handle)));
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
