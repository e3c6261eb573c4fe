// Register-tiled fp32 micro-kernels for the CPU sparse attention kernel.
//
// Written with GCC/Clang vector extensions so one source vectorises for
// whatever -march the build selects (AVX-512 here, AVX2 or NEON elsewhere).
// Every tile dimension handed to gemm() as N is a multiple of kPad, so the
// column loop never needs a tail; the row loop has compile-time tails.
#pragma once

#include <cstring>
#include <cmath>

namespace sb {

#if defined(__AVX512F__)
constexpr int kVW = 16;  // floats per vector register
constexpr int kMR = 8;   // rows of a register tile (8 x 2 zmm accumulators)
#else
constexpr int kVW = 8;
constexpr int kMR = 4;   // 16 ymm registers: 8 accumulators + operands
#endif
constexpr int kNR = 2 * kVW;  // columns of a register tile
constexpr int kPad = 32;      // tile dims are padded to a multiple of this (>= kNR)

typedef float vf __attribute__((vector_size(kVW * 4)));
typedef int vi __attribute__((vector_size(kVW * 4)));

static inline vf ld(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return vf{} + x; }

// 2^x for x <= 0 region of softmax; inputs below -126 give ~0 (callers zero
// masked entries explicitly). Degree-6 polynomial on [-0.5, 0.5]: rel. err ~2e-7.
static inline vf exp2v(vf x) {
  const vf lo = splat(-126.f);
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: rounds to nearest integer
  vf t = x + magic;
  vf n = t - magic;
  vf f = x - n;
  vf p = splat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  vi ni = (vi)t - (vi)magic;
  return (vf)((vi)p + (ni << 23));
}

static inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kVW; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

static inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kVW; ++i) s += v[i];
  return s;
}

// C[R x kNR] (+)= sum_k A(i, k) * Bm[k, 0:kNR], with A(i, k) = A[i * sai + k * sak].
template <int R>
static inline void tile(int K, const float* A, long sai, long sak, const float* Bm, long ldb,
                        float* C, long ldc, bool accumulate) {
  vf c0[R], c1[R];
  for (int r = 0; r < R; ++r) {
    c0[r] = accumulate ? ld(C + r * ldc) : vf{};
    c1[r] = accumulate ? ld(C + r * ldc + kVW) : vf{};
  }
  for (int k = 0; k < K; ++k) {
    const vf b0 = ld(Bm + k * ldb), b1 = ld(Bm + k * ldb + kVW);
    const float* a = A + k * sak;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float av = a[r * sai];
      c0[r] += av * b0;
      c1[r] += av * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    st(C + r * ldc, c0[r]);
    st(C + r * ldc + kVW, c1[r]);
  }
}

// C[M x N] (+)= A[M x K] * Bm[K x N]; A strided (row-major: sai=lda, sak=1;
// transposed: sai=1, sak=lda). N must be a multiple of kNR.
static inline void gemm(int M, int N, int K, const float* A, long sai, long sak, const float* Bm,
                        long ldb, float* C, long ldc, bool accumulate) {
  for (int n = 0; n < N; n += kNR) {
    int m = 0;
    for (; m + kMR <= M; m += kMR)
      tile<kMR>(K, A + m * sai, sai, sak, Bm + n, ldb, C + m * ldc + n, ldc, accumulate);
    const float* a = A + m * sai;
    float* c = C + m * ldc + n;
    switch (M - m) {
      case 1: tile<1>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
      case 2: tile<2>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
      case 3: tile<3>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
#if defined(__AVX512F__)
      case 4: tile<4>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
      case 5: tile<5>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
      case 6: tile<6>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
      case 7: tile<7>(K, a, sai, sak, Bm + n, ldb, c, ldc, accumulate); break;
#endif
      default: break;
    }
  }
}

}  // namespace sb
