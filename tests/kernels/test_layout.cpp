// Tests of the CPU layout ops against naive index loops: transpose_01, and qkv_slots_gather / qkv_slots_scatter
// (QK-norm's view of the fused QKV activation) over group and slot combinations, f32, bf16 and f16 with conversions,
// the round trip, untouched slots, the multi-threaded path and the errors. No finite differences: pure copies.
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::randn;
using testing::to_vector;

const ops::Context kCpu;

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}
using testing::expect_error;
Tensor from_floats(const Shape& s, const std::vector<float>& v, DType t) {
  Tensor f = Tensor::empty(s, DType::f32, MemCategory::other);
  std::memcpy(f.raw(), v.data(), v.size() * sizeof(float));
  return f.to(t);
}

// One case: T tokens (as [B, S] when B > 0), G groups of R query slots, a key and a value slot, head dim D.
struct SlotCase {
  int64_t B, S, G, R, D, slot, count;
  ops::QkvDims dims() const { return {B, S, G, R, D}; }
  int64_t tokens() const { return B * S; }
  Shape qkv_shape() const { return {B, S, dims().width()}; }
  Shape packed_shape() const { return {tokens() * G * count, D}; }
  std::string str() const {
    return "B" + std::to_string(B) + " S" + std::to_string(S) + " G" + std::to_string(G) + " R" + std::to_string(R) +
           " D" + std::to_string(D) + " slots [" + std::to_string(slot) + ", " + std::to_string(slot + count) + ")";
  }
};

// Element offset in qkv of channel i of slot `slot + j` of group g of token t, and in packed of the same value.
int64_t qkv_at(const SlotCase& c, int64_t t, int64_t g, int64_t j, int64_t i) {
  return t * c.dims().width() + (g * (c.R + 2) + c.slot + j) * c.D + i;
}
int64_t packed_at(const SlotCase& c, int64_t t, int64_t g, int64_t j, int64_t i) {
  return ((t * c.G + g) * c.count + j) * c.D + i;
}
template <class Fn>
void for_each_slot_element(const SlotCase& c, Fn&& fn) {
  for (int64_t t = 0; t < c.tokens(); ++t)
    for (int64_t g = 0; g < c.G; ++g)
      for (int64_t j = 0; j < c.count; ++j)
        for (int64_t i = 0; i < c.D; ++i) fn(qkv_at(c, t, g, j, i), packed_at(c, t, g, j, i));
}

// Key slot alone, all query slots, one query, the value slot, every slot, middle queries, one group, one
// query per group, D = 2, and a case large enough for the OpenMP path (rows * D > kParallelWork).
const std::vector<SlotCase> kCases = {
    {2, 5, 2, 2, 8, 2, 1}, {2, 5, 2, 2, 8, 0, 2}, {1, 7, 3, 4, 4, 1, 1},   {1, 7, 3, 4, 4, 5, 1},
    {2, 3, 2, 3, 6, 0, 5}, {3, 2, 4, 4, 2, 1, 2}, {2, 4, 1, 4, 8, 0, 4},   {2, 4, 1, 4, 8, 4, 1},
    {1, 6, 5, 1, 8, 0, 1}, {1, 6, 5, 1, 8, 1, 1}, {2, 64, 4, 4, 64, 0, 4}, {2, 64, 4, 4, 64, 4, 1},
};
const std::vector<std::pair<DType, DType>> kDtypes = {  // (qkv, packed)
    {DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::bf16, DType::f32}, {DType::f32, DType::bf16},
    {DType::f16, DType::f16}, {DType::f16, DType::f32},   {DType::f32, DType::f16}};

std::string trace(const SlotCase& c, DType q, DType p) {
  return c.str() + ", qkv " + std::string(dtype_name(q)) + ", packed " + std::string(dtype_name(p));
}

// The gathered rows equal the naive loop's in f32, converted to packed's dtype (bf16 <- f32 rounds as
// Tensor::to does, bf16 -> f32 is exact): compared bitwise.
TEST(QkvSlotsGather, MatchesNaiveLoop) {
  for (const SlotCase& c : kCases) {
    for (const auto& [tq, tp] : kDtypes) {
      SCOPED_TRACE(trace(c, tq, tp));
      const Tensor qkv = randn(c.qkv_shape(), "qkv").to(tq);
      const auto q = to_vector(qkv);
      std::vector<float> ref(static_cast<size_t>(c.packed_shape().numel()), NAN);
      for_each_slot_element(c, [&](int64_t a, int64_t b) { ref[b] = q[a]; });
      Tensor packed = Tensor::empty(c.packed_shape(), tp, MemCategory::other);
      packed.fill_(NAN);
      ops::qkv_slots_gather(packed, qkv, c.dims(), c.slot, c.count, kCpu);
      EXPECT_TRUE(bitwise_equal(packed, from_floats(c.packed_shape(), ref, tp)));
    }
  }
}

// The named slots take the packed rows (converted to qkv's dtype); every other element of qkv keeps its bits.
TEST(QkvSlotsScatter, MatchesNaiveLoopAndTouchesOnlyTheNamedSlots) {
  for (const SlotCase& c : kCases) {
    for (const auto& [tq, tp] : kDtypes) {
      SCOPED_TRACE(trace(c, tq, tp));
      Tensor qkv = randn(c.qkv_shape(), "qkv").to(tq);
      const Tensor packed = randn(c.packed_shape(), "packed", 2.0f).to(tp);
      std::vector<float> ref = to_vector(qkv);
      const auto p = to_vector(packed);
      for_each_slot_element(c, [&](int64_t a, int64_t b) { ref[a] = p[b]; });
      ops::qkv_slots_scatter(qkv, packed, c.dims(), c.slot, c.count, kCpu);
      EXPECT_TRUE(bitwise_equal(qkv, from_floats(c.qkv_shape(), ref, tq)));
    }
  }
}

// Gather then scatter back (through a packed tensor of either dtype that holds qkv's values exactly) leaves
// qkv bitwise unchanged; a bf16 or f16 qkv through an f32 packed tensor is exact both ways.
TEST(QkvSlots, GatherThenScatterLeavesQkvUnchanged) {
  const std::vector<std::pair<DType, DType>> exact = {{DType::f32, DType::f32},
                                                      {DType::bf16, DType::bf16},
                                                      {DType::bf16, DType::f32},
                                                      {DType::f16, DType::f16},
                                                      {DType::f16, DType::f32}};
  for (const SlotCase& c : kCases) {
    for (const auto& [tq, tp] : exact) {
      SCOPED_TRACE(trace(c, tq, tp));
      Tensor qkv = randn(c.qkv_shape(), "qkv").to(tq);
      const Tensor before = qkv.clone();
      Tensor packed = Tensor::empty(c.packed_shape(), tp, MemCategory::other);
      ops::qkv_slots_gather(packed, qkv, c.dims(), c.slot, c.count, kCpu);
      ops::qkv_slots_scatter(qkv, packed, c.dims(), c.slot, c.count, kCpu);
      EXPECT_TRUE(bitwise_equal(qkv, before));
    }
  }
}

// QK-norm's use: the queries and the key of a 2-D [T, width] activation, scattered into a zero tensor, fill
// exactly the query and key slots; the value slots stay zero.
TEST(QkvSlots, QueriesAndKeyOfTwoDimensionalQkvCoverAllButValues) {
  const ops::QkvDims d{2, 3, 2, 3, 4};
  const int64_t T = d.B * d.S;
  const Tensor qkv = randn({T, d.width()}, "qkv");
  Tensor q = Tensor::empty({T * d.q_heads(), d.D}, DType::f32), k = Tensor::empty({T * d.G, d.D}, DType::f32);
  ops::qkv_slots_gather(q, qkv, d, 0, d.R, kCpu);
  ops::qkv_slots_gather(k, qkv, d, d.R, 1, kCpu);
  Tensor out = Tensor::zeros({T, d.width()}, DType::f32, MemCategory::other);
  ops::qkv_slots_scatter(out, q, d, 0, d.R, kCpu);
  ops::qkv_slots_scatter(out, k, d, d.R, 1, kCpu);
  const auto a = to_vector(qkv), b = to_vector(out);
  for (size_t e = 0; e < a.size(); ++e) {
    const bool value = (static_cast<int64_t>(e) % d.width()) / d.D % (d.R + 2) == d.R + 1;
    ASSERT_EQ(b[e], value ? 0.0f : a[e]) << "element " << e;
  }
}

TEST(QkvSlots, BadShapesSlotsAndDtypesFailNamingTheOp) {
  const SlotCase c{2, 3, 2, 2, 4, 0, 2};
  const ops::QkvDims d = c.dims();
  Tensor qkv = randn(c.qkv_shape(), "qkv");
  for (const char* op : {"qkv_slots_gather", "qkv_slots_scatter"}) {
    SCOPED_TRACE(op);
    const bool gather = std::string(op) == "qkv_slots_gather";
    auto call = [&](Tensor& q, Tensor& p, int64_t slot, int64_t count) {
      if (gather)
        ops::qkv_slots_gather(p, q, d, slot, count, kCpu);
      else
        ops::qkv_slots_scatter(q, p, d, slot, count, kCpu);
    };
    auto packed = [&](int64_t count) { return Tensor::empty({c.tokens() * c.G * count, c.D}, DType::f32); };
    Tensor p2 = packed(2), p1 = packed(1), p3 = packed(3), p0 = Tensor::empty({0, c.D}, DType::f32);
    expect_error([&] { call(qkv, p2, 3, 2); }, {op, "slots [3, 5) of 4"});  // past the value slot
    expect_error([&] { call(qkv, p1, -1, 1); }, {op, "slots [-1, 0)"});
    expect_error([&] { call(qkv, p0, 0, 0); }, {op, "slots [0, 0)"});
    expect_error([&] { call(qkv, p3, 0, 2); }, {op, "packed must be [24, 4]"});  // rows of another count
    Tensor wide = Tensor::empty({c.tokens() * c.G * 2, c.D + 1}, DType::f32);
    expect_error([&] { call(qkv, wide, 0, 2); }, {op, "packed must be [24, 4]"});
    Tensor flat = Tensor::empty({c.tokens() * c.G * 2 * c.D}, DType::f32);
    expect_error([&] { call(qkv, flat, 0, 2); }, {op, "packed must be"});
    Tensor narrow = randn({c.tokens(), d.width() - c.D}, "narrow");
    expect_error([&] { call(narrow, p2, 0, 2); }, {op, "G*(R+2)*D = 32"});
    Tensor one_d = randn({d.width()}, "one_d");
    expect_error([&] { call(one_d, p2, 0, 2); }, {op, "G*(R+2)*D"});
    Tensor parent = randn({c.tokens(), 2 * d.width()}, "parent"), strided = parent.slice(1, 0, d.width());
    expect_error([&] { call(strided, p2, 0, 2); }, {op, "qkv must be contiguous"});
    Tensor ints = Tensor::zeros(c.packed_shape(), DType::i32);
    expect_error([&] { call(qkv, ints, 0, 2); }, {op, "packed must be f32, bf16 or f16"});
  }
}

// out[b, a, :] = in[a, b, :] by a naive loop, f32, bf16 and f16 (bitwise), including A = 1, B = 1 and W = 1, and a
// case above the OpenMP threshold; applying it twice returns the input.
TEST(Transpose01, MatchesNaiveLoopAndIsAnInvolution) {
  const std::vector<Shape> shapes = {{3, 5, 7}, {1, 4, 6}, {4, 1, 6}, {5, 3, 1}, {2, 16, 32}, {64, 8, 96}};
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const Shape& s : shapes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " " + s.str());
      const int64_t A = s[0], B = s[1], W = s[2];
      const Tensor in = randn(s, "in").to(t);
      const auto v = to_vector(in);
      std::vector<float> ref(v.size());
      for (int64_t a = 0; a < A; ++a)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t w = 0; w < W; ++w) ref[(b * A + a) * W + w] = v[(a * B + b) * W + w];
      Tensor out = Tensor::empty({B, A, W}, t, MemCategory::other), back = Tensor::empty(s, t, MemCategory::other);
      ops::transpose_01(out, in, kCpu);
      EXPECT_TRUE(bitwise_equal(out, from_floats({B, A, W}, ref, t)));
      ops::transpose_01(back, out, kCpu);
      EXPECT_TRUE(bitwise_equal(back, in));
    }
  }
}

TEST(Transpose01, BadShapesDtypesAndAliasingFailNamingTheOp) {
  Tensor in = randn({3, 4, 5}, "in");
  Tensor same = Tensor::empty({3, 4, 5}, DType::f32), bf = Tensor::empty({4, 3, 5}, DType::bf16);
  Tensor wrong_w = Tensor::empty({4, 3, 6}, DType::f32), two_d = Tensor::empty({12, 5}, DType::f32);
  for (Tensor* out : {&same, &bf, &wrong_w, &two_d})
    expect_error([&] { ops::transpose_01(*out, in, kCpu); }, {"transpose_01", "in [A, B, W] and out [B, A, W]"});
  Tensor square = randn({4, 4, 5}, "square");
  expect_error([&] { ops::transpose_01(square, square, kCpu); }, {"transpose_01", "must not alias"});
  Tensor parent = randn({3, 4, 10}, "parent"), strided = parent.slice(2, 0, 5);
  Tensor out = Tensor::empty({4, 3, 5}, DType::f32);
  expect_error([&] { ops::transpose_01(out, strided, kCpu); }, {"transpose_01", "in must be contiguous"});
  Tensor ints = Tensor::zeros({3, 4, 5}, DType::i32), iout = Tensor::zeros({4, 3, 5}, DType::i32);
  expect_error([&] { ops::transpose_01(iout, ints, kCpu); }, {"transpose_01", "in must be f32, bf16 or f16"});
}

}  // namespace
}  // namespace moecore
