// GEMM against a double-precision reference: every transpose combination, f32, bf16 and f16 operands and
// outputs, alpha/beta, row-strided views, batches, the tiled widened path, f16 overflow to inf, and bad shapes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "moecore/kernels/cpu_isa.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

// c_ref = alpha * op(a) @ op(b) + beta * c0, in double from the (possibly rounded) operand values.
Tensor reference(const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta, const Tensor& c0) {
  const Tensor a32 = a.to(DType::f32), b32 = b.to(DType::f32), c32 = c0.to(DType::f32);
  const int64_t M = c0.size(0), N = c0.size(1), K = ta ? a.size(0) : a.size(1);
  Tensor out = Tensor::empty({M, N}, DType::f32);
  const float *pa = a32.data<float>(), *pb = b32.data<float>(), *pc = c32.data<float>();
  float* po = out.data<float>();
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += double(ta ? pa[k * M + i] : pa[i * K + k]) * double(tb ? pb[j * K + k] : pb[k * N + j]);
      po[i * N + j] = static_cast<float>(alpha * s + beta * pc[i * N + j]);
    }
  return out;
}

// Tolerances: f32 accumulation over K terms of O(1) values: rtol 1e-4, atol 1e-4 * sqrt(K); a bf16 output
// adds one bf16 rounding (rtol 8e-3), an f16 output one f16 rounding (2^-11 relative: rtol 1e-3).
double output_rtol(DType out) {
  return out == DType::bf16 ? 8e-3 : out == DType::f16 ? 1e-3 : 1e-4;
}

// Runs `body` once per bf16 GEMM path this CPU has (widened always; native where oneDNN has a bf16 matmul, else
// said), the path in use restored after.
template <class F>
void for_each_bf16_gemm(F&& body) {
  const ops::Bf16Gemm was = ops::cpu_bf16_gemm();
  for (ops::Bf16Gemm path : {ops::Bf16Gemm::native, ops::Bf16Gemm::widened}) {
    try {
      ops::set_cpu_bf16_gemm(path);
    } catch (const Error& e) {
      std::printf("[ skipped  ] bf16 GEMM path %s: %s\n", std::string(ops::bf16_gemm_name(path)).c_str(), e.what());
      continue;
    }
    SCOPED_TRACE(std::string("bf16 GEMM path ") + std::string(ops::bf16_gemm_name(path)));
    body();
  }
  ops::set_cpu_bf16_gemm(was);
}

TEST(Gemm, AllTransposesDtypesAlphaBeta) {
  for_each_bf16_gemm([] {
    const int64_t M = 37, N = 29, K = 45;
    for (DType in : {DType::f32, DType::bf16, DType::f16})
      for (DType out : {DType::f32, DType::bf16, DType::f16})
        for (int ta = 0; ta < 2; ++ta)
          for (int tb = 0; tb < 2; ++tb)
            for (float beta : {0.0f, 1.0f, 0.5f}) {
              const Tensor a = testing::randn(ta ? Shape{K, M} : Shape{M, K}, "a").to(in);
              const Tensor b = testing::randn(tb ? Shape{N, K} : Shape{K, N}, "b").to(in);
              const Tensor c0 = testing::randn({M, N}, "c").to(out);
              Tensor c = c0.clone();
              ops::gemm(c, a, ta, b, tb, 0.75f, beta, {});
              const double rtol = output_rtol(out);
              EXPECT_LE(
                  testing::tolerance_ratio(c, reference(a, ta, b, tb, 0.75f, beta, c0), rtol, 1e-4 * std::sqrt(K)), 1.0)
                  << dtype_name(in) << "->" << dtype_name(out) << " ta " << ta << " tb " << tb << " beta " << beta;
            }
  });
}

// Widened, a bf16 GEMM is the f32 GEMM of the bf16 values, bit for bit (each product of two bf16 values is exact in
// f32), for both operand layouts, a beta and a batch.
TEST(Gemm, WidenedBf16IsTheF32GemmOfTheBf16Values) {
  const ops::Bf16Gemm was = ops::cpu_bf16_gemm();
  ops::set_cpu_bf16_gemm(ops::Bf16Gemm::widened);
  const int64_t M = 48, N = 40, K = 96;
  for (int tb = 0; tb < 2; ++tb) {
    const Tensor a = testing::randn({M, K}, "wa").to(DType::bf16);
    const Tensor b = testing::randn(tb ? Shape{N, K} : Shape{K, N}, "wb").to(DType::bf16);
    const Tensor c0 = testing::randn({M, N}, "wc");
    Tensor c = c0.clone(), c32 = c0.clone();
    ops::gemm(c, a, false, b, tb, 0.5f, 1.0f, {});
    ops::gemm(c32, a.to(DType::f32), false, b.to(DType::f32), tb, 0.5f, 1.0f, {});
    EXPECT_EQ(testing::to_vector(c), testing::to_vector(c32)) << "tb " << tb;
  }
  const Tensor a = testing::randn({3, M, K}, "wba").to(DType::bf16),
               b = testing::randn({3, N, K}, "wbb").to(DType::bf16);
  Tensor c = Tensor::zeros({3, M, N}, DType::f32), c32 = Tensor::zeros({3, M, N}, DType::f32);
  ops::gemm_batched(c, a, false, b, true, 1.0f, 0.0f, {});
  ops::gemm_batched(c32, a.to(DType::f32), false, b.to(DType::f32), true, 1.0f, 0.0f, {});
  EXPECT_EQ(testing::to_vector(c), testing::to_vector(c32));
  ops::set_cpu_bf16_gemm(was);
}

TEST(Gemm, RowStridedViews) {
  for (DType in : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor wide_a = testing::randn({16, 40}, "wa").to(in), wide_b = testing::randn({24, 40}, "wb").to(in);
    const Tensor a = wide_a.slice(1, 5, 25), b = wide_b.slice(1, 10, 30);  // [16, 20], [24, 20], row stride 40
    Tensor wide_c = Tensor::zeros({16, 50}, DType::f32);
    Tensor c = wide_c.slice(1, 3, 27);
    ops::gemm(c, a, false, b, true, 1.0f, 0.0f, {});
    EXPECT_LE(
        testing::tolerance_ratio(c.clone(), reference(a.clone(), false, b.clone(), true, 1, 0, c.clone()), 1e-4, 1e-4),
        1.0);
    EXPECT_EQ(wide_c.data<float>()[0], 0.0f);  // columns outside the view are untouched
  }
}

TEST(Gemm, BatchedMatchesPerBatch) {
  for_each_bf16_gemm([] {
    for (DType in : {DType::f32, DType::bf16, DType::f16}) {
      const Tensor a = testing::randn({3, 8, 12}, "ba").to(in), b = testing::randn({3, 10, 12}, "bb").to(in);
      Tensor c = Tensor::zeros({3, 8, 10}, DType::f32);
      ops::gemm_batched(c, a, false, b, true, 1.0f, 0.0f, {});
      for (int g = 0; g < 3; ++g) {
        Tensor cg = Tensor::zeros({8, 10}, DType::f32);
        EXPECT_TENSOR_NEAR(c.select(0, g).clone(), reference(a.select(0, g), false, b.select(0, g), true, 1, 0, cg),
                           1e-4, 1e-4);
      }
    }
  });
}

// The bf16 path follows the CPU: the dot-product probe runs where the CPU has AVX512-BF16 (and says 0 elsewhere), and
// native is taken only where oneDNN has a bf16 matmul.
TEST(Gemm, Bf16PathFollowsTheCpu) {
  const double ratio = ops::cpu_bf16_dot_flop_ratio();
  const ops::Bf16Gemm path = ops::cpu_bf16_gemm();
  std::printf("bf16 dot-product flops / f32 FMA flops: %.3f; bf16 GEMMs: %s\n", ratio,
              std::string(ops::bf16_gemm_name(path)).c_str());
  const bool has_bf16 = ops::cpu_has_isa(ops::CpuIsa::avx512) && __builtin_cpu_supports("avx512bf16");
  EXPECT_EQ(ratio > 0, has_bf16);
  EXPECT_TRUE(std::isfinite(ratio));
  const std::string native = testing::error_of([] { ops::set_cpu_bf16_gemm(ops::Bf16Gemm::native); });
  if (native != "(no error)") {
    EXPECT_EQ(path, ops::Bf16Gemm::widened);
    EXPECT_NE(native.find("lacks"), std::string::npos) << native;
  }
  ops::set_cpu_bf16_gemm(path);
}

// K = 16384 makes the widened path (bf16 set to it; f16 always) split both M and N into tiles (4M-element budget per
// operand).
TEST(Gemm, WidenedTiledPathMatchesReference) {
  const ops::Bf16Gemm was = ops::cpu_bf16_gemm();
  ops::set_cpu_bf16_gemm(ops::Bf16Gemm::widened);
  const int64_t M = 260, N = 300, K = 16384;
  for (DType in : {DType::bf16, DType::f16}) {
    const Tensor a = testing::randn({M, K}, "ta").to(in), b = testing::randn({N, K}, "tb").to(in);
    for (DType out : {DType::f32, in}) {
      const Tensor c0 = testing::randn({M, N}, "tc").to(out);
      Tensor c = c0.clone();
      ops::gemm(c, a, false, b, true, 1.0f, 1.0f, {});
      EXPECT_LE(
          testing::tolerance_ratio(c, reference(a, false, b, true, 1, 1, c0), output_rtol(out), 1e-4 * std::sqrt(K)),
          1.0)
          << dtype_name(in) << "->" << dtype_name(out);
    }
  }
  ops::set_cpu_bf16_gemm(was);
}

// An f16 output beyond 65504 is ±inf (IEEE overflow, no saturation: loss scaling watches for it), whatever the
// operand dtype, and flag_nonfinite sees it; 65504 itself and everything below the midpoint 65520 stay finite.
TEST(Gemm, F16OutputOverflowsToInf) {
  for (DType in : {DType::f32, DType::f16}) {
    // Rows: 2 * 40000 = 80000 -> inf; -80000 -> -inf; 65504 stays; 0.5 * 65504. Every operand is exact in f16.
    Tensor a32 = Tensor::zeros({4, 2}, DType::f32), b32 = Tensor::zeros({2, 1}, DType::f32);
    const float av[] = {2, 0, -2, 0, 0, 1, 0, 0.5f}, bv[] = {40000, 65504};
    std::copy(av, av + 8, a32.data<float>());
    std::copy(bv, bv + 2, b32.data<float>());
    const Tensor a = a32.to(in), b = b32.to(in);
    Tensor c = Tensor::zeros({4, 1}, DType::f16);
    ops::gemm(c, a, false, b, false, 1.0f, 0.0f, {});
    const Tensor c32 = c.to(DType::f32);
    EXPECT_EQ(c32.data<float>()[0], std::numeric_limits<float>::infinity()) << dtype_name(in);
    EXPECT_EQ(c32.data<float>()[1], -std::numeric_limits<float>::infinity()) << dtype_name(in);
    EXPECT_EQ(c32.data<float>()[2], 65504.0f) << dtype_name(in);
    EXPECT_EQ(c32.data<float>()[3], 32752.0f) << dtype_name(in);
    Tensor flag = Tensor::zeros({1}, DType::i32);
    ops::flag_nonfinite(flag, c.slice(0, 2, 4).clone(), {});
    EXPECT_EQ(flag.data<int32_t>()[0], 0);
    ops::flag_nonfinite(flag, c, {});
    EXPECT_EQ(flag.data<int32_t>()[0], 1);
  }
}

TEST(Gemm, BadShapesAndDtypesNameTheOperands) {
  Tensor c = Tensor::zeros({4, 5}, DType::f32);
  const Tensor a = Tensor::zeros({4, 6}, DType::f32), b = Tensor::zeros({7, 5}, DType::f32);
  try {
    ops::gemm(c, a, false, b, false, 1, 0, {});
    FAIL() << "expected Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("gemm"), std::string::npos) << m;
    EXPECT_NE(m.find("[4, 6] f32"), std::string::npos) << m;
    EXPECT_NE(m.find("[7, 5] f32"), std::string::npos) << m;
  }
  const Tensor a16 = Tensor::zeros({4, 7}, DType::bf16);
  EXPECT_THROW(ops::gemm(c, a16, false, b, false, 1, 0, {}), Error);  // mixed input dtypes
}

}  // namespace
}  // namespace moecore
