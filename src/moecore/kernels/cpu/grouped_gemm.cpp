// CPU grouped GEMM for MoE experts: one oneDNN sgemm call per group over its contiguous row segment.
// dnnl_sgemm needs no primitive, so row counts that change every step cost nothing to set up (a cached
// matmul primitive per row count would cost ~ms each); on AVX2 hosts the matmul primitive runs this same
// jit sgemm. bf16 and f16 operands are widened to f32 in bounded, reused scratch (oneDNN 2.6 has no bf16
// GEMM without AVX-512, no f16 one without AVX-512 FP16), so they save memory, not time. Deterministic for a fixed
// thread count. Not here: dense GEMMs (gemm.cpp).
#include <oneapi/dnnl/dnnl.h>

#include <omp.h>

#include <exception>
#include <type_traits>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

// Elements per widened operand tile: 16 MiB of f32, enough that one expert's weight is widened once.
constexpr int64_t kWidenBudget = int64_t{4} << 20;
constexpr int64_t kMinTile = 64;

// Leading dimensions that are multiples of 512 B make the jit sgemm's transposed-A path alias in cache
// (measured: [1024 x rows]^T x [rows x 256] runs at 80 GFLOP/s with lda 1024, 177 with lda 1040), so
// scratch rows are padded off such strides.
int64_t padded_ld(int64_t cols) {
  return cols % 128 == 0 ? cols + 16 : cols;
}

// 64-byte aligned grow-only f32 scratch of the calling thread, one per slot (A, B, C tiles).
float* scratch_f32(int slot, int64_t elems) {
  static thread_local Tensor bufs[3];
  Tensor& t = bufs[slot];
  if (!t.defined() || t.numel() < elems) t = Tensor::empty({elems}, DType::f32, MemCategory::workspace);
  return t.data<float>();
}

// dst[r * ldd + j] = src[r * lds + j] as f32, for r < rows, j < cols.
template <class T>
void widen(float* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols > cpu::kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * lds;
    float* d = dst + r * ldd;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) d[j] = ld(s[j]);
  }
}

// dst[r * ldd + j] = src[r * lds + j] rounded to T (bf16 or f16), for r < rows, j < cols.
template <class T>
void narrow(T* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols > cpu::kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    T* d = dst + r * ldd;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) st(d[j], s[j]);
  }
}

// c = beta * c on an f32 [rows, cols] block (an empty reduction).
void scale_block(float* c, int64_t ldc, int64_t rows, int64_t cols, float beta) {
  if (beta == 1.0f) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = beta == 0.0f ? 0.0f : beta * c[r * ldc + j];
}

// Row-major C[M, N] = op(A) @ op(B) + beta * C, f32.
void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
           float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_block(C, ldc, M, N, beta);
    return;
  }
  const dnnl_status_t s = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
  MOECORE_CHECK(s == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(s), " for M ", M, " N ", N, " K ",
                K, " lda ", lda, " ldb ", ldb, " ldc ", ldc);
}

// One group of gemm_grouped: C[n, N] = A[n, K] @ op(Bg) + beta * C, any mix of f32/bf16/f16 operands.
// Operands that are not f32 are widened tile by tile: B per N tile (once per group when it fits the
// budget), A per row tile, and a bf16 or f16 C through an f32 accumulator tile.
template <class TA, class TC>
void group_product(TC* c, int64_t ldc, const TA* a, int64_t lda, const TA* b, int64_t bs0, int64_t bs1, bool trans_b,
                   int64_t n, int64_t N, int64_t K, float beta) {
  constexpr bool a_f32 = std::is_same_v<TA, float>, c_f32 = std::is_same_v<TC, float>;
  if constexpr (a_f32 && c_f32) {
    sgemm(false, trans_b, n, N, K, a, lda, b, bs0, beta, c, ldc);
    return;
  }
  auto tile = [](int64_t want, int64_t extent) { return std::min(extent, std::max(want, kMinTile)); };
  int64_t nc = a_f32 ? N : tile(kWidenBudget / std::max<int64_t>(K, 1), N);
  int64_t mc = a_f32 ? n : tile(kWidenBudget / std::max<int64_t>(K, 1), n);
  if (!c_f32) mc = std::min(mc, tile(kWidenBudget / nc, n));
  for (int64_t n0 = 0; n0 < N; n0 += nc) {
    const int64_t nt = std::min(N, n0 + nc) - n0;
    const float* bt;
    int64_t ldb;
    if constexpr (a_f32) {
      bt = trans_b ? b + n0 * bs0 : b + n0 * bs1;
      ldb = bs0;
    } else {  // trans_b: rows [n0, n0 + nt) of [N, K]; else columns [n0, n0 + nt) of [K, N]
      ldb = padded_ld(trans_b ? K : nt);
      float* w = scratch_f32(1, (trans_b ? nt : K) * ldb);
      if (trans_b)
        widen(w, ldb, b + n0 * bs0, bs0, nt, K);
      else
        widen(w, ldb, b + n0, bs0, K, nt);
      bt = w;
    }
    for (int64_t m0 = 0; m0 < n; m0 += mc) {
      const int64_t mt = std::min(n, m0 + mc) - m0;
      const float* at;
      int64_t lda_t;
      if constexpr (a_f32) {
        at = a + m0 * lda;
        lda_t = lda;
      } else {
        lda_t = padded_ld(K);
        float* w = scratch_f32(0, mt * lda_t);
        widen(w, lda_t, a + m0 * lda, lda, mt, K);
        at = w;
      }
      TC* ct = c + m0 * ldc + n0;
      if constexpr (c_f32) {
        sgemm(false, trans_b, mt, nt, K, at, lda_t, bt, ldb, beta, ct, ldc);
      } else {
        const int64_t ldacc = padded_ld(nt);
        float* acc = scratch_f32(2, mt * ldacc);
        if (beta != 0.0f) widen(acc, ldacc, ct, ldc, mt, nt);
        sgemm(false, trans_b, mt, nt, K, at, lda_t, bt, ldb, beta, acc, ldacc);
        narrow(ct, ldc, acc, ldacc, mt, nt);
      }
    }
  }
}

// One group of gemm_grouped_wgrad: C[M, N] = A[n, M]^T @ B[n, N] + beta * C, C f32, n > 0.
// f32 operands go straight to sgemm unless A's stride hits the aliasing case above; then A (and, for bf16 or
// f16, both operands) is copied in row chunks to padded scratch and the chunks accumulate into C.
template <class T>
void group_wgrad(float* c, int64_t ldc, const T* a, int64_t lda, const T* b, int64_t ldb, int64_t n, int64_t M,
                 int64_t N, float beta) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const bool pad_a = !f32 || (lda % 128 == 0 && std::min(M, N) < 512);
  if (!pad_a) {
    if constexpr (f32) sgemm(true, false, M, N, n, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int64_t kc = std::min(n, std::max(kMinTile, kWidenBudget / std::max(M, N)));
  const int64_t ldwa = padded_ld(M), ldwb = padded_ld(N);
  for (int64_t k0 = 0; k0 < n; k0 += kc) {
    const int64_t kt = std::min(n, k0 + kc) - k0;
    float* wa = scratch_f32(0, kt * ldwa);
    widen(wa, ldwa, a + k0 * lda, lda, kt, M);
    const float* bt;
    int64_t ldbt;
    if constexpr (f32) {
      bt = b + k0 * ldb;
      ldbt = ldb;
    } else {
      float* wb = scratch_f32(1, kt * ldwb);
      widen(wb, ldwb, b + k0 * ldb, ldb, kt, N);
      bt = wb;
      ldbt = ldwb;
    }
    sgemm(true, false, M, N, kt, wa, ldwa, bt, ldbt, k0 == 0 ? beta : 1.0f, c, ldc);
  }
}

// Calls fn(g, first_row) for every non-empty group. With enough groups and none much larger than a thread's
// share, whole groups go to threads (sgemm then runs single-threaded inside the parallel region): that
// skips sgemm's per-call thread split and barrier, and dynamic scheduling keeps both cores busy when the
// machine is shared (measured: 0.92 of peak where one group at a time on all threads fell to 0.48).
// Otherwise groups run one after another, each on all threads. Either choice is a function of the group
// sizes and the thread count only, so results are deterministic for a fixed thread count.
template <class Fn>
void for_each_group(const std::vector<int64_t>& group_rows, Fn&& fn) {
  static thread_local std::vector<int64_t> offsets;
  const int64_t G = static_cast<int64_t>(group_rows.size());
  offsets.resize(G + 1);
  offsets[0] = 0;
  int64_t largest = 0;
  for (int64_t g = 0; g < G; ++g) {
    offsets[g + 1] = offsets[g] + group_rows[g];
    largest = std::max(largest, group_rows[g]);
  }
  const int64_t threads = omp_get_max_threads();
  const bool by_group = threads > 1 && G >= 2 * threads && largest * 2 * threads <= offsets[G];
  const int64_t* off = offsets.data();  // the caller's thread_local, not each worker's
  if (!by_group) {
    for (int64_t g = 0; g < G; ++g)
      if (group_rows[g] > 0) fn(g, off[g]);
    return;
  }
  std::exception_ptr error;  // an exception must not leave the parallel region
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t g = 0; g < G; ++g) {
    if (group_rows[g] == 0) continue;
    try {
      fn(g, off[g]);
    } catch (...) {
#pragma omp critical(moecore_grouped_gemm_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

void check_unit_last_stride(const cpu::Checker& chk, std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (chk.get(name).numel() > 0 && chk.get(name).stride(-1) != 1) chk.fail(name, " needs a unit last stride");
}

}  // namespace

void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows_t, float beta,
                  const Context& ctx) {
  const cpu::Checker chk("gemm_grouped", ctx, {{"c", &c}, {"a", &a}, {"b", &b}, {"group_rows", &group_rows_t}},
                         cpu::Backends::cpu_and_cuda);
  chk.rank("c", 2);
  chk.rank("a", 2);
  chk.rank("b", 3);
  chk.float_dtype("a");
  chk.float_dtype("c");
  chk.same_dtype("b", "a");
  check_unit_last_stride(chk, {"c", "a", "b"});
  const int64_t R = a.size(0), K = a.size(1), G = b.size(0);
  const int64_t N = trans_b ? b.size(1) : b.size(2), Kb = trans_b ? b.size(2) : b.size(1);
  if (Kb != K || c.size(0) != R || c.size(1) != N)
    chk.fail("shapes do not match c [R, N] = a [R, K] @ op(b[g]) with trans_b = ", trans_b);
  cpu::check_group_rows(chk, G);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::gemm_grouped(c, a, b, trans_b, group_rows_t, beta, ctx);
  const std::vector<int64_t>& group_rows = cpu::group_counts(chk, G, R);
  cpu::with_float_type(a.dtype(), [&](auto ta) {
    cpu::with_float_type(c.dtype(), [&](auto tc) {
      using TA = decltype(ta);
      using TC = decltype(tc);
      const TA* ap = static_cast<const TA*>(a.raw());
      const TA* bp = static_cast<const TA*>(b.raw());
      TC* cp = static_cast<TC*>(c.raw());
      for_each_group(group_rows, [&](int64_t g, int64_t o) {
        group_product(cp + o * c.stride(0), c.stride(0), ap + o * a.stride(0), a.stride(0), bp + g * b.stride(0),
                      b.stride(1), 1, trans_b, group_rows[g], N, K, beta);
      });
    });
  });
}

void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows_t, float beta,
                        const Context& ctx) {
  const cpu::Checker chk("gemm_grouped_wgrad", ctx, {{"c", &c}, {"a", &a}, {"b", &b}, {"group_rows", &group_rows_t}},
                         cpu::Backends::cpu_and_cuda);
  chk.rank("c", 3);
  chk.rank("a", 2);
  chk.rank("b", 2);
  chk.dtype("c", DType::f32);
  chk.float_dtype("a");
  chk.same_dtype("b", "a");
  check_unit_last_stride(chk, {"c", "a", "b"});
  const int64_t R = a.size(0), M = a.size(1), N = b.size(1), G = c.size(0);
  if (b.size(0) != R || c.size(1) != M || c.size(2) != N)
    chk.fail("shapes do not match c [G, M, N] = a [R, M]^T @ b [R, N] per group");
  cpu::check_group_rows(chk, G);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::gemm_grouped_wgrad(c, a, b, group_rows_t, beta, ctx);
  const std::vector<int64_t>& group_rows = cpu::group_counts(chk, G, R);
  float* cp = c.data<float>();
  cpu::with_float_type(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const T* ap = static_cast<const T*>(a.raw());
    const T* bp = static_cast<const T*>(b.raw());
    for (int64_t g = 0; g < G; ++g)
      if (group_rows[g] == 0) scale_block(cp + g * c.stride(0), c.stride(1), M, N, beta);
    for_each_group(group_rows, [&](int64_t g, int64_t o) {
      group_wgrad(cp + g * c.stride(0), c.stride(1), ap + o * a.stride(0), a.stride(0), bp + o * b.stride(0),
                  b.stride(0), group_rows[g], M, N, beta);
    });
  });
}

}  // namespace moecore::ops
