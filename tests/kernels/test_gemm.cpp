// GEMM against a double-precision reference: every transpose combination, f32 and bf16 operands, f32 and
// bf16 outputs, alpha/beta, row-strided views, batches, the tiled bf16 path, and bad shapes.
#include <cmath>

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
// adds one bf16 rounding (rtol 8e-3).
TEST(Gemm, AllTransposesDtypesAlphaBeta) {
  const int64_t M = 37, N = 29, K = 45;
  for (DType in : {DType::f32, DType::bf16})
    for (DType out : {DType::f32, DType::bf16})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (float beta : {0.0f, 1.0f, 0.5f}) {
            const Tensor a = testing::randn(ta ? Shape{K, M} : Shape{M, K}, "a").to(in);
            const Tensor b = testing::randn(tb ? Shape{N, K} : Shape{K, N}, "b").to(in);
            const Tensor c0 = testing::randn({M, N}, "c").to(out);
            Tensor c = c0.clone();
            ops::gemm(c, a, ta, b, tb, 0.75f, beta, {});
            const double rtol = out == DType::bf16 ? 8e-3 : 1e-4;
            EXPECT_LE(testing::tolerance_ratio(c, reference(a, ta, b, tb, 0.75f, beta, c0), rtol, 1e-4 * std::sqrt(K)),
                      1.0)
                << dtype_name(in) << "->" << dtype_name(out) << " ta " << ta << " tb " << tb << " beta " << beta;
          }
}

TEST(Gemm, RowStridedViews) {
  for (DType in : {DType::f32, DType::bf16}) {
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
  for (DType in : {DType::f32, DType::bf16}) {
    const Tensor a = testing::randn({3, 8, 12}, "ba").to(in), b = testing::randn({3, 10, 12}, "bb").to(in);
    Tensor c = Tensor::zeros({3, 8, 10}, DType::f32);
    ops::gemm_batched(c, a, false, b, true, 1.0f, 0.0f, {});
    for (int g = 0; g < 3; ++g) {
      Tensor cg = Tensor::zeros({8, 10}, DType::f32);
      EXPECT_TENSOR_NEAR(c.select(0, g).clone(), reference(a.select(0, g), false, b.select(0, g), true, 1, 0, cg), 1e-4,
                         1e-4);
    }
  }
}

// K = 16384 makes the widened bf16 path split both M and N into tiles (4M-element budget per operand).
TEST(Gemm, Bf16TiledPathMatchesReference) {
  const int64_t M = 260, N = 300, K = 16384;
  const Tensor a = testing::randn({M, K}, "ta").to(DType::bf16), b = testing::randn({N, K}, "tb").to(DType::bf16);
  for (DType out : {DType::f32, DType::bf16}) {
    const Tensor c0 = testing::randn({M, N}, "tc").to(out);
    Tensor c = c0.clone();
    ops::gemm(c, a, false, b, true, 1.0f, 1.0f, {});
    EXPECT_LE(testing::tolerance_ratio(c, reference(a, false, b, true, 1, 1, c0), out == DType::bf16 ? 8e-3 : 1e-4,
                                       1e-4 * std::sqrt(K)),
              1.0)
        << dtype_name(out);
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
