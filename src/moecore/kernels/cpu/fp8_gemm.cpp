// CPU FP8 GEMMs (ops_fp8.h): each operand quantised and dequantised into a scratch copy (f32, or bf16 for a bf16
// operand where the bf16 GEMM runs native: cpu_isa.h) -- the FP8 values themselves for a per-tensor scale (which then
// multiplies alpha), the values times their block's power-of-two scale_inv otherwise, both exact in f32 and bf16 --
// then the plain GEMM on the copies. Blocks are computed whole by one thread (a per-tensor amax is a max, which no
// thread split changes), so any thread count gives the same bits.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "moecore/kernels/common/fp8.h"
#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/cpu_isa.h"
#include "moecore/kernels/ops_fp8.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOECORE_FP8_AVX2 1
#endif

namespace moecore::ops {
namespace {

using cpu::ld;
using cpu::st;

#if MOECORE_FP8_AVX2
// 8 consecutive f32 or bf16 values as f32 (a bf16 is the top half of its f32).
template <class T>
inline __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>)
    return _mm256_loadu_ps(x);
  else
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}
#endif

// The quantisation's two passes over a run of n elements of one row: the largest |x| (NaN skipped, as
// fp8::fmax_skip_nan; `bad` set by a NaN or an infinity) and the cast out[i] = round_to(x[i] * scale) * inv. AVX2 for
// f32 outputs (8 lanes, the scalar loop for the tail): the same bits as the scalar loop for every finite input (a
// max is a max; the cast is round_to's arithmetic lane by lane); a NaN or infinite input stops the run anyway.
template <class T>
float run_amax(const T* x, int64_t n, int& bad) {
  float m = 0.0f;
  int64_t i = 0;
#if MOECORE_FP8_AVX2
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), fmax = _mm256_set1_ps(FLT_MAX);
    __m256 mv = _mm256_setzero_ps(), badv = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_and_ps(load8(x + i), abs_mask);
      badv = _mm256_or_ps(badv, _mm256_cmp_ps(v, fmax, _CMP_NLE_UQ));  // !(v <= FLT_MAX): NaN or infinity
      mv = _mm256_max_ps(v, mv);                                       // a NaN v leaves mv (the second operand)
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    m = _mm_cvtss_f32(h);
    bad |= _mm256_movemask_ps(badv) != 0;
  }
#endif
  for (; i < n; ++i) {
    const float v = std::fabs(ld(x[i]));
    bad |= !(v <= FLT_MAX);
    m = fp8::fmax_skip_nan(m, v);
  }
  return m;
}

#if MOECORE_FP8_AVX2
// fp8::round_to on 8 lanes (finite inputs; an infinity saturates as there, a NaN gives +-max here).
template <bool E5M2>
inline __m256 round_to8(__m256 y) {
  constexpr int kShift = E5M2 ? 21 : 20;
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign_mask, y);
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, kShift), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32((1 << (kShift - 1)) - 1), odd));
  const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(~((1 << kShift) - 1))));
  const __m256 magic = _mm256_set1_ps(E5M2 ? 0x1p7f : 0x1p14f);
  const __m256 subnormal = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
  const __m256 max = _mm256_set1_ps(fp8::max_of(E5M2));
  __m256 r =
      _mm256_blendv_ps(normal, subnormal, _mm256_cmp_ps(a, _mm256_set1_ps(E5M2 ? 0x1p-14f : 0x1p-6f), _CMP_LT_OQ));
  r = _mm256_blendv_ps(max, r, _mm256_cmp_ps(a, max, _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(y, sign_mask));
}

template <bool E5M2, class T>
void run_cast8(const T* x, int64_t& i, int64_t n, float* out, float scale, float inv) {
  const __m256 sv = _mm256_set1_ps(scale), iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(round_to8<E5M2>(_mm256_mul_ps(v, sv)), iv));
  }
}
#endif

template <class T, class O>
void run_cast(const T* x, int64_t n, O* out, float scale, float inv, bool e5m2) {
  int64_t i = 0;
#if MOECORE_FP8_AVX2
  if constexpr (std::is_same_v<O, float> && (std::is_same_v<T, float> || std::is_same_v<T, bf16>)) {
    if (e5m2)
      run_cast8<true>(x, i, n, out, scale, inv);
    else
      run_cast8<false>(x, i, n, out, scale, inv);
  }
#endif
  for (; i < n; ++i) st(out[i], fp8::round_to(ld(x[i]) * scale, e5m2) * inv);
}

// What quantising one operand found: its scale_inv when the operand is one block (else 1: the copy carries the
// scales), its amax, and whether every element was finite.
struct Quantized {
  float scale_inv = 1.0f;
  float amax = 0.0f;
  bool finite = true;
};

struct BlockScale {
  float scale, inv;
};

BlockScale scale_of(float amax, bool e5m2, const Fp8Operand& p, int64_t group) {
  switch (p.rule) {
    case Fp8ScaleRule::given: {
      const float s = p.scale[static_cast<size_t>(group)];
      return {s, 1.0f / s};
    }
    case Fp8ScaleRule::current:
    case Fp8ScaleRule::current_pow2: {
      const float s =
          fp8::scale_from_amax(amax, fp8::max_of(e5m2), p.rule == Fp8ScaleRule::current_pow2, 0.0f, p.inf_scale);
      return {s, 1.0f / s};
    }
    case Fp8ScaleRule::mx: {
      const uint8_t e = fp8::e8m0_of_amax(amax, e5m2);
      return {fp8::e8m0_scale(e), fp8::e8m0_value(e)};
    }
  }
  return {1.0f, 1.0f};
}

// x [R, C] (row stride ldx, unit last stride) quantised in blocks br x bc of this stored layout into out [R, C]
// (contiguous, f32 or x's dtype: the values are exact in both).
template <class T, class O>
Quantized quantize_into(const T* x, int64_t ldx, int64_t R, int64_t C, O* out, int64_t br, int64_t bc, bool e5m2,
                        const Fp8Operand& p, int64_t group) {
  Quantized res;
  if (R == 0 || C == 0) return res;
  br = br > 0 ? std::min(br, R) : R;
  bc = bc > 0 ? std::min(bc, C) : C;
  const bool whole = br == R && bc == C;
  float total = 0.0f;
  int bad = 0;
  if (whole) {  // one scale: a parallel amax, then a parallel cast of the FP8 values
#pragma omp parallel for schedule(static) reduction(max : total) reduction(| : bad) if (R * C > cpu::kParallelWork)
    for (int64_t r = 0; r < R; ++r) {
      int b = 0;
      total = std::max(total, run_amax(x + r * ldx, C, b));
      bad |= b;
    }
    const BlockScale s = scale_of(total, e5m2, p, group);
#pragma omp parallel for schedule(static) if (R * C > cpu::kParallelWork)
    for (int64_t r = 0; r < R; ++r) run_cast(x + r * ldx, C, out + r * C, s.scale, 1.0f, e5m2);
    res.scale_inv = s.inv;
  } else {  // bands of br rows, each band's column blocks: amaxes row by row, then the cast
    const int64_t bands = (R + br - 1) / br, nb = (C + bc - 1) / bc;
#pragma omp parallel reduction(max : total) reduction(| : bad) if (R * C > cpu::kParallelWork)
    {
      std::vector<float> amax(nb);
      std::vector<BlockScale> s(nb);
#pragma omp for schedule(static)
      for (int64_t band = 0; band < bands; ++band) {
        const int64_t r0 = band * br, r1 = std::min(R, r0 + br);
        std::fill(amax.begin(), amax.end(), 0.0f);
        int b = 0;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t c0 = j * bc, n = std::min(C, c0 + bc) - c0;
            amax[j] = fp8::fmax_skip_nan(amax[j], run_amax(x + r * ldx + c0, n, b));
          }
        for (int64_t j = 0; j < nb; ++j) {
          s[j] = scale_of(amax[j], e5m2, p, group);
          total = std::max(total, amax[j]);
        }
        bad |= b;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t c0 = j * bc, n = std::min(C, c0 + bc) - c0;
            run_cast(x + r * ldx + c0, n, out + r * C + c0, s[j].scale, s[j].inv, e5m2);
          }
      }
    }
  }
  res.amax = total;
  res.finite = bad == 0;
  return res;
}

// The dtype of the quantised copies of `operands` (f32 or bf16): f32 where the GEMM on them would widen bf16 to f32
// anyway (the grouped GEMMs always; the plain ones where cpu_bf16_gemm() is widened), which saves that pass.
DType copy_dtype(DType operands, bool grouped) {
  const bool native = operands == DType::bf16 && !grouped && cpu_bf16_gemm() == Bf16Gemm::native;
  return native ? DType::bf16 : DType::f32;
}

// A grow-only contiguous scratch of the calling thread per operand slot and dtype (f32, bf16), on the op's device,
// shaped [rows, cols].
Tensor scratch(int slot, int64_t rows, int64_t cols, DType dtype, Device device) {
  static thread_local Tensor bufs[2][2];
  Tensor& t = bufs[slot][dtype == DType::bf16 ? 1 : 0];
  const int64_t n = rows * cols;
  if (!t.defined() || t.numel() < n || t.device() != device)
    t = Tensor::empty({std::max<int64_t>(n, 1)}, dtype, MemCategory::workspace, device);
  return t.slice(0, 0, n).view({rows, cols});
}

// The operand view x (stored [R, C]; group `group` of a grouped GEMM, else 0) quantised into dst (its rows [R, C]
// starting at dst's row row0), its amax maxed into p.amax[group] when given. reduction_along_rows: the stored layout is
// [reduction, rows] (a transposed operand), so the operand's blocks [rows, reduction] are (bc, br) here.
Quantized quantize_operand(const Tensor& x, Tensor& dst, bool reduction_along_rows, const Fp8Operand& p,
                           const Fp8Gemm& g, const char* name, int64_t group = 0) {
  const bool e5m2 = p.format == DType::f8e5m2;
  const int64_t br = reduction_along_rows ? p.block_cols : p.block_rows;
  const int64_t bc = reduction_along_rows ? p.block_rows : p.block_cols;
  Quantized q;
  cpu::with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
      const T* src = static_cast<const T*>(x.raw());
      if (dst.dtype() == DType::f32)
        q = quantize_into(src, x.stride(0), x.size(0), x.size(1), static_cast<float*>(dst.raw()), br, bc, e5m2, p,
                          group);
      else if (dst.dtype() == x.dtype())
        q = quantize_into(src, x.stride(0), x.size(0), x.size(1), static_cast<T*>(dst.raw()), br, bc, e5m2, p, group);
      else
        MOECORE_FAIL("gemm (fp8): ", g.layer, g.linear, " ", g.pass, ": a ", dtype_name(x.dtype()),
                     " operand quantised into ", dtype_name(dst.dtype()));
    } else {
      MOECORE_FAIL("gemm (fp8): ", g.layer, g.linear, " ", g.pass, ": operands must be f32 or bf16, got ",
                   dtype_name(x.dtype()));
    }
  });
  if (!q.finite)
    MOECORE_FAIL("FP8 training stops: ", g.layer, g.linear, " ", g.pass, ": the ", name,
                 " holds an infinity or a NaN (its amax is not finite), so it has no FP8 scale; the numbers broke "
                 "in or before this layer");
  if (!p.amax.empty()) {
    float& a = p.amax[static_cast<size_t>(group)];
    a = fp8::fmax_skip_nan(a, q.amax);
  }
  return q;
}

// groups: the GEMM's groups (1 for a plain GEMM), the entries given scales and amax outputs must have.
void check_fp8(const cpu::Checker& chk, const Tensor& a, const Fp8Gemm& fp8, int64_t groups) {
  if (a.dtype() != DType::f32 && a.dtype() != DType::bf16)
    chk.fail("FP8 operands are quantised from f32 or bf16, got ", dtype_name(a.dtype()));
  for (const Fp8Operand* o : {&fp8.a, &fp8.b}) {
    if (o->format != DType::f8e4m3 && o->format != DType::f8e5m2)
      chk.fail("an FP8 operand's format must be f8e4m3 or f8e5m2, got ", dtype_name(o->format));
    if (o->block_rows < 0 || o->block_cols < 0)
      chk.fail("FP8 block sizes must be >= 0 (0: the whole dimension), got ", o->block_rows, " x ", o->block_cols);
    const auto n = static_cast<size_t>(groups);
    if (o->rule == Fp8ScaleRule::given) {
      if (o->scale.size() != n)
        chk.fail("a given FP8 scale needs one entry per group (", n, "), got ", o->scale.size());
      for (const float s : o->scale)
        if (!(s > 0.0f && s <= FLT_MAX)) chk.fail("a given FP8 scale must be finite and > 0, got ", s);
    }
    if (!o->amax.empty() && o->amax.size() != n)
      chk.fail("FP8 amax outputs need one entry per group (", n, "), got ", o->amax.size());
  }
}

}  // namespace

void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Fp8Gemm& fp8, const Context& ctx) {
  const cpu::Checker chk("gemm (fp8)", ctx, {{"c", &c}, {"a", &a}, {"b", &b}});
  chk.rank("a", 2);
  chk.rank("b", 2);
  chk.same_dtype("b", "a");
  check_fp8(chk, a, fp8, 1);
  if (a.stride(-1) != 1 || b.stride(-1) != 1) chk.fail("a and b need a unit last stride");
  const DType qt = copy_dtype(a.dtype(), false);
  Tensor qa = scratch(0, a.size(0), a.size(1), qt, ctx.device);
  Tensor qb = scratch(1, b.size(0), b.size(1), qt, ctx.device);
  const Quantized ra = quantize_operand(a, qa, trans_a, fp8.a, fp8, trans_a ? "operand a^T" : "operand a");
  const Quantized rb = quantize_operand(b, qb, !trans_b, fp8.b, fp8, trans_b ? "operand b^T" : "operand b");
  gemm(c, qa, trans_a, qb, trans_b, alpha * ra.scale_inv * rb.scale_inv, beta, ctx);
}

void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows, float beta,
                  const Fp8Gemm& fp8, const Context& ctx) {
  const cpu::Checker chk("gemm_grouped (fp8)", ctx, {{"c", &c}, {"a", &a}, {"b", &b}, {"group_rows", &group_rows}});
  chk.rank("c", 2);
  chk.rank("a", 2);
  chk.rank("b", 3);
  chk.same_dtype("b", "a");
  check_fp8(chk, a, fp8, b.size(0));
  if (a.stride(-1) != 1 || !b.is_contiguous()) chk.fail("a needs a unit last stride and b to be contiguous");
  const int64_t R = a.size(0), K = a.size(1), G = b.size(0);
  const std::vector<int64_t> rows = cpu::group_counts(chk, G, R);
  const DType qt = copy_dtype(a.dtype(), true);
  Tensor qa = scratch(0, R, K, qt, ctx.device);
  Tensor qb = scratch(1, G * b.size(1), b.size(2), qt, ctx.device);
  std::vector<float> alpha(G, 1.0f);
  bool scaled = false;
  for (int64_t g = 0, o = 0; g < G; o += rows[g], ++g) {
    Tensor bq = qb.slice(0, g * b.size(1), (g + 1) * b.size(1));
    const Quantized rb = quantize_operand(b.select(0, g), bq, !trans_b, fp8.b, fp8, "expert weight", g);
    if (rows[g] == 0) continue;
    Tensor aq = qa.slice(0, o, o + rows[g]);
    const Quantized ra = quantize_operand(a.slice(0, o, o + rows[g]), aq, false, fp8.a, fp8, "expert input", g);
    alpha[g] = ra.scale_inv * rb.scale_inv;
    scaled |= alpha[g] != 1.0f;
  }
  const Tensor qb3 = qb.view(b.shape());
  if (!scaled) return gemm_grouped(c, qa, qb3, trans_b, group_rows, beta, ctx);
  for (int64_t g = 0, o = 0; g < G; o += rows[g], ++g) {
    if (rows[g] == 0) continue;
    Tensor cg = c.slice(0, o, o + rows[g]);
    gemm(cg, qa.slice(0, o, o + rows[g]), false, qb3.select(0, g), trans_b, alpha[g], beta, ctx);
  }
}

void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows, float beta,
                        const Fp8Gemm& fp8, const Context& ctx) {
  const cpu::Checker chk("gemm_grouped_wgrad (fp8)", ctx,
                         {{"c", &c}, {"a", &a}, {"b", &b}, {"group_rows", &group_rows}});
  chk.rank("c", 3);
  chk.rank("a", 2);
  chk.rank("b", 2);
  chk.same_dtype("b", "a");
  check_fp8(chk, a, fp8, c.size(0));
  if (a.stride(-1) != 1 || b.stride(-1) != 1) chk.fail("a and b need a unit last stride");
  const int64_t R = a.size(0), G = c.size(0);
  if (b.size(0) != R) chk.fail("a and b must have the same rows");
  const std::vector<int64_t> rows = cpu::group_counts(chk, G, R);
  const DType qt = copy_dtype(a.dtype(), false);
  Tensor qa = scratch(0, R, a.size(1), qt, ctx.device);
  Tensor qb = scratch(1, R, b.size(1), qt, ctx.device);
  for (int64_t g = 0, o = 0; g < G; o += rows[g], ++g) {
    Tensor cg = c.select(0, g);
    Tensor aq = qa.slice(0, o, o + rows[g]), bq = qb.slice(0, o, o + rows[g]);
    // the reduction runs over the group's rows: both operands' blocks lie along them
    const Quantized ra = quantize_operand(a.slice(0, o, o + rows[g]), aq, true, fp8.a, fp8, "output gradient", g);
    const Quantized rb = quantize_operand(b.slice(0, o, o + rows[g]), bq, true, fp8.b, fp8, "expert input", g);
    gemm(cg, aq, true, bq, false, ra.scale_inv * rb.scale_inv, beta, ctx);
  }
}

}  // namespace moecore::ops
