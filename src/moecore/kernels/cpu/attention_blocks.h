// Private building blocks of the CPU flash attention (attention.cpp): a register-tiled f32 GEMM for the
// small dense blocks (scores, P @ V and the five backward products), a row max, and the block sizes they
// assume. Operands are packed f32 tiles padded with zeros to whole micro-tiles, so the kernel has no
// column tails. No softmax logic and no tensor code here; AVX2+FMA intrinsics with a scalar fallback, and an AVX-512
// variant of the GEMM taken where cpu_kernel_isa() says so (the same FMAs per element in the same order: same bits).
#pragma once
#include <cstdint>
#include <type_traits>

#include "moecore/kernels/cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MOECORE_ATTN_AVX512 1
#endif

namespace moecore::ops::cpu::attn {

inline constexpr int64_t kBq = 64;  // queries per block
inline constexpr int64_t kBk = 64;  // keys per block
inline constexpr int64_t kMR = 6;   // micro-tile rows: 6 x 16 keeps 12 accumulators in 16 ymm registers
inline constexpr int64_t kNR = 16;  // micro-tile columns; packed widths are multiples of this

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// C[MR, kNR] (+)= op(A) B for one micro-tile. With TA, row r of op(A) is column r of A stored [K, M];
// both layouts feed the same broadcast, which is why transposed products need no transposed copies.
template <int MR, bool TA>
inline void micro_tile(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                       bool accumulate) {
#if defined(__AVX2__) && defined(__FMA__)
  // Fully unrolled row loops let GCC keep the accumulator arrays in registers instead of on the stack.
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    c0[r] = accumulate ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();
    c1[r] = accumulate ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(TA ? A + k * lda + r : A + r * lda + k);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(C + r * ldc, c0[r]);
    _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
  }
#else
  float acc[MR][kNR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < kNR; ++n) acc[r][n] = accumulate ? C[r * ldc + n] : 0.0f;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r) {
      const float a = TA ? A[k * lda + r] : A[r * lda + k];
      for (int n = 0; n < kNR; ++n) acc[r][n] += a * B[k * ldb + n];
    }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < kNR; ++n) C[r * ldc + n] = acc[r][n];
#endif
}

#if MOECORE_ATTN_AVX512
// The AVX-512 micro-tile: C[MR, 16 NV] (+)= op(A) B with NV zmm vectors per row (2: 32 columns, 12 accumulators as
// the AVX2 tile's; 1: a 16-column tail). Every element gets the AVX2 tile's FMAs in the same order.
template <int MR, int NV, bool TA>
MOECORE_TARGET_AVX512 inline void micro_tile_avx512(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                                                    float* C, int64_t ldc, bool accumulate) {
  __m512 c[MR][NV];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(B + k * ldb + 16 * v);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(TA ? A[k * lda + r] : A[r * lda + k]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
}
#endif

// Calls f(std::integral_constant<int, MR>{}) with MR = rows, 1..kMR: a micro-tile's row count as a constant.
template <class F>
inline void with_tile_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    default:
      return f(std::integral_constant<int, 1>{});
  }
}

// C[M, N] = (accumulate ? C : 0) + op(A) @ B in f32. op(A) is A [M, K] with row stride lda, or with
// trans_a the transpose of A stored [K, M] (row stride lda). B [K, N], row stride ldb. N % kNR == 0.
// Column panels outermost: a K x 16 panel of B (K x 32 for the AVX-512 tiles, a 16-wide one last where N % 32 == 16)
// stays in L1 while every row tile of A streams past it.
template <bool TA>
inline void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                       float* C, int64_t ldc, bool accumulate) {
#if MOECORE_ATTN_AVX512
  const bool avx512 = cpu_kernel_isa() == CpuIsa::avx512;
#else
  const bool avx512 = false;
#endif
  for (int64_t n0 = 0; n0 < N;) {
    const bool wide = avx512 && N - n0 >= 2 * kNR;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const float* a = TA ? A + m0 : A + m0 * lda;
      const float* b = B + n0;
      float* c = C + m0 * ldc + n0;
      with_tile_rows(M - m0 < kMR ? M - m0 : kMR, [&](auto rows) {
        constexpr int MR = decltype(rows)::value;
#if MOECORE_ATTN_AVX512
        if (wide) return micro_tile_avx512<MR, 2, TA>(K, a, lda, b, ldb, c, ldc, accumulate);
        if (avx512) return micro_tile_avx512<MR, 1, TA>(K, a, lda, b, ldb, c, ldc, accumulate);
#endif
        micro_tile<MR, TA>(K, a, lda, b, ldb, c, ldc, accumulate);
      });
    }
    n0 += wide ? 2 * kNR : kNR;
  }
}

// Largest of x[0..n), n % kNR == 0. GCC leaves `omp simd reduction(max)` over std::max scalar (NaN
// rules), and this row max sits on the forward's critical path.
inline float row_max(const float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8);
  for (int64_t j = kNR; j < n; j += kNR) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + j));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + j + 8));
  }
  m0 = _mm256_max_ps(m0, m1);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
#else
  float m = x[0];
  for (int64_t j = 1; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
#endif
}

}  // namespace moecore::ops::cpu::attn
