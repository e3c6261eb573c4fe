// Python binding of the CPU kernels (sparsebalance._C). pybind.h holds torch's tensor
// casters without the rest of torch/extension.h, so this file compiles in seconds.
#include <torch/csrc/utils/pybind.h>

#include "sparse_attention_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SparseBalance CPU kernels: block top-k sparse attention (forward, backward)";
  m.def("sparse_attention_fwd", &sb::sparse_attention_fwd,
        "(q, k, v, qb_start, qb_len, kv_idx, kv_cnt, block_size, scale) -> [out, lse2]");
  m.def("sparse_attention_bwd", &sb::sparse_attention_bwd,
        "(dout, q, k, v, out, lse2, qb_start, qb_len, kv_idx, kv_cnt, block_size, scale) -> [dq, dk, dv]");
}
