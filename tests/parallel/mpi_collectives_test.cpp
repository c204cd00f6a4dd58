// Multi-rank tests of parallel/comm.h and make_process_groups, run under mpirun with 2 and 4 ranks:
// deterministic reductions (bitwise equal to the rank-ordered sum on every rank), data movement with
// zero counts, debug-mode mismatch detection, and the timeout when a rank skips a collective.
// Own main: comm_init/comm_finalize, only rank 0 prints the gtest report, other ranks print failures.
#include <gtest/gtest.h>

#include "mpi_test_support.h"

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>

#include "moecore/core/error.h"
#include "moecore/core/tensor.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"
#include "test_util.h"

namespace moecore {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

class Mpi : public testing_mpi::MpiTest {
 protected:
  ProcessGroup dup(const std::string& name) const { return group_split(world, name, {world.ranks()}); }
};

using testing::error_of;
using testing::mix;

// Exact values (signed mantissa × 2^e, no rounding and no multiply the compiler could fuse into an FMA)
// over many magnitudes, so the summation order changes the rounding.
template <class T>
T contribution(int rank, int64_t i) {
  const uint64_t h = mix(static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(i));
  if constexpr (std::is_same_v<T, int64_t>) {
    return static_cast<int64_t>(h);  // wraps around when summed
  } else {
    const int bits = std::is_same_v<T, float> ? 24 : 53;
    const auto mantissa = static_cast<int64_t>(h >> (64 - bits)) - (int64_t{1} << (bits - 1));
    return std::ldexp(static_cast<T>(mantissa), static_cast<int>(h % 40) - 20 - bits);
  }
}

template <class T>
T rank_ordered_sum(int p, int64_t i, bool reverse = false) {
  if constexpr (std::is_same_v<T, int64_t>) {
    uint64_t acc = 0;
    for (int r = 0; r < p; ++r) acc += static_cast<uint64_t>(contribution<T>(r, i));
    return static_cast<int64_t>(acc);
  } else {
    T acc = contribution<T>(reverse ? p - 1 : 0, i);
    for (int k = 1; k < p; ++k) acc += contribution<T>(reverse ? p - 1 - k : k, i);
    return acc;
  }
}

template <class T>
void check_all_reduce(const ProcessGroup& world, int64_t n) {
  const int p = world.size(), me = world.rank();
  std::vector<T> first;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<T> buf(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) buf[static_cast<size_t>(i)] = contribution<T>(me, i);
    all_reduce_sum(buf, world);
    for (int64_t i = 0; i < n; ++i) {
      const T want = rank_ordered_sum<T>(p, i);
      ASSERT_EQ(std::memcmp(&buf[static_cast<size_t>(i)], &want, sizeof(T)), 0)
          << "element " << i << " of " << n << ": got " << buf[static_cast<size_t>(i)] << " want " << want;
    }
    if (rep == 0) first = buf;
    ASSERT_EQ(std::memcmp(buf.data(), first.data(), sizeof(T) * buf.size()), 0) << "repeat " << rep;
    std::vector<T> every(static_cast<size_t>(n * p));
    all_gather(every, buf, world);
    for (int r = 0; r < p; ++r)
      ASSERT_EQ(std::memcmp(every.data() + r * n, buf.data(), sizeof(T) * buf.size()), 0) << "rank " << r << " differs";
  }
}

TEST_F(Mpi, WorldIsEveryRank) {
  EXPECT_TRUE(comm_available());
  EXPECT_STREQ(comm_backend_name(), "mpi");
  EXPECT_GE(P, 2);
  EXPECT_EQ(world.world_rank(), me);
}

TEST_F(Mpi, AllReduceIsRankOrderedAndBitwiseIdentical) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{P - 1}, int64_t{1000}, int64_t{4099}}) {
    check_all_reduce<float>(world, n);
    check_all_reduce<double>(world, n);
    check_all_reduce<int64_t>(world, n);
  }
  // The check has teeth: with 3+ ranks another order rounds differently somewhere.
  if (P >= 3) {
    int differ = 0;
    for (int64_t i = 0; i < 4099; ++i) differ += rank_ordered_sum<float>(P, i) != rank_ordered_sum<float>(P, i, true);
    EXPECT_GT(differ, 0);
  }
}

TEST_F(Mpi, AllGatherAndAllGatherV) {
  std::vector<int32_t> in = {me * 10, me * 10 + 1, me * 10 + 2}, out(static_cast<size_t>(3 * P));
  all_gather(out, in, world);
  for (int r = 0; r < P; ++r)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(out[static_cast<size_t>(3 * r + k)], r * 10 + k);
  std::vector<int64_t> counts(static_cast<size_t>(P));  // rank 0 contributes nothing
  for (int r = 0; r < P; ++r) counts[static_cast<size_t>(r)] = r % 3;
  std::vector<double> vin(static_cast<size_t>(me % 3));
  for (size_t k = 0; k < vin.size(); ++k) vin[k] = me + 0.25 * static_cast<double>(k);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  std::vector<double> vout(static_cast<size_t>(total), -1.0);
  all_gather_v(vout, vin, counts, world);
  size_t at = 0;
  for (int r = 0; r < P; ++r)
    for (int k = 0; k < r % 3; ++k) EXPECT_EQ(vout[at++], r + 0.25 * k);
}

TEST_F(Mpi, ReduceScatterSumIsRankOrdered) {
  const int64_t n = 37;
  std::vector<float> in(static_cast<size_t>(n * P)), out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n * P; ++i) in[static_cast<size_t>(i)] = contribution<float>(me, i);
  reduce_scatter_sum(out, in, world);
  for (int64_t i = 0; i < n; ++i) {
    const float want = rank_ordered_sum<float>(P, me * n + i);
    EXPECT_EQ(std::bit_cast<uint32_t>(out[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(want)) << i;
  }
}

// bf16 (Megatron-FSDP's gradient communication): each partial sum of the rank order rounded to bf16, as NCCL's
// reductions of bf16 buffers round at every addition; the same in the all-reduce and the nonblocking form.
TEST_F(Mpi, Bf16ReductionsRoundEveryAdditionInRankOrder) {
  const int64_t n = 37;
  std::vector<bf16> in(static_cast<size_t>(n * P)), out(static_cast<size_t>(n)), all(static_cast<size_t>(n * P));
  const auto value = [](int r, int64_t i) { return float_to_bf16(contribution<float>(r, i) * 1e3f); };
  for (int64_t i = 0; i < n * P; ++i) in[static_cast<size_t>(i)] = all[static_cast<size_t>(i)] = value(me, i);
  reduce_scatter_sum(std::span<bf16>(out), std::span<const bf16>(in), world);
  all_reduce_sum(std::span<bf16>(all), world);
  Tensor async_in = Tensor::empty({n * P}, DType::bf16, MemCategory::other);
  Tensor async_out = Tensor::empty({n}, DType::bf16, MemCategory::other);
  std::memcpy(async_in.raw(), in.data(), static_cast<size_t>(n * P) * sizeof(bf16));
  reduce_scatter_sum_async(async_out, async_in, world).wait();
  const auto want = [&](int64_t i) {
    float acc = bf16_to_float(value(0, i));
    for (int r = 1; r < P; ++r) acc = bf16_to_float(float_to_bf16(acc + bf16_to_float(value(r, i))));
    return float_to_bf16(acc).bits;
  };
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(out[static_cast<size_t>(i)].bits, want(me * n + i)) << i;
    EXPECT_EQ(async_out.data<bf16>()[i].bits, want(me * n + i)) << i;
  }
  for (int64_t i = 0; i < n * P; ++i) EXPECT_EQ(all[static_cast<size_t>(i)].bits, want(i)) << i;
}

// Blocks of different sizes (rank 0's empty): block r of every rank's input is summed on rank r in rank order, in
// the span form and in the row form of tensors.
TEST_F(Mpi, ReduceScatterVSumIsRankOrdered) {
  std::vector<int64_t> counts(static_cast<size_t>(P)), starts(static_cast<size_t>(P));
  int64_t total = 0;
  for (int r = 0; r < P; ++r) {
    counts[static_cast<size_t>(r)] = r % 3 == 0 ? r : 5 * r + 1;
    starts[static_cast<size_t>(r)] = total;
    total += counts[static_cast<size_t>(r)];
  }
  const int64_t mine = counts[static_cast<size_t>(me)], first = starts[static_cast<size_t>(me)];
  std::vector<float> in(static_cast<size_t>(total)), out(static_cast<size_t>(mine), -1.0f);
  for (int64_t i = 0; i < total; ++i) in[static_cast<size_t>(i)] = contribution<float>(me, i);
  reduce_scatter_v_sum(out, in, counts, world);
  for (int64_t i = 0; i < mine; ++i) {
    const float want = rank_ordered_sum<float>(P, first + i);
    EXPECT_EQ(std::bit_cast<uint32_t>(out[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(want)) << i;
  }
  const int64_t W = 3;  // rows of 3 elements
  Tensor tin = Tensor::empty({total, W}, DType::f32, MemCategory::other);
  Tensor tout = Tensor::empty({mine, W}, DType::f32, MemCategory::other);
  for (int64_t i = 0; i < total * W; ++i) tin.data<float>()[i] = contribution<float>(me, i);
  reduce_scatter_v_sum(tout, tin, counts, world);
  for (int64_t i = 0; i < mine * W; ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(tout.data<float>()[i]),
              std::bit_cast<uint32_t>(rank_ordered_sum<float>(P, first * W + i)))
        << i;
  // A wrong output size names the counts.
  Tensor bad = Tensor::empty({mine + 1, W}, DType::f32, MemCategory::other);
  EXPECT_HAS(error_of([&] { reduce_scatter_v_sum(bad, tin, counts, world); }), "counts[");
}

TEST_F(Mpi, AllToAllVWithSilentRanks) {
  // count(i -> j): rank 0 sends nothing at all; others send (i + j) % 3 elements, encoding src, dst, k.
  auto count = [](int i, int j) -> int64_t { return i == 0 ? 0 : (i + j) % 3; };
  std::vector<int64_t> send(static_cast<size_t>(P)), recv(static_cast<size_t>(P)), in, out;
  for (int j = 0; j < P; ++j) {
    send[static_cast<size_t>(j)] = count(me, j);
    recv[static_cast<size_t>(j)] = count(j, me);
    for (int64_t k = 0; k < count(me, j); ++k) in.push_back(me * 1000000 + j * 1000 + k);
  }
  int64_t total = 0;
  for (int64_t c : recv) total += c;
  out.assign(static_cast<size_t>(total), -1);
  all_to_all_v(out, recv, in, send, world);
  size_t at = 0;
  for (int j = 0; j < P; ++j)
    for (int64_t k = 0; k < count(j, me); ++k) EXPECT_EQ(out[at++], j * 1000000 + me * 1000 + k);
  // Tensor form: rows of [*, 4] bf16, one row per destination from every rank.
  Tensor tin = Tensor::zeros({P, 4}, DType::bf16), tout = Tensor::zeros({P, 4}, DType::bf16);
  for (int j = 0; j < P; ++j)
    for (int h = 0; h < 4; ++h) tin.data<bf16>()[j * 4 + h] = float_to_bf16(static_cast<float>(me * 8 + h));
  std::vector<int64_t> ones(static_cast<size_t>(P), 1);
  all_to_all_v(tout, ones, tin, ones, world);
  for (int j = 0; j < P; ++j)
    for (int h = 0; h < 4; ++h) EXPECT_EQ(bf16_to_float(tout.data<bf16>()[j * 4 + h]), static_cast<float>(j * 8 + h));
}

TEST_F(Mpi, BroadcastFromEveryRoot) {
  for (int root = 0; root < P; ++root) {
    std::vector<double> buf(5, me == root ? 1.5 * root : -7.0);
    broadcast(buf, root, world);
    for (double v : buf) EXPECT_EQ(v, 1.5 * root);
  }
  barrier(world);
}

TEST_F(Mpi, ProcessGroupsMatchTheLayout) {
  std::vector<ParallelConfig> configs(1);
  configs[0].expert_model_parallel_size = P;  // EP = world
  if (P % 2 == 0) {
    configs.resize(3);
    configs[1].tensor_model_parallel_size = 2, configs[1].expert_model_parallel_size = 2;
    configs[1].expert_tensor_parallel_size = 1;
    configs[2].pipeline_model_parallel_size = 2, configs[2].expert_model_parallel_size = P / 2;
  }
  for (const ParallelConfig& c : configs) {
    const ProcessGroups pg = make_process_groups(c, 2 * P, world);
    for (int k = 0; k < kNumGroupKinds; ++k) {
      const auto kind = static_cast<GroupKind>(k);
      const ProcessGroup& g = pg.get(kind);
      ASSERT_EQ(g.ranks(), pg.layout.group(kind, me)) << group_kind_name(kind);
      ASSERT_EQ(g.rank(), pg.layout.index_in_group(kind, me));
      ASSERT_EQ(g.name(), group_kind_name(kind));
      std::vector<int64_t> v = {me + 1};
      all_reduce_sum(v, g);
      int64_t want = 0;
      for (int r : g.ranks()) want += r + 1;
      EXPECT_EQ(v[0], want) << group_kind_name(kind);
    }
  }
}

TEST_F(Mpi, BadLayoutFailsOnEveryRankBeforeAnyCollective) {
  ParallelConfig c;
  c.expert_model_parallel_size = P;
  std::string msg;
  try {
    make_process_groups(c, P + 1, world);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, "num_experts (" + std::to_string(P + 1) + ") must be divisible by expert_model_parallel_size (" +
                      std::to_string(P) + ")");
  c.expert_model_parallel_size = 1;
  c.tensor_model_parallel_size = P + 1;
  msg.clear();
  try {
    make_process_groups(c, 4, world);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, "world_size (" + std::to_string(P) + ") must be divisible by tensor_model_parallel_size (" +
                      std::to_string(P + 1) + ")");
  barrier(world);  // the world is untouched and still in step
}

using testing::error_of;

TEST_F(Mpi, DebugModeNamesMismatchedCollectives) {
  const CommOptions saved = comm_options();
  comm_set_options({.debug = true, .timeout_s = 20});
  const ProcessGroup g = dup("dbg");
  std::vector<float> a(8, 1.0f), gathered(static_cast<size_t>(4 * P));
  const std::vector<float> four(4, 2.0f);
  // Rank 0 reduces 8 elements while the others gather 4: every rank throws, naming both calls.
  std::string msg = error_of([&] { me == 0 ? all_reduce_sum(a, g) : all_gather(gathered, four, g); });
  EXPECT_HAS(msg, "collective mismatch on group dbg");
  EXPECT_HAS(msg, "all_reduce_sum(f32, 8 elements");
  EXPECT_HAS(msg, "all_gather(f32, 4 elements");
  EXPECT_HAS(msg, "on rank " + std::to_string(me));
  // Same op, different sizes.
  std::vector<float> b(me == P - 1 ? 5 : 8, 1.0f);
  msg = error_of([&] { all_reduce_sum(b, g); });
  EXPECT_HAS(msg, "5 elements");
  EXPECT_HAS(msg, "8 elements");
  // all_to_all_v counts that do not pair up: rank 1 expects 3 elements from rank 0, which sends 2.
  std::vector<int64_t> send(static_cast<size_t>(P), 2), recv(static_cast<size_t>(P), 2);
  if (me == 1) recv[0] = 3;
  std::vector<float> in(static_cast<size_t>(2 * P)), out(static_cast<size_t>(2 * P + (me == 1)));
  msg = error_of([&] { all_to_all_v(out, recv, in, send, g); });
  EXPECT_HAS(msg, "rank 0 (world rank 0) sends 2 elements to rank 1 (world rank 1) but rank 1 expects 3");
  // Nothing was left half-done: the group still works.
  all_reduce_sum(a, g);
  EXPECT_EQ(a[0], static_cast<float>(P));
  comm_set_options(saved);
}

TEST_F(Mpi, TimeoutNamesOpGroupAndRank) {
  const CommOptions saved = comm_options();
  const ProcessGroup g = dup("tmo");
  const int skipper = P - 1;
  if (me != skipper) {
    comm_set_options({.debug = false, .timeout_s = 1.0});
    std::vector<float> buf(4, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    const std::string msg = error_of([&] { all_reduce_sum(buf, g); });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    comm_set_options(saved);
    EXPECT_HAS(msg, "comm: all_reduce_sum on group tmo timed out after 1 s on rank " + std::to_string(g.rank()) +
                        " (world rank " + std::to_string(me) + ")");
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 30.0);  // it did not hang (the bound is loose on purpose: no timing assertions)
    EXPECT_HAS(error_of([&] { barrier(g); }), "unusable after an earlier failure");
  }
  // The skipper went straight on; the world is unaffected.
  barrier(world);
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 30);
}
