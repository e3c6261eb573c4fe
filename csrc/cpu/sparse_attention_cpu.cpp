// Block top-k sparse attention on CPU: forward and backward.
//
// The routing plan (which key blocks each (head, query block) keeps) comes
// from Python (sparsebalance/ops/plan.py); this file only does the attention.
// Inputs are copied once into per-head, per-block fp32 tiles padded to kPad
// (Q pre-scaled by scale * log2(e) so the softmax uses exp2), so the inner
// loops never allocate, gather or branch on ragged sizes:
//   Q  [H][NB][Bp][Dp]    K, V [Hkv][NB][Bp][Dp]    Kt, Vt [Hkv][NB][Dp][Bp]
// Forward: OpenMP over (head, query block), online softmax. Backward: dQ per
// (head, query block); dK/dV either owned by one thread per kv head (no races, no
// buffers) or accumulated in per-thread buffers over a fixed split of the items
// (deterministic) and reduced.
// Counts are per (head, query block) (kv_cnt [H][NB]): under per-head threshold
// routing the rows of one query block differ in length by head.
// Only ATen's core and per-operator headers here: the Python binding, which needs
// torch's heavy headers, is bindings.cpp, compiled alongside (make build).
#include "sparse_attention_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <cmath>
#include <limits>
#include <vector>

#include "microkernels.h"

namespace sb {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct Geometry {
  int64_t T, H, Hkv, D, NB, W, B, Bp, Dp;
  const int32_t* qb_start;
  const int32_t* qb_len;
  const int32_t* kv_idx;  // [H][NB][W]
  const int32_t* kv_cnt;  // [H][NB]
  int cnt(int64_t h, int64_t b) const { return kv_cnt[h * NB + b]; }
  int64_t tile() const { return Bp * Dp; }
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Copy rows of x [T][heads][D] into tiles [heads][NB][Bp][Dp] (transposed:
// [heads][NB][Dp][Bp]) multiplied by mul. Padding stays zero.
template <typename scalar_t>
void to_tiles(const scalar_t* x, int64_t heads, const Geometry& g, float mul, float* rows,
              float* cols) {
  at::parallel_for(0, heads * g.NB, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t h = it / g.NB, b = it % g.NB;
      const int64_t s = g.qb_start[b], n = g.qb_len[b];
      float* tr = rows ? rows + it * g.tile() : nullptr;
      float* tc = cols ? cols + it * g.tile() : nullptr;
      for (int64_t r = 0; r < n; ++r) {
        const scalar_t* src = x + ((s + r) * heads + h) * g.D;
        for (int64_t d = 0; d < g.D; ++d) {
          const float val = static_cast<float>(src[d]) * mul;
          if (tr) tr[r * g.Dp + d] = val;
          if (tc) tc[d * g.Bp + r] = val;
        }
      }
    }
  });
}

// Per-thread scratch of the forward.
struct FwdScratch {
  std::vector<float> S, O, m, l;
  explicit FwdScratch(const Geometry& g)
      : S(g.Bp * g.Bp), O(g.Bp * g.Dp), m(g.Bp), l(g.Bp) {}
};

template <typename scalar_t>
void fwd_block(const Geometry& g, int64_t h, int64_t b, const float* Q, const float* Kt,
               const float* V, FwdScratch& w, scalar_t* out, float* lse2) {
  const int64_t hk = h / (g.H / g.Hkv);
  const int ql = g.qb_len[b], cnt = g.cnt(h, b);
  const int Bp = g.Bp, Dp = g.Dp;
  const float* q = Q + (h * g.NB + b) * g.tile();
  float* S = w.S.data();
  float* O = w.O.data();
  std::fill(w.O.begin(), w.O.begin() + (int64_t)ql * Dp, 0.f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const int32_t* row = g.kv_idx + (h * g.NB + b) * g.W;
  for (int e = 0; e < cnt; ++e) {
    const int64_t j = row[e];
    const bool diag = e == cnt - 1;
    const int kn = diag ? ql : (int)g.B;  // valid key columns of this block
    const int64_t kt_off = (hk * g.NB + j) * g.tile();
    gemm(ql, Bp, Dp, q, Dp, 1, Kt + kt_off, Bp, S, Bp, false);
    for (int r = 0; r < ql; ++r) {
      float* s = S + (int64_t)r * Bp;
      const int nk = diag ? r + 1 : kn;
      float mx = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < nk; ++c) mx = s[c] > mx ? s[c] : mx;
      const float mnew = mx > w.m[r] ? mx : w.m[r];
      const float alpha = std::exp2(w.m[r] - mnew);
      const vf mv = splat(mnew);
      vf acc{};
      for (int c = 0; c < Bp; c += kVW) {
        vf p = exp2v(ld(s + c) - mv);
        st(s + c, p);
      }
      for (int c = nk; c < Bp; ++c) s[c] = 0.f;
      for (int c = 0; c < Bp; c += kVW) acc += ld(s + c);
      w.l[r] = w.l[r] * alpha + hsum(acc);
      w.m[r] = mnew;
      if (alpha != 1.f) {
        float* o = O + (int64_t)r * Dp;
        for (int d = 0; d < Dp; d += kVW) st(o + d, ld(o + d) * alpha);
      }
    }
    gemm(ql, Dp, kn, S, Bp, 1, V + kt_off, Dp, O, Dp, true);
  }
  const int64_t s0 = g.qb_start[b];
  for (int r = 0; r < ql; ++r) {
    const float inv = 1.f / w.l[r];
    scalar_t* dst = out + ((s0 + r) * g.H + h) * g.D;
    const float* o = O + (int64_t)r * Dp;
    for (int64_t d = 0; d < g.D; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv);
    lse2[h * g.T + s0 + r] = w.m[r] + std::log2(w.l[r]);
  }
}

struct BwdScratch {
  std::vector<float> S, dP, dO, dQ, delta;
  explicit BwdScratch(const Geometry& g)
      : S(g.Bp * g.Bp), dP(g.Bp * g.Bp), dO(g.Bp * g.Dp), dQ(g.Bp * g.Dp), delta(g.Bp) {}
};

// One (head, query block): writes dq rows, accumulates into dK/dV tiles of kv head hk.
template <typename scalar_t>
void bwd_block(const Geometry& g, int64_t h, int64_t b, const float* Q, const float* K,
               const float* Kt, const float* Vt, const scalar_t* dout, const scalar_t* out,
               const float* lse2, float scale, BwdScratch& w, float* dK, float* dV,
               scalar_t* dq) {
  const int64_t hk = h / (g.H / g.Hkv);
  const int ql = g.qb_len[b], cnt = g.cnt(h, b);
  const int Bp = g.Bp, Dp = g.Dp;
  const int64_t s0 = g.qb_start[b];
  const float* q = Q + (h * g.NB + b) * g.tile();
  float* S = w.S.data();
  float* dP = w.dP.data();
  float* dO = w.dO.data();
  float* dQ = w.dQ.data();
  std::fill(w.dO.begin(), w.dO.end(), 0.f);
  std::fill(w.dQ.begin(), w.dQ.end(), 0.f);
  for (int r = 0; r < ql; ++r) {
    const scalar_t* go = dout + ((s0 + r) * g.H + h) * g.D;
    const scalar_t* o = out + ((s0 + r) * g.H + h) * g.D;
    float dl = 0.f;
    for (int64_t d = 0; d < g.D; ++d) {
      const float x = static_cast<float>(go[d]);
      dO[(int64_t)r * Dp + d] = x;
      dl += x * static_cast<float>(o[d]);
    }
    w.delta[r] = dl;
  }
  const float* lse = lse2 + h * g.T + s0;
  const int32_t* row = g.kv_idx + (h * g.NB + b) * g.W;
  for (int e = 0; e < cnt; ++e) {
    const int64_t j = row[e];
    const bool diag = e == cnt - 1;
    const int kn = diag ? ql : (int)g.B;
    const int64_t off = (hk * g.NB + j) * g.tile();
    gemm(ql, Bp, Dp, q, Dp, 1, Kt + off, Bp, S, Bp, false);
    gemm(ql, Bp, Dp, dO, Dp, 1, Vt + off, Bp, dP, Bp, false);
    for (int r = 0; r < ql; ++r) {
      float* s = S + (int64_t)r * Bp;
      float* dp = dP + (int64_t)r * Bp;
      const vf lv = splat(lse[r]), dv = splat(w.delta[r]);
      for (int c = 0; c < Bp; c += kVW) {
        const vf p = exp2v(ld(s + c) - lv);
        st(s + c, p);
        st(dp + c, p * (ld(dp + c) - dv));
      }
      for (int c = diag ? r + 1 : kn; c < Bp; ++c) s[c] = dp[c] = 0.f;
    }
    gemm(ql, Dp, kn, dP, Bp, 1, K + off, Dp, dQ, Dp, true);
    gemm(kn, Dp, ql, S, 1, Bp, dO, Dp, dV + off, Dp, true);
    gemm(kn, Dp, ql, dP, 1, Bp, q, Dp, dK + off, Dp, true);
  }
  for (int r = 0; r < ql; ++r) {
    scalar_t* dst = dq + ((s0 + r) * g.H + h) * g.D;
    for (int64_t d = 0; d < g.D; ++d) dst[d] = static_cast<scalar_t>(dQ[(int64_t)r * Dp + d] * scale);
  }
}

// Tiles [Hkv][NB][Bp][Dp] -> rows [T][Hkv][D] times mul.
template <typename scalar_t>
void from_tiles(const float* tiles, const Geometry& g, float mul, scalar_t* dst) {
  at::parallel_for(0, g.Hkv * g.NB, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t h = it / g.NB, b = it % g.NB;
      const int64_t s = g.qb_start[b], n = g.qb_len[b];
      const float* t = tiles + it * g.tile();
      for (int64_t r = 0; r < n; ++r)
        for (int64_t d = 0; d < g.D; ++d)
          dst[((s + r) * g.Hkv + h) * g.D + d] = static_cast<scalar_t>(t[r * g.Dp + d] * mul);
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& qb_start, const at::Tensor& qb_len, const at::Tensor& kv_idx,
                  const at::Tensor& kv_cnt, int64_t block_size) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), "sparse_attention cpu: tensors must be on CPU");
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous(), "sparse_attention cpu: q/k/v must be contiguous [T, H, D]");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "sparse_attention cpu: q/k/v dtypes differ");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "sparse_attention cpu: dtype must be float32 or bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "sparse_attention cpu: k/v shapes must be [T, Hkv, D] matching q");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "sparse_attention cpu: H % Hkv != 0");
  TORCH_CHECK(block_size >= 1, "sparse_attention cpu: block_size must be >= 1");
  for (const auto* t : {&qb_start, &qb_len, &kv_idx, &kv_cnt}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "sparse_attention cpu: plan tables must be contiguous int32 CPU tensors");
  }
  const int64_t NB = qb_start.numel();
  TORCH_CHECK(qb_len.numel() == NB, "sparse_attention cpu: plan sizes differ");
  TORCH_CHECK(kv_idx.dim() == 3 && kv_idx.size(0) == q.size(1) && kv_idx.size(1) == NB,
              "sparse_attention cpu: kv_idx must be [H, NB, W]");
  TORCH_CHECK(kv_cnt.dim() == 2 && kv_cnt.size(0) == q.size(1) && kv_cnt.size(1) == NB,
              "sparse_attention cpu: kv_cnt must be [H, NB]");
  const int32_t* cnt = kv_cnt.data_ptr<int32_t>();
  const int32_t* idx = kv_idx.data_ptr<int32_t>();
  const int32_t* len = qb_len.data_ptr<int32_t>();
  const int32_t* st0 = qb_start.data_ptr<int32_t>();
  const int64_t W = kv_idx.size(2), H = q.size(1), T = q.size(0);
  for (int64_t b = 0; b < NB; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= block_size && st0[b] >= 0 && st0[b] + len[b] <= T,
                "sparse_attention cpu: bad query block");
    for (int64_t h = 0; h < H; ++h) {
      const int32_t c = cnt[h * NB + b];
      TORCH_CHECK(c >= 1 && c <= W, "sparse_attention cpu: bad kv_cnt");
      const int32_t* r = idx + (h * NB + b) * W;
      TORCH_CHECK(r[c - 1] == b, "sparse_attention cpu: diagonal block must be last");
      for (int e = 0; e + 1 < c; ++e)
        TORCH_CHECK(r[e] >= 0 && r[e] < b && len[r[e]] == block_size,
                    "sparse_attention cpu: kept off-diagonal blocks must be full earlier blocks");
    }
  }
}

Geometry make_geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qb_start,
                       const at::Tensor& qb_len, const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                       int64_t block_size) {
  Geometry g;
  g.T = q.size(0); g.H = q.size(1); g.Hkv = k.size(1); g.D = q.size(2);
  g.NB = qb_start.numel(); g.W = kv_idx.size(2); g.B = block_size;
  g.Bp = round_up(block_size, kPad); g.Dp = round_up(g.D, kPad);
  g.qb_start = qb_start.data_ptr<int32_t>(); g.qb_len = qb_len.data_ptr<int32_t>();
  g.kv_idx = kv_idx.data_ptr<int32_t>(); g.kv_cnt = kv_cnt.data_ptr<int32_t>();
  return g;
}

at::Tensor zeros_f32(int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kFloat)); }

// Work of item it = h * NB + b: its kept key blocks times its query rows.
int64_t item_cost(const Geometry& g, int64_t it) {
  return (int64_t)g.kv_cnt[it] * g.qb_len[it % g.NB];
}

// The items h * NB + b in order cut into n runs of about equal work: thread t takes
// items [bounds[t], bounds[t + 1]). A fixed split, so the per-thread dK/dV buffers sum
// the same items in the same order on every run (deterministic for a thread count);
// balanced to within one row although rows differ in length by query block and, under
// per-head counts, by head; a run is whole heads mostly, so their tiles stay in cache.
std::vector<int64_t> split_items(const Geometry& g, int n) {
  const int64_t items = g.H * g.NB;
  int64_t total = 0;
  for (int64_t it = 0; it < items; ++it) total += item_cost(g, it);
  std::vector<int64_t> bounds(n + 1, items);
  bounds[0] = 0;
  int64_t done = 0;
  int t = 1;
  for (int64_t it = 0; it < items && t < n; ++it) {
    done += item_cost(g, it);
    while (t < n && done * n >= total * t) bounds[t++] = it + 1;
  }
  return bounds;
}

// Whether the backward's dK/dV may be owned by kv head (one unit per kv head, no
// buffers): the units must spread evenly over the threads. Equal heads do when they
// divide evenly or are many (top-k routing's work per head is data independent);
// per-head counts make heads unequal, so the longest-first schedule of the units is
// simulated and must end within 10% of a perfect split.
bool kv_head_owner(const Geometry& g, int nthreads) {
  if (!(g.Hkv % nthreads == 0 || g.Hkv >= 4 * nthreads)) return false;
  const int64_t rep = g.H / g.Hkv;
  std::vector<int64_t> work(g.Hkv, 0);
  for (int64_t h = 0; h < g.H; ++h)
    for (int64_t b = 0; b < g.NB; ++b) work[h / rep] += item_cost(g, h * g.NB + b);
  if (std::all_of(work.begin(), work.end(), [&](int64_t w) { return w == work[0]; })) return true;
  std::sort(work.begin(), work.end(), std::greater<int64_t>());
  std::vector<int64_t> load(nthreads, 0);
  int64_t total = 0;
  for (int64_t w : work) {
    *std::min_element(load.begin(), load.end()) += w;
    total += w;
  }
  return *std::max_element(load.begin(), load.end()) * nthreads <= total * 11 / 10;
}

}  // namespace

std::vector<at::Tensor> sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& qb_start,
                                             const at::Tensor& qb_len, const at::Tensor& kv_idx,
                                             const at::Tensor& kv_cnt, int64_t block_size,
                                             double scale) {
  check_inputs(q, k, v, qb_start, qb_len, kv_idx, kv_cnt, block_size);
  const Geometry g = make_geometry(q, k, qb_start, qb_len, kv_idx, kv_cnt, block_size);
  auto out = at::empty_like(q);
  auto lse2 = at::empty({g.H, g.T}, q.options().dtype(at::kFloat));
  if (g.NB == 0) return {out, lse2};
  at::Tensor Q = zeros_f32(g.H * g.NB * g.tile()), Kt = zeros_f32(g.Hkv * g.NB * g.tile()),
             V = zeros_f32(g.Hkv * g.NB * g.tile());
  const float c = static_cast<float>(scale) * kLog2e;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "sparse_attention_fwd", [&] {
    to_tiles(q.data_ptr<scalar_t>(), g.H, g, c, Q.data_ptr<float>(), nullptr);
    to_tiles(k.data_ptr<scalar_t>(), g.Hkv, g, 1.f, nullptr, Kt.data_ptr<float>());
    to_tiles(v.data_ptr<scalar_t>(), g.Hkv, g, 1.f, V.data_ptr<float>(), nullptr);
    const int64_t items = g.H * g.NB;
    std::atomic<int64_t> next{0};
    // Dynamic work queue of many small items: rows differ in length (later query
    // blocks keep more key blocks; per-head counts differ by head), and a thread that
    // finishes early takes the next, so the threads end within one row of each other.
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      FwdScratch w(g);
      for (int64_t it; (it = next.fetch_add(1)) < items;)
        fwd_block<scalar_t>(g, it / g.NB, it % g.NB, Q.data_ptr<float>(), Kt.data_ptr<float>(),
                            V.data_ptr<float>(), w, out.data_ptr<scalar_t>(), lse2.data_ptr<float>());
    });
  });
  return {out, lse2};
}

std::vector<at::Tensor> sparse_attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                             const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& out, const at::Tensor& lse2,
                                             const at::Tensor& qb_start, const at::Tensor& qb_len,
                                             const at::Tensor& kv_idx, const at::Tensor& kv_cnt,
                                             int64_t block_size, double scale) {
  check_inputs(q, k, v, qb_start, qb_len, kv_idx, kv_cnt, block_size);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.is_contiguous() &&
                  out.is_contiguous() && dout.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "sparse_attention cpu: dout/out must be contiguous like q");
  TORCH_CHECK(lse2.scalar_type() == at::kFloat && lse2.is_contiguous() &&
                  lse2.size(0) == q.size(1) && lse2.size(1) == q.size(0),
              "sparse_attention cpu: lse2 must be float32 [H, T]");
  const Geometry g = make_geometry(q, k, qb_start, qb_len, kv_idx, kv_cnt, block_size);
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  if (g.NB == 0) return {dq, dk, dv};
  const int64_t kvn = g.Hkv * g.NB * g.tile();
  at::Tensor Q = zeros_f32(g.H * g.NB * g.tile()), K = zeros_f32(kvn), Kt = zeros_f32(kvn),
             Vt = zeros_f32(kvn);
  const float c = static_cast<float>(scale) * kLog2e;
  const int nthreads = at::get_num_threads();
  // dK/dV owned by kv head where that balances (kv_head_owner), else per-thread buffers.
  const bool owner = kv_head_owner(g, nthreads);
  const int nbuf = owner ? 1 : nthreads;
  at::Tensor dK = zeros_f32(nbuf * kvn), dV = zeros_f32(nbuf * kvn);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "sparse_attention_bwd", [&] {
    to_tiles(q.data_ptr<scalar_t>(), g.H, g, c, Q.data_ptr<float>(), nullptr);
    to_tiles(k.data_ptr<scalar_t>(), g.Hkv, g, 1.f, K.data_ptr<float>(), Kt.data_ptr<float>());
    to_tiles(v.data_ptr<scalar_t>(), g.Hkv, g, 1.f, nullptr, Vt.data_ptr<float>());
    const int64_t rep = g.H / g.Hkv;
    // owner: a queue of kv heads; else each thread its fixed run of items (split_items)
    const std::vector<int64_t> bounds = owner ? std::vector<int64_t>() : split_items(g, nthreads);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t lo, int64_t hi) {
      BwdScratch w(g);
      for (int64_t tid = lo; tid < hi; ++tid) {
        const int64_t boff = owner ? 0 : tid * kvn;
        auto run = [&](int64_t h, int64_t b) {
          bwd_block<scalar_t>(g, h, b, Q.data_ptr<float>(), K.data_ptr<float>(), Kt.data_ptr<float>(),
                              Vt.data_ptr<float>(), dout.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              lse2.data_ptr<float>(), static_cast<float>(scale), w,
                              dK.data_ptr<float>() + boff, dV.data_ptr<float>() + boff,
                              dq.data_ptr<scalar_t>());
        };
        if (owner) {
          for (int64_t u; (u = next.fetch_add(1)) < g.Hkv;)
            for (int64_t h = u * rep; h < (u + 1) * rep; ++h)
              for (int64_t b = 0; b < g.NB; ++b) run(h, b);
        } else {
          for (int64_t it = bounds[tid]; it < bounds[tid + 1]; ++it) run(it / g.NB, it % g.NB);
        }
      }
    });
    if (!owner) {  // reduce per-thread buffers into buffer 0
      float* a = dK.data_ptr<float>();
      float* bv = dV.data_ptr<float>();
      at::parallel_for(0, kvn, 4096, [&](int64_t lo, int64_t hi) {
        for (int t = 1; t < nbuf; ++t)
          for (int64_t i = lo; i < hi; ++i) {
            a[i] += a[t * kvn + i];
            bv[i] += bv[t * kvn + i];
          }
      });
    }
    from_tiles(dK.data_ptr<float>(), g, 1.f / kLog2e, dk.data_ptr<scalar_t>());
    from_tiles(dV.data_ptr<float>(), g, 1.f, dv.data_ptr<scalar_t>());
  });
  return {dq, dk, dv};
}

}  // namespace sb
