// FP8 quantisation (ops::fp8_quantize / fp8_dequantize, kernels/common/fp8.h) against docs/fp8-spec.md's vectors:
// Transformer Engine's saturating casts of both formats (ties, subnormals, overflow, infinities, NaN), the recipes'
// scales (per-tensor current, blockwise powers of two, MXFP8's E8M0 with its round-up, delayed scaling's history and
// update) on the spec's four-element tensor; blocks independent with partial edges, all-zero and all-equal blocks,
// NaN skipped by the amax, bf16 inputs, the amax accumulator; bad arguments named; and every recipe bit for bit against
// tools/fp8_reference.py's golden (the recipes' definitions with PyTorch's float8 dtypes rounding).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/io/safetensors.h"
#include "moecore/kernels/common/fp8.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::error_of;
const ops::Context cpu{Device::cpu};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();

Tensor tensor_of(const std::vector<float>& v, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty({rows, cols}, DType::f32);
  for (int64_t i = 0; i < rows * cols; ++i) t.data<float>()[i] = i < static_cast<int64_t>(v.size()) ? v[i] : 0.0f;
  return t;
}

struct Quantized {
  Tensor q, scale_inv;
};
Quantized quantize(const Tensor& x, DType format, const ops::Fp8Quantize& p, Tensor* amax = nullptr) {
  const int64_t br = p.block_rows > 0 ? p.block_rows : x.size(0), bc = p.block_cols > 0 ? p.block_cols : x.size(1);
  Quantized r{Tensor::empty(x.shape(), format),
              Tensor::empty({(x.size(0) + br - 1) / br, (x.size(1) + bc - 1) / bc}, DType::f32)};
  ops::fp8_quantize(x, r.q, r.scale_inv, amax, p, cpu);
  return r;
}
uint8_t byte(const Tensor& q, int64_t i) {
  return static_cast<const uint8_t*>(q.raw())[i];
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// docs/fp8-spec.md §4.4, the "sat" column: TE's cvt.rn.satfinite.
TEST(Fp8, CastIsTransformerEnginesSaturatingRoundToNearestEven) {
  struct V {
    float x;
    uint8_t e4m3, e5m2;
  };
  for (const V& v : {V{0.0f, 0x00, 0x00}, V{-0.0f, 0x80, 0x80}, V{1.0f, 0x38, 0x3C}, V{-2.5f, 0xC2, 0xC1},
                     V{0.1f, 0x1D, 0x2E}, V{448.0f, 0x7E, 0x5F}, V{464.0f, 0x7E, 0x5F}, V{470.0f, 0x7E, 0x5F},
                     V{57344.0f, 0x7E, 0x7B}, V{60000.0f, 0x7E, 0x7B}, V{61440.0f, 0x7E, 0x7B}, V{1e5f, 0x7E, 0x7B},
                     V{kInf, 0x7E, 0x7B}, V{-kInf, 0xFE, 0xFB}, V{kNaN, 0x7F, 0x7F}, V{-kNaN, 0x7F, 0x7F}}) {
    EXPECT_EQ(ops::fp8::cast(v.x, false), v.e4m3) << v.x;
    EXPECT_EQ(ops::fp8::cast(v.x, true), v.e5m2) << v.x;
  }
  // E4M3: ties to even, normal and subnormal
  for (const auto& [x, q] : std::vector<std::pair<float, uint8_t>>{{1.0625f, 0x38},
                                                                   {1.1875f, 0x3A},
                                                                   {0.015625f, 0x08},
                                                                   {0.001953125f, 0x01},
                                                                   {std::ldexp(1.0f, -10), 0x00},
                                                                   {0.0029296875f, 0x02},
                                                                   {0.0087890625f, 0x04}})
    EXPECT_EQ(ops::fp8::cast(x, false), q) << x;
  // E5M2
  for (const auto& [x, q] : std::vector<std::pair<float, uint8_t>>{{1.125f, 0x3C},
                                                                   {1.375f, 0x3E},
                                                                   {std::ldexp(1.0f, -14), 0x04},
                                                                   {std::ldexp(1.0f, -16), 0x01},
                                                                   {std::ldexp(1.0f, -17), 0x00},
                                                                   {std::ldexp(1.5f, -16), 0x02}})
    EXPECT_EQ(ops::fp8::cast(x, true), q) << x;
  EXPECT_EQ(ops::fp8::max_of(false), 448.0f);
  EXPECT_EQ(ops::fp8::max_of(true), 57344.0f);
}

// TE's compute_scale_from_amax: 0, inf and NaN give 1; an infinite quotient the given replacement; pow2 rounds down.
TEST(Fp8, ScaleFromAmaxAsTransformerEngine) {
  using ops::fp8::scale_from_amax;
  for (float amax : {0.0f, kInf, kNaN}) EXPECT_EQ(scale_from_amax(amax, 448.0f, false, 0.0f, FLT_MAX), 1.0f);
  EXPECT_EQ(scale_from_amax(3.0f, 448.0f, false, 0.0f, FLT_MAX), 448.0f / 3.0f);
  EXPECT_EQ(scale_from_amax(3.0f, 448.0f, true, 0.0f, FLT_MAX), 128.0f);
  EXPECT_EQ(scale_from_amax(1e-45f, 448.0f, false, 0.0f, FLT_MAX), FLT_MAX);  // (448 / 2^-149 overflows)
  const float bf16_max = bits_float(0x7F7F0000u);
  EXPECT_EQ(scale_from_amax(1e-45f, 448.0f, true, 0.0f, bf16_max), std::ldexp(1.0f, 127));
  EXPECT_EQ(scale_from_amax(1e-3f, 448.0f, false, 1.0f, FLT_MAX), 448.0f);  // (eps: amax raised to 1)
}

// docs/fp8-spec.md §3.4: E8M0 rounds the exponent of fp32(amax * fp32(1/448)) up.
TEST(Fp8, MxScaleIsTheE8m0OfTheAmaxRoundedUp) {
  using ops::fp8::e8m0_of_amax;
  for (const auto& [amax, e] : std::vector<std::pair<float, uint8_t>>{{1.0f, 0x77},
                                                                      {1.75f, 0x77},
                                                                      {1.8f, 0x78},
                                                                      {2.0f, 0x78},
                                                                      {3.0f, 0x78},
                                                                      {448.0f, 0x7F},
                                                                      {449.0f, 0x80},
                                                                      {0.0f, 0x00},
                                                                      {kNaN, 0xFF},
                                                                      {kInf, 0xFE}})
    EXPECT_EQ(e8m0_of_amax(amax, false), e) << amax;
  EXPECT_EQ(e8m0_of_amax(57344.0f, true), 0x7F);
  EXPECT_EQ(e8m0_of_amax(FLT_MAX, false), 0xF7);  // (FLT_MAX / 448 ~ 1.14 * 2^119: exponent 119 + 127, rounded up)
  EXPECT_EQ(ops::fp8::e8m0_value(0x78), std::ldexp(1.0f, -7));
  EXPECT_EQ(ops::fp8::e8m0_scale(0x78), 128.0f);
  EXPECT_EQ(ops::fp8::e8m0_value(0x00), std::ldexp(1.0f, -127));
  EXPECT_EQ(ops::fp8::e8m0_scale(0x00), std::ldexp(1.0f, 127));
  EXPECT_EQ(ops::fp8::e8m0_scale(0xFE), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(ops::fp8::e8m0_value(0xFF)));
}

// The spec's recipe vectors: x = [1, -3, 0.5, 0.1] in E4M3 under each recipe (§4.4).
TEST(Fp8, RecipesOnTheSpecsTensor) {
  const std::vector<float> x = {1.0f, -3.0f, 0.5f, 0.1f};
  const auto bytes = [](const Quantized& r) {
    return std::vector<uint8_t>{byte(r.q, 0), byte(r.q, 1), byte(r.q, 2), byte(r.q, 3)};
  };
  // tensorwise (current scaling, one block)
  ops::Fp8Quantize p;
  Tensor amax = Tensor::zeros({1}, DType::f32);
  Quantized r = quantize(tensor_of(x, 1, 4), DType::f8e4m3, p, &amax);
  EXPECT_EQ(bytes(r), (std::vector<uint8_t>{0x71, 0xFE, 0x69, 0x57}));
  EXPECT_EQ(r.scale_inv.data<float>()[0], bits_float(0x3BDB6DB7u)) << r.scale_inv.data<float>()[0];  // 0x1.b6db6ep-8
  EXPECT_EQ(amax.data<float>()[0], 3.0f);
  // blockwise (one 1 x 128 block, powers of two), and MXFP8 (one 1 x 32 block)
  p.rule = ops::Fp8ScaleRule::current_pow2;
  p.block_rows = 1;
  p.block_cols = 128;
  r = quantize(tensor_of(x, 1, 128), DType::f8e4m3, p);
  EXPECT_EQ(bytes(r), (std::vector<uint8_t>{0x70, 0xFC, 0x68, 0x55}));
  EXPECT_EQ(r.scale_inv.data<float>()[0], std::ldexp(1.0f, -7));
  p.rule = ops::Fp8ScaleRule::mx;
  p.block_cols = 32;
  r = quantize(tensor_of(x, 1, 32), DType::f8e4m3, p);
  EXPECT_EQ(bytes(r), (std::vector<uint8_t>{0x70, 0xFC, 0x68, 0x55}));
  EXPECT_EQ(r.scale_inv.data<float>()[0], std::ldexp(1.0f, -7));
  // delayed, first micro-batch: the initial scale 1, the amax into row 0; the update gives tensorwise's scale
  p = {};
  p.rule = ops::Fp8ScaleRule::given;
  float history[1] = {0.0f};
  Tensor row0 = Tensor::zeros({1}, DType::f32);
  r = quantize(tensor_of(x, 1, 4), DType::f8e4m3, p, &row0);
  EXPECT_EQ(bytes(r), (std::vector<uint8_t>{0x38, 0xC4, 0x30, 0x1D}));
  EXPECT_EQ(r.scale_inv.data<float>()[0], 1.0f);
  history[0] = row0.data<float>()[0];
  const float scale = ops::fp8::delayed_update(history, 1, history[0], false, 448.0f, 1.0f);
  EXPECT_EQ(scale, 448.0f / 3.0f);
  EXPECT_EQ(history[0], 0.0f);
}

// Delayed scaling's update (§3.1 step 4): the roll, most_recent and max, a zero amax changing nothing, an infinite
// one keeping the scale while it is the one used, NaN ignored by max, the margin.
TEST(Fp8, DelayedScalingHistoryRollsAsTransformerEngine) {
  using ops::fp8::delayed_update;
  float h[4] = {5.0f, 0.0f, 0.0f, 0.0f};  // row 0 accumulated 5
  float s = delayed_update(h, 4, 5.0f, /*use_max=*/true, 448.0f, 1.0f);
  EXPECT_EQ(s, 448.0f / 5.0f);
  EXPECT_EQ(std::vector<float>(h, h + 4), (std::vector<float>{0.0f, 0.0f, 0.0f, 5.0f}));
  s = delayed_update(h, 4, 2.0f, true, 448.0f, s);
  EXPECT_EQ(s, 448.0f / 5.0f);  // (max over the history: 5 still in it)
  EXPECT_EQ(std::vector<float>(h, h + 4), (std::vector<float>{0.0f, 0.0f, 5.0f, 2.0f}));
  EXPECT_EQ(delayed_update(h, 4, 0.0f, true, 448.0f, s), s);  // zero: nothing moves
  EXPECT_EQ(std::vector<float>(h, h + 4), (std::vector<float>{0.0f, 0.0f, 5.0f, 2.0f}));
  s = delayed_update(h, 4, 1.0f, true, 448.0f, s);
  s = delayed_update(h, 4, 1.0f, true, 448.0f, s);
  EXPECT_EQ(std::vector<float>(h, h + 4), (std::vector<float>{0.0f, 2.0f, 1.0f, 1.0f}));
  EXPECT_EQ(s, 448.0f / 5.0f);  // (5 was among the old rows the second update saw)
  s = delayed_update(h, 4, 1.0f, true, 448.0f, s);
  EXPECT_EQ(s, 448.0f / 2.0f);
  EXPECT_EQ(delayed_update(h, 4, 4.0f, /*use_max=*/false, 448.0f, s), 448.0f / 4.0f);  // most_recent
  EXPECT_EQ(delayed_update(h, 4, kInf, false, 448.0f, 7.0f), 7.0f);                    // inf used: scale kept
  EXPECT_EQ(h[3], kInf);
  float n[2] = {0.0f, 3.0f};
  EXPECT_EQ(delayed_update(n, 2, kNaN, true, 448.0f, 7.0f), 448.0f / 3.0f);  // NaN ignored by max
  EXPECT_TRUE(std::isnan(n[1]));
  float m[1] = {0.0f};
  EXPECT_EQ(delayed_update(m, 1, 2.0f, false, 448.0f * 0.25f, 1.0f), 56.0f);  // margin 2: 448 * 2^-2 / 2
  EXPECT_EQ(delayed_update(m, 1, 1e-45f, false, 448.0f, 1.0f), FLT_MAX);
}

// Blocks are quantised independently (each alone gives the same bits), edge blocks are partial, an all-zero block
// has scale 1 and zero bytes, an all-equal block maps to the format's max (current) or below it (MXFP8), a NaN element
// is skipped by its block's amax and becomes 0x7F, bf16 input quantises as its f32 values, and every element
// dequantises to within the format's half-ulp of x (relative to its block's amax).
TEST(Fp8, BlocksAreIndependentWithPartialEdges) {
  struct Case {
    int64_t br, bc;
    ops::Fp8ScaleRule rule;
    DType format;
  };
  using R = ops::Fp8ScaleRule;
  const Tensor base = testing::randn({130, 260}, "fp8 blocks", 3.0f);
  for (const Case& c : {Case{1, 128, R::current_pow2, DType::f8e4m3}, Case{128, 1, R::current_pow2, DType::f8e5m2},
                        Case{128, 128, R::current_pow2, DType::f8e4m3}, Case{1, 32, R::mx, DType::f8e4m3},
                        Case{32, 1, R::mx, DType::f8e5m2}, Case{0, 0, R::current, DType::f8e4m3},
                        Case{1, 0, R::current, DType::f8e5m2}}) {
    SCOPED_TRACE(std::to_string(c.br) + " x " + std::to_string(c.bc) + " " + std::string(dtype_name(c.format)));
    Tensor x = base.clone();
    float* v = x.data<float>();
    for (int64_t r = 0; r < 130; ++r) v[r * 260 + 259] = 0.0f;  // the last column zero
    for (int64_t k = 0; k < 260; ++k) v[129 * 260 + k] = 0.0f;  // the last row zero
    for (int64_t k = 0; k < 40; ++k) v[5 * 260 + k] = 2.5f;     // a run of equal values
    v[7 * 260 + 3] = kNaN;
    ops::Fp8Quantize p;
    p.block_rows = c.br;
    p.block_cols = c.bc;
    p.rule = c.rule;
    Tensor amax = Tensor::zeros({1}, DType::f32);
    const Quantized r = quantize(x, c.format, p, &amax);
    const int64_t br = c.br ? c.br : 130, bc = c.bc ? c.bc : 260;
    ASSERT_EQ(r.scale_inv.shape(), (Shape{(130 + br - 1) / br, (260 + bc - 1) / bc}));
    const bool e5m2 = c.format == DType::f8e5m2;
    EXPECT_EQ(byte(r.q, 7 * 260 + 3), 0x7F);
    float most = 0.0f;
    for (int64_t i = 0; i < x.numel(); ++i)
      if (!std::isnan(v[i])) most = std::max(most, std::fabs(v[i]));
    EXPECT_EQ(amax.data<float>()[0], most);
    // one block alone gives the same bytes and scale
    for (const auto& [bi, bj] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {r.scale_inv.size(0) - 1, 0}, {0, r.scale_inv.size(1) - 1}}) {
      const int64_t r0 = bi * br, r1 = std::min<int64_t>(130, r0 + br), c0 = bj * bc,
                    c1 = std::min<int64_t>(260, c0 + bc);
      const Tensor block = x.slice(0, r0, r1).slice(1, c0, c1).clone();
      ops::Fp8Quantize whole = p;
      whole.block_rows = whole.block_cols = 0;
      const Quantized alone = quantize(block, c.format, whole);
      EXPECT_EQ(alone.scale_inv.data<float>()[0], r.scale_inv.data<float>()[bi * r.scale_inv.size(1) + bj]);
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t k = c0; k < c1; ++k)
          ASSERT_EQ(byte(alone.q, (i - r0) * (c1 - c0) + (k - c0)), byte(r.q, i * 260 + k)) << i << ", " << k;
    }
    // all-zero blocks (the zero last row / column, when a block holds only them): scale 1, zero bytes
    if (c.br == 1) {
      EXPECT_EQ(r.scale_inv.data<float>()[129 * r.scale_inv.size(1)], c.rule == R::mx ? std::ldexp(1.0f, -127) : 1.0f);
      EXPECT_EQ(byte(r.q, 129 * 260), 0x00);
    }
    // the run of 2.5: with 1 x 128 blocks the block [5, 0:128) holds more; with 1 x 32 the block [5, 0:32) is all 2.5
    if (c.br == 1 && c.bc == 32) {
      EXPECT_EQ(r.scale_inv.data<float>()[5 * r.scale_inv.size(1)], std::ldexp(1.0f, -7));  // 2.5 / 448 -> 2^-7
      EXPECT_EQ(byte(r.q, 5 * 260), ops::fp8::cast(2.5f * 128.0f, false));                  // 320, below 448
    }
    // dequantised within half an fp8 ulp of the block's scale (normal range) or its subnormal step
    Tensor back = Tensor::empty(x.shape(), DType::f32);
    ops::fp8_dequantize(r.q, r.scale_inv, back, c.br, c.bc, cpu);
    const float ulp = e5m2 ? 0.25f : 0.125f, sub = e5m2 ? std::ldexp(1.0f, -16) : std::ldexp(1.0f, -9);
    for (int64_t i = 0; i < 130; ++i)
      for (int64_t k = 0; k < 260; ++k) {
        const float xi = v[i * 260 + k];
        if (std::isnan(xi)) continue;
        const float inv = r.scale_inv.data<float>()[(i / br) * r.scale_inv.size(1) + k / bc];
        const float err = std::fabs(back.data<float>()[i * 260 + k] - xi);
        ASSERT_LE(err, std::max(0.5f * ulp * std::fabs(xi), 0.5f * sub * inv) * 1.0001f) << i << ", " << k;
      }
    // bf16 input: the bytes of its f32 values
    const Tensor xb = x.to(DType::bf16);
    const Quantized rb = quantize(xb, c.format, p), rf = quantize(xb.to(DType::f32), c.format, p);
    EXPECT_EQ(std::memcmp(rb.q.raw(), rf.q.raw(), static_cast<size_t>(rb.q.nbytes())), 0);
    EXPECT_EQ(std::memcmp(rb.scale_inv.raw(), rf.scale_inv.raw(), static_cast<size_t>(rb.scale_inv.nbytes())), 0);
  }
  // the amax accumulator keeps a larger value it holds (delayed scaling's row 0 over micro-batches)
  Tensor amax = Tensor::zeros({1}, DType::f32);
  amax.data<float>()[0] = 100.0f;
  quantize(tensor_of({1.0f, -3.0f}, 1, 2), DType::f8e4m3, {}, &amax);
  EXPECT_EQ(amax.data<float>()[0], 100.0f);
}

// tools/fp8_reference.py's cases (tensorwise E4M3 and E5M2, blockwise 1 x 128, 128 x 1 and 128 x 128, MXFP8 1 x 32
// and 32 x 1, delayed with a given scale) on one [130, 260] input holding zeros, equal runs, a NaN, infinities, values
// past both maxima, values that fall into the subnormals and f32 subnormals: the bytes, the scales and the amax equal
// the golden's bit for bit.
TEST(Fp8, RecipesMatchThePyTorchReference) {
  const io::SafetensorsFile g =
      io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/fp8_quantize.safetensors");
  const Tensor& x = g.tensors.at("x");
  const nlohmann::json cases = nlohmann::json::parse(g.metadata.at("cases"));
  ASSERT_EQ(cases.size(), 9u);
  for (const nlohmann::json& c : cases) {
    const std::string name = c.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const std::string rule = c.at("rule").get<std::string>();
    ops::Fp8Quantize p;
    p.block_rows = c.at("block_rows").get<int64_t>();
    p.block_cols = c.at("block_cols").get<int64_t>();
    p.rule = rule == "given"     ? ops::Fp8ScaleRule::given
             : rule == "current" ? ops::Fp8ScaleRule::current
             : rule == "mx"      ? ops::Fp8ScaleRule::mx
                                 : ops::Fp8ScaleRule::current_pow2;
    ASSERT_TRUE(rule == "current_pow2" || p.rule != ops::Fp8ScaleRule::current_pow2) << rule;
    p.scale = c.at("scale").get<float>();
    const DType format = c.at("format").get<std::string>() == "e5m2" ? DType::f8e5m2 : DType::f8e4m3;
    Tensor amax = Tensor::zeros({1}, DType::f32);
    const Quantized r = quantize(x, format, p, &amax);
    const Tensor &q = g.tensors.at(name + ".q"), &inv = g.tensors.at(name + ".scale_inv");
    ASSERT_EQ(q.dtype(), format);
    ASSERT_EQ(inv.shape(), r.scale_inv.shape());
    int64_t wrong = 0;
    for (int64_t i = 0; i < x.numel(); ++i)
      if (byte(r.q, i) != byte(q, i) && wrong++ < 5)
        ADD_FAILURE() << "element " << i << " (" << x.data<float>()[i] << "): " << int{byte(r.q, i)} << ", golden "
                      << int{byte(q, i)};
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(std::memcmp(r.scale_inv.raw(), inv.raw(), static_cast<size_t>(inv.nbytes())), 0);
    EXPECT_EQ(amax.data<float>()[0], g.tensors.at(name + ".amax").data<float>()[0]);
  }
}

TEST(Fp8, BadArgumentsAreNamed) {
  const Tensor x = Tensor::zeros({4, 8}, DType::f32);
  Tensor q = Tensor::empty({4, 8}, DType::f8e4m3), inv = Tensor::empty({1, 1}, DType::f32);
  Tensor wrong_q = Tensor::empty({4, 8}, DType::bf16), wrong_inv = Tensor::empty({2, 1}, DType::f32);
  ops::Fp8Quantize p;
  EXPECT_NE(error_of([&] { ops::fp8_quantize(x, wrong_q, inv, nullptr, p, cpu); }).find("q must be f8e4m3 or f8e5m2"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { ops::fp8_quantize(x, q, wrong_inv, nullptr, p, cpu); }).find("scale_inv must have shape [1, 1]"),
      std::string::npos);
  p.block_rows = 2;
  EXPECT_NE(error_of([&] { ops::fp8_quantize(x, q, inv, nullptr, p, cpu); }).find("scale_inv must have shape [2, 1]"),
            std::string::npos);
  p = {};
  p.rule = ops::Fp8ScaleRule::given;
  p.scale = 0.0f;
  EXPECT_NE(error_of([&] { ops::fp8_quantize(x, q, inv, nullptr, p, cpu); }).find("given scale must be finite and > 0"),
            std::string::npos);
  p = {};
  Tensor bad_amax = Tensor::zeros({2}, DType::f32);
  EXPECT_NE(error_of([&] { ops::fp8_quantize(x, q, inv, &bad_amax, p, cpu); }).find("amax_out must be a [1] f32"),
            std::string::npos);
  Tensor x16 = Tensor::zeros({4, 8}, DType::f16);
  EXPECT_NE(error_of([&] { ops::fp8_dequantize(q, inv, x16, 0, 0, cpu); }).find("x must be f32 or bf16"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { ops::fp8_quantize(x, q, inv, nullptr, p, ops::Context{Device::cuda}); }).find("fp8_quantize"),
      std::string::npos);
}

}  // namespace
}  // namespace moecore
