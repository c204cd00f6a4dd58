// Large-shape GPU tests (ctest labels "gpu;long": excluded from the default run, several GB of device memory): shapes
// past the launch grid's cap (grid_for: 2^24 threads, so element-wise kernels must loop) and past 2^31 elements
// (int32 indexing). Each skips without a GPU (a failure with MOECORE_REQUIRE_GPU=1).
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda_test_util.h"
#include "moecore/core/dtype.h"
#include "moecore/core/rng.h"

namespace moecore {
namespace {
using namespace testing_cuda;

// ECHO's rerouting and fold with T * E = 2^25 and T * W = 80 * 2^19 elements, past the 2^24 threads of a capped grid:
// bit for bit the CPU kernels, and the fold of the rerouted map and probabilities gives back the originals.
TEST(CudaLong, EchoRerouteAndFoldPast2To24ElementsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t P = 8, E = 64, Sl = 2, T = int64_t{1} << 19, rank = 1;
  const int64_t S = P * Sl, W = P * (E / P + Sl);
  ASSERT_GT(T * E, int64_t{1} << 24);
  // Every rank routes like this: two experts per token, expert 5 hot on two thirds of the tokens (so slots are used).
  Tensor map_h = Tensor::zeros({T, E}, DType::boolean, MemCategory::other);
  Tensor probs_h = testing::randn({T, E}, "echo_probs", 1.0f, 4100);
  bool* m = map_h.data<bool>();
  for (int64_t t = 0; t < T; ++t) {
    m[t * E + static_cast<int64_t>(testing::mix(4101 + t) % E)] = true;
    m[t * E + (t % 3 ? 5 : static_cast<int64_t>(testing::mix(4102 + t) % E))] = true;
  }
  for (int64_t i = 0; i < T * E; ++i)
    if (!m[i]) probs_h.data<float>()[i] = 0.0f;
  Tensor counts = Tensor::zeros({P, E}, DType::i64, MemCategory::other);
  int64_t* n = counts.data<int64_t>();
  for (int64_t i = 0; i < T * E; ++i) n[i % E] += m[i] ? 1 : 0;
  for (int64_t s = 1; s < P; ++s) std::memcpy(n + s * E, n, sizeof(int64_t) * static_cast<size_t>(E));
  Tensor se = Tensor::empty({S}, DType::i64, MemCategory::other), st = Tensor::empty({P, S}, DType::i64),
         ld = Tensor::empty({2, P}, DType::i64);
  ops::moe_echo_plan(se, st, ld, counts, Sl, 0, ops::Context{});
  int64_t moved = 0;
  for (int64_t j = 0; j < S; ++j) moved += se.data<int64_t>()[j] >= 0 ? st.data<int64_t>()[rank * S + j] : 0;
  ASSERT_GT(moved, 0) << "the plan must move tokens of rank " << rank << " for this test";

  Both map = both(map_h), probs = both(probs_h), slot_expert = both(se), slot_tokens = both(st);
  Both map2 = nans({T, W}, DType::boolean), probs2 = nans({T, W});
  for (bool g : {false, true})
    ops::moe_echo_reroute(map2.on(g), probs2.on(g), map.on(g), probs.on(g), slot_expert.on(g), slot_tokens.on(g), rank,
                          Sl, ctx_of(g));
  expect_bitwise(map2);
  expect_bitwise(probs2);
  Both mf = nans({T, E}, DType::boolean), pf = nans({T, E});
  for (bool g : {false, true}) {
    ops::moe_echo_fold(mf.on(g), map2.on(g), slot_expert.on(g), Sl, ctx_of(g));
    ops::moe_echo_fold(pf.on(g), probs2.on(g), slot_expert.on(g), Sl, ctx_of(g));
  }
  expect_bitwise(mf);
  expect_bitwise(pf);
  const Tensor mf_gpu = testing::host(mf.gpu), pf_gpu = testing::host(pf.gpu);
  EXPECT_EQ(std::memcmp(mf_gpu.raw(), map_h.raw(), static_cast<size_t>(map_h.nbytes())), 0) << "fold(reroute(map))";
  EXPECT_EQ(std::memcmp(pf_gpu.raw(), probs_h.raw(), static_cast<size_t>(probs_h.nbytes())), 0)
      << "fold(reroute(probs))";
  // Every column non-zero: the fold's sums over the slots, in the CPU's order.
  Both in = randn({T, W}, "echo_fold_in", 4103), out = nans({T, E});
  for (bool g : {false, true}) ops::moe_echo_fold(out.on(g), in.on(g), slot_expert.on(g), Sl, ctx_of(g));
  expect_bitwise(out);
}

// Copies of a strided device view with 2^31 + 2^15 elements (the last column block of a [65537, 32769] f32 tensor,
// 8.6 GB): clone (same dtype) and to(bf16) (converting), checked on whole rows read back from the device, including
// the last row, whose elements lie past index 2^31 of the view.
TEST(CudaLong, StridedDeviceCopiesPast2To31ElementsAreExact) {
  SKIP_WITHOUT_GPU();
  const int64_t R = 65537, C = 32769;
  Tensor x = Tensor::empty({R, C}, DType::f32, MemCategory::other, Device::cuda);
  ops::router_normal_logits(x, philox_key(4200, "long_copy"), 0, ctx_of(true));  // a value per position, on device
  const Tensor view = x.slice(1, 1, C);
  ASSERT_FALSE(view.is_contiguous());
  ASSERT_GT(view.numel(), int64_t{1} << 31);
  const Tensor same = view.clone();
  const Tensor half = view.to(DType::bf16);
  ASSERT_TRUE(same.is_contiguous() && half.is_contiguous());
  ASSERT_EQ(same.shape(), view.shape());
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{40000}, R - 2, R - 1}) {
    SCOPED_TRACE(::testing::Message() << "row " << r);
    const Tensor src = testing::host(x.slice(0, r, r + 1));  // [1, C], contiguous on the device
    const Tensor got = testing::host(same.slice(0, r, r + 1)), got16 = testing::host(half.slice(0, r, r + 1));
    const float* s = src.data<float>() + 1;
    EXPECT_EQ(std::memcmp(got.data<float>(), s, sizeof(float) * static_cast<size_t>(C - 1)), 0) << "clone";
    int64_t wrong = 0, first = -1;
    for (int64_t c = 0; c < C - 1; ++c)
      if (got16.data<bf16>()[c].bits != float_to_bf16(s[c]).bits) {
        ++wrong;
        if (first < 0) first = c;
      }
    EXPECT_EQ(wrong, 0) << "to(bf16): " << wrong << " elements differ from float_to_bf16, the first at column "
                        << first;
  }
}

}  // namespace
}  // namespace moecore
