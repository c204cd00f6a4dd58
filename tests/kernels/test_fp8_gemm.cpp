// FP8 GEMMs (kernels/ops_fp8.h) against a reference built from the quantisation ops: each operand written out in its
// GEMM's [rows, reduction] layout (explicit transposes), quantised there by ops::fp8_quantize with the recipe's blocks
// and dequantised by ops::fp8_dequantize, then multiplied in double. Every recipe's operands (per-tensor current
// scales, blockwise powers of two with 128 x 128 weights, MXFP8), both formats, all four transpose combinations, f32
// and bf16 operands, partial edge blocks, alpha and beta; the grouped GEMMs per group (zero-row groups, a scale per
// expert, wgrad's blocks along each group's rows); fp8::round_to equal to the cast's value for every kind of input;
// a non-finite operand stops with the GEMM's name; bad operands named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "moecore/kernels/common/fp8.h"
#include "moecore/kernels/ops_fp8.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::expect_error;
using testing::mix;
const ops::Context cpu{Device::cpu};

// round_to is the value of the saturating cast, bit for bit: specials, every FP8 value and the midpoints between
// neighbours (the ties), and a million inputs of random bits.
TEST(Fp8Gemm, RoundToIsTheValueOfTheCast) {
  for (bool e5m2 : {false, true}) {
    std::vector<float> xs = {0.0f,
                             -0.0f,
                             448.0f,
                             464.0f,
                             470.0f,
                             57344.0f,
                             61440.0f,
                             1e30f,
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(),
                             1e-30f,
                             -1e-45f};
    for (int b = 0; b < 256; ++b) {
      const float v = ops::fp8::value_of(static_cast<uint8_t>(b), e5m2);
      const float w = ops::fp8::value_of(static_cast<uint8_t>(b + 1 < 256 ? b + 1 : b), e5m2);
      xs.push_back(v);
      xs.push_back(0.5f * (v + w));
      xs.push_back(std::nextafter(0.5f * (v + w), 0.0f));
    }
    for (uint64_t i = 0; i < 1000000; ++i) {
      const uint32_t bits = static_cast<uint32_t>(mix(i));
      float f;
      std::memcpy(&f, &bits, 4);
      xs.push_back(f);
      xs.push_back(std::ldexp(static_cast<float>(bits % 100000) / 1000.0f, static_cast<int>(bits % 40) - 30));
    }
    for (float x : xs) {
      const float want = ops::fp8::value_of(ops::fp8::cast(x, e5m2), e5m2), got = ops::fp8::round_to(x, e5m2);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << x;
      } else {
        uint32_t a, b;
        std::memcpy(&a, &want, 4);
        std::memcpy(&b, &got, 4);
        ASSERT_EQ(a, b) << "x " << x << " e5m2 " << e5m2 << ": cast " << want << ", round_to " << got;
      }
    }
  }
}

// x [rows, cols] (any strides) as a contiguous f32 copy, transposed when `t`.
Tensor dense_f32(const Tensor& x, bool t) {
  const Tensor xf = x.to(DType::f32);
  if (!t) return xf.clone();
  Tensor out = Tensor::empty({x.size(1), x.size(0)}, DType::f32);
  for (int64_t i = 0; i < x.size(0); ++i)
    for (int64_t j = 0; j < x.size(1); ++j) out.data<float>()[j * x.size(0) + i] = xf.data<float>()[i * x.size(1) + j];
  return out;
}

// The operand as the GEMM sees it ([rows, reduction], f32), quantised and dequantised by the quantisation ops.
Tensor reference_operand(const Tensor& op_layout, const ops::Fp8Operand& o) {
  ops::Fp8Quantize p;
  p.block_rows = o.block_rows;
  p.block_cols = o.block_cols;
  p.rule = o.rule;
  if (!o.scale.empty()) p.scale = o.scale[0];
  p.inf_scale = o.inf_scale;
  const int64_t R = op_layout.size(0), C = op_layout.size(1);
  const int64_t br = p.block_rows > 0 ? p.block_rows : R, bc = p.block_cols > 0 ? p.block_cols : C;
  Tensor q = Tensor::empty({R, C}, o.format);
  Tensor s = Tensor::empty({(R + br - 1) / br, (C + bc - 1) / bc}, DType::f32);
  ops::fp8_quantize(op_layout, q, s, nullptr, p, cpu);
  Tensor out = Tensor::empty({R, C}, DType::f32);
  ops::fp8_dequantize(q, s, out, p.block_rows, p.block_cols, cpu);
  return out;
}

// c [M, N] f32 = alpha * A [M, K] B [N, K]^T + beta * c0, in double.
Tensor reference_product(const Tensor& A, const Tensor& B, float alpha, float beta, const Tensor& c0) {
  const int64_t M = A.size(0), K = A.size(1), N = B.size(0);
  Tensor c = Tensor::empty({M, N}, DType::f32);
  const Tensor c0f = c0.to(DType::f32);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(A.data<float>()[i * K + k]) * double(B.data<float>()[j * K + k]);
      c.data<float>()[i * N + j] = static_cast<float>(alpha * acc + beta * double(c0f.data<float>()[i * N + j]));
    }
  return c;
}

// The size of each entry's terms, sum_k |A_ik B_jk| (A [M, K], B [N, K]): entries of very different sizes are each
// checked against their own (a block of the wrong orientation flushes small entries to zero, which a tolerance on
// the largest would not see).
Tensor term_sizes(const Tensor& A, const Tensor& B) {
  const Tensor a = A.to(DType::f32), b = B.to(DType::f32);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  Tensor t = Tensor::empty({M, N}, DType::f32);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += std::fabs(double(a.data<float>()[i * K + k]) * b.data<float>()[j * K + k]);
      t.data<float>()[i * N + j] = static_cast<float>(acc);
    }
  return t;
}
// The worst |got - want| / (rtol * size) over the entries.
double relative_to_sizes(const Tensor& got, const Tensor& want, const Tensor& size, double rtol) {
  double worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double r =
        std::fabs(double(got.data<float>()[i]) - want.data<float>()[i]) / (rtol * size.data<float>()[i] + 1e-35);
    worst = std::isnan(r) ? INFINITY : std::max(worst, r);
  }
  return worst;
}
// [rows, cols] N(0, std^2) with row r scaled by 2^(-3 (r % 8)): magnitudes 2^21 apart along the rows, uniform along
// the columns (the reduction), so that the blocks' orientation decides which values FP8 keeps.
Tensor graded(int64_t rows, int64_t cols, const char* name, float std) {
  Tensor t = testing::randn({rows, cols}, name, std);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t.data<float>()[r * cols + c] *= std::ldexp(1.0f, -3 * static_cast<int>(r % 8));
  return t;
}
// x [rows, cols] stored transposed when `t` (and, for `wide`, as a view of a wider tensor), in dtype dt.
Tensor stored(const Tensor& x, bool t, DType dt, bool wide) {
  const Tensor s = dense_f32(x, t);
  if (!wide) return s.to(dt);
  Tensor w = Tensor::zeros({s.size(0), s.size(1) + 5}, DType::f32);
  w.slice(1, 0, s.size(1)).copy_from(s);
  return w.to(dt).slice(1, 0, s.size(1));
}

struct Recipe {
  const char* name;
  ops::Fp8Operand act, weight;
};
std::vector<Recipe> recipes(DType input) {
  ops::Fp8Operand tw;  // tensorwise: current scale, whole tensor
  ops::Fp8Operand bw_act{DType::f8e4m3,
                         ops::Fp8ScaleRule::current_pow2,
                         1,
                         128,
                         {},
                         input == DType::bf16 ? 0x1.fep127f : 3.4028234664e38f};
  ops::Fp8Operand bw_w = bw_act;
  bw_w.block_rows = 128;
  ops::Fp8Operand mx{DType::f8e4m3, ops::Fp8ScaleRule::mx, 1, 32};
  static const float kGiven[] = {3.0f};
  ops::Fp8Operand given{DType::f8e4m3, ops::Fp8ScaleRule::given, 0, 0, kGiven};
  return {{"tensorwise", tw, tw}, {"blockwise", bw_act, bw_w}, {"mxfp8", mx, mx}, {"given", given, given}};
}

TEST(Fp8Gemm, EveryRecipeMatchesTheQuantisationReference) {
  const int64_t M = 37, K = 300, N = 45;
  for (DType dt : {DType::f32, DType::bf16})
    for (const Recipe& r : recipes(dt))
      for (bool e5m2_a : {false, true})
        for (int t = 0; t < 4; ++t) {
          const bool ta = t & 1, tb = t & 2;
          SCOPED_TRACE(std::string(r.name) + " " + std::string(dtype_name(dt)) + (e5m2_a ? " hybrid" : " e4m3") +
                       (ta ? " a^T" : " a") + (tb ? " b^T" : " b"));
          // op(a) [M, K] and op(b)^T [N, K] graded along their rows; a stored with a wide row stride (a view)
          const Tensor A0 = graded(M, K, "fp8 gemm a", 3.0f), B0 = graded(N, K, "fp8 gemm b", 0.05f);
          const Tensor a = stored(A0, ta, dt, true), b = stored(B0, !tb, dt, false);
          ops::Fp8Gemm g{r.act, r.weight, "test gemm"};
          if (e5m2_a) g.a.format = DType::f8e5m2;
          const Tensor sizes = term_sizes(A0, B0);
          Tensor c0 = testing::randn({M, N}, "fp8 gemm c");
          for (int64_t i = 0; i < M * N; ++i) c0.data<float>()[i] *= sizes.data<float>()[i];
          Tensor c = c0.clone();
          ops::gemm(c, a, ta, b, tb, 0.75f, 0.5f, g, cpu);
          const Tensor A = reference_operand(dense_f32(a, ta), g.a), B = reference_operand(dense_f32(b, !tb), g.b);
          EXPECT_LE(relative_to_sizes(c, reference_product(A, B, 0.75f, 0.5f, c0), sizes, 1e-5), 1.0);
          // and the quantisation changed the product (the test would see a plain GEMM)
          Tensor plain = c0.clone();
          ops::gemm(plain, a, ta, b, tb, 0.75f, 0.5f, cpu);
          EXPECT_GT(relative_to_sizes(c, plain, sizes, 1e-5), 1.0);
        }
}

// The quantised copies a GEMM multiplies are, value for value, the quantisation ops' (fp8_quantize + dequantize, bit
// for bit the PyTorch golden): with op(b) the identity, which every recipe below quantises exactly, c = q(a). Rows of
// 300 values (the copies' 8-lane loops with tails, 1x128 and 1x32 blocks cut short) spanning FP8's subnormals, exact
// ties, signed zeros and, under a given scale of 8, values past the largest FP8 number.
TEST(Fp8Gemm, QuantisedCopiesAreTheQuantisationOpsValues) {
  const int64_t M = 37, K = 300;
  Tensor a32 = graded(M, K, "fp8 copies a", 4.0f);
  float* pa = a32.data<float>();
  for (int64_t i = 0; i < M * K; i += 7) pa[i] = (i % 2 ? -1.0f : 1.0f) * std::ldexp(1.5f, -10 - int(i % 9));
  for (int64_t i = 3; i < M * K; i += 11) pa[i] = (i % 2 ? -0.0f : 0.0f);
  for (int64_t i = 5; i < M * K; i += 13) pa[i] = std::ldexp(1.0f + 0.0625f * float(i % 16), int(i % 7) - 3);
  Tensor eye = Tensor::zeros({K, K}, DType::f32);
  for (int64_t k = 0; k < K; ++k) eye.data<float>()[k * K + k] = 1.0f;
  static const float kEight[] = {8.0f}, kOne[] = {1.0f};
  for (DType dt : {DType::f32, DType::bf16})
    for (const Recipe& r : recipes(dt)) {
      ops::Fp8Gemm g{r.act, r.weight, "copies"};
      if (std::string(r.name) == "tensorwise") continue;  // a scale that is no power of two: c is not q(a) exactly
      if (r.act.rule == ops::Fp8ScaleRule::given) {
        g.a.scale = kEight;
        g.b.scale = kOne;
      }
      for (bool e5m2 : {false, true}) {
        SCOPED_TRACE(std::string(r.name) + " " + std::string(dtype_name(dt)) + (e5m2 ? " e5m2" : " e4m3"));
        g.a.format = e5m2 ? DType::f8e5m2 : DType::f8e4m3;
        const Tensor a = a32.to(dt), b = eye.to(dt);
        Tensor c = Tensor::zeros({M, K}, DType::f32);
        ops::gemm(c, a, false, b, true, 1.0f, 0.0f, g, cpu);
        EXPECT_EQ(testing::to_vector(c), testing::to_vector(reference_operand(dense_f32(a, false), g.a)));
      }
    }
}

// Group e's operand of a grouped GEMM: its own given scale.
ops::Fp8Operand of_group(ops::Fp8Operand o, int64_t e) {
  if (o.scale.size() > 1) o.scale = o.scale.subspan(static_cast<size_t>(e), 1);
  return o;
}

// max |x| over a tensor's values (as f32)
float max_abs(const Tensor& x) {
  const Tensor f = dense_f32(x, false);
  float m = 0.0f;
  for (int64_t i = 0; i < f.numel(); ++i) m = std::max(m, std::fabs(f.data<float>()[i]));
  return m;
}

TEST(Fp8Gemm, GroupedGemmsQuantiseEachGroupOnItsOwn) {
  const int64_t K = 160, N = 24, G = 4;
  const std::vector<int64_t> rows = {50, 0, 3, 140};  // sums to 193 of R = 200 rows (the rest untouched)
  const int64_t R = 200;
  const Tensor counts = testing::counts_tensor(rows, Device::cpu);
  static const float kGroupScales[] = {3.0f, 0.5f, 7.0f, 0.25f};  // the given recipe: a scale per group
  for (DType dt : {DType::f32, DType::bf16})
    for (const Recipe& r : recipes(dt)) {
      SCOPED_TRACE(std::string(r.name) + " " + std::string(dtype_name(dt)));
      ops::Fp8Gemm g{r.act, r.weight, "experts"};
      if (r.act.rule == ops::Fp8ScaleRule::given) g.a.scale = g.b.scale = kGroupScales;
      // each group's amax is maxed into its entry (a larger value already there is kept)
      std::vector<float> amax_a(G, 0.0f), amax_b(G, 0.0f);
      amax_b[1] = 1e6f;
      g.a.amax = amax_a;
      g.b.amax = amax_b;
      Tensor x32 = graded(R, K, "grouped x", 2.0f);
      for (int64_t i = 53 * K; i < 193 * K; ++i) x32.data<float>()[i] *= 10.0f;  // group 3: a scale of its own
      const Tensor x = x32.to(dt);
      for (bool trans_b : {true, false}) {
        // w[g] as op(b)^T [N, K], graded along N; stored [N, K] (trans_b) or [K, N]
        Tensor w = Tensor::empty(trans_b ? Shape{G, N, K} : Shape{G, K, N}, dt);
        std::vector<Tensor> w_op;
        for (int64_t e = 0; e < G; ++e) {
          w_op.push_back(graded(N, K, "grouped w", 0.1f + 0.1f * static_cast<float>(e)));
          w.select(0, e).copy_from(stored(w_op.back(), !trans_b, dt, false));
        }
        Tensor y = Tensor::zeros({R, N}, DType::f32);
        ops::gemm_grouped(y, x, w, trans_b, counts, 0.0f, g, cpu);
        int64_t o = 0;
        for (int64_t e = 0; e < G; o += rows[e], ++e) {
          if (rows[e] == 0) continue;
          const Tensor xe = dense_f32(x.slice(0, o, o + rows[e]), false);
          const Tensor A = reference_operand(xe, of_group(g.a, e)),
                       B = reference_operand(dense_f32(w.select(0, e), !trans_b), of_group(g.b, e));
          const Tensor zero = Tensor::zeros({rows[e], N}, DType::f32);
          EXPECT_LE(relative_to_sizes(y.slice(0, o, o + rows[e]).clone(), reference_product(A, B, 1.0f, 0.0f, zero),
                                      term_sizes(xe, w_op[e]), 1e-5),
                    1.0)
              << "fprop, expert " << e << (trans_b ? ", b^T" : ", b");
          EXPECT_EQ(amax_a[e], max_abs(x.slice(0, o, o + rows[e]))) << "expert " << e;
        }
        for (int64_t e = 0; e < G; ++e) EXPECT_EQ(amax_b[e], e == 1 ? 1e6f : max_abs(w.select(0, e))) << "expert " << e;
        EXPECT_EQ(amax_a[1], 0.0f);  // no rows: nothing quantised
      }
      // wgrad: dw[g] = dy[seg]^T x[seg] + dw[g], both operands blocked along the group's rows: dy graded along its
      // columns (the rows of dw), x along its columns (the columns of dw)
      const Tensor dy = dense_f32(graded(N, R, "grouped dy", 0.01f), true).to(dt);
      const Tensor xw = dense_f32(graded(K, R, "grouped xw", 1.0f), true).to(dt);
      ops::Fp8Gemm gw{r.act, r.act, "experts wgrad"};
      gw.a.format = DType::f8e5m2;
      if (r.act.rule == ops::Fp8ScaleRule::given) gw.a.scale = gw.b.scale = kGroupScales;
      Tensor dw0 = testing::randn({G, N, K}, "grouped dw0");
      std::vector<Tensor> sizes;
      int64_t o = 0;
      for (int64_t e = 0; e < G; o += rows[e], ++e) {
        sizes.push_back(rows[e] ? term_sizes(dense_f32(dy.slice(0, o, o + rows[e]), true),
                                             dense_f32(xw.slice(0, o, o + rows[e]), true))
                                : Tensor::zeros({N, K}, DType::f32));
        for (int64_t i = 0; i < N * K; ++i) dw0.select(0, e).data<float>()[i] *= sizes.back().data<float>()[i];
      }
      Tensor dw = dw0.clone();
      ops::gemm_grouped_wgrad(dw, dy, xw, counts, 1.0f, gw, cpu);
      o = 0;
      for (int64_t e = 0; e < G; o += rows[e], ++e) {
        const Tensor A = rows[e] ? reference_operand(dense_f32(dy.slice(0, o, o + rows[e]), true), of_group(gw.a, e))
                                 : Tensor::zeros({N, 0}, DType::f32);
        const Tensor B = rows[e] ? reference_operand(dense_f32(xw.slice(0, o, o + rows[e]), true), of_group(gw.b, e))
                                 : Tensor::zeros({K, 0}, DType::f32);
        Tensor size = sizes[e].clone();  // (plus the accumulated dw0's own size)
        for (int64_t i = 0; i < N * K; ++i) size.data<float>()[i] += std::fabs(dw0.select(0, e).data<float>()[i]);
        EXPECT_LE(relative_to_sizes(dw.select(0, e).clone(),
                                    reference_product(A, B, 1.0f, 1.0f, dw0.select(0, e).clone()), size, 1e-5),
                  1.0)
            << "wgrad, expert " << e;
      }
    }
}

TEST(Fp8Gemm, ANonFiniteOperandStopsNamingTheGemm) {
  Tensor a = testing::randn({8, 16}, "nan a"), b = testing::randn({4, 16}, "nan b"),
         c = Tensor::zeros({8, 4}, DType::f32);
  ops::Fp8Gemm g{{}, {}, "decoder.layers.3.mlp.linear_fc1 fprop"};
  a.data<float>()[17] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { ops::gemm(c, a, false, b, true, 1.0f, 0.0f, g, cpu); },
               {"FP8 training stops", "decoder.layers.3.mlp.linear_fc1 fprop", "operand a", "NaN"});
  a.data<float>()[17] = 1.0f;
  b.data<float>()[5] = -std::numeric_limits<float>::infinity();
  expect_error([&] { ops::gemm(c, a, false, b, true, 1.0f, 0.0f, g, cpu); }, {"FP8 training stops", "operand b^T"});
  // bad operands are named
  ops::Fp8Gemm bad = g;
  bad.b.format = DType::bf16;
  b.data<float>()[5] = 1.0f;
  expect_error([&] { ops::gemm(c, a, false, b, true, 1.0f, 0.0f, bad, cpu); }, {"gemm (fp8)", "format"});
  ops::Fp8Gemm two = g;
  static const float kTwo[] = {1.0f, 2.0f};
  two.a.rule = ops::Fp8ScaleRule::given;
  two.a.scale = kTwo;
  expect_error([&] { ops::gemm(c, a, false, b, true, 1.0f, 0.0f, two, cpu); },
               {"gemm (fp8)", "one entry per group (1), got 2"});
  Tensor a16 = a.to(DType::f16), b16 = b.to(DType::f16);
  expect_error([&] { ops::gemm(c, a16, false, b16, true, 1.0f, 0.0f, g, cpu); }, {"gemm (fp8)", "f32 or bf16"});
}

}  // namespace
}  // namespace moecore
