// Multi-rank tests of comm.h's point-to-point transfers, nonblocking operations and gathers along a dim, run
// under mpirun with 2 and 4 ranks (and again on the simulated device): ring exchanges in both directions,
// every dtype, bitwise equality of the nonblocking reductions with the blocking ones, handles completed out
// of order, debug-mode mismatches, a send nobody receives, and a handle dropped without wait.
#include <gtest/gtest.h>

#include "mpi_test_support.h"

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/comm.h"
#include "test_util.h"

namespace moecore {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

Device test_device() {
  const char* v = std::getenv("MOECORE_TEST_DEVICE");
  return v && *v ? parse_device(v) : Device::cpu;
}

class P2P : public testing_mpi::MpiTest {
 protected:
  ProcessGroup dup(const std::string& name) const { return group_split(world, name, {world.ranks()}); }
  Device dev = test_device();
  // A tensor on the test device holding `values` (f32), and the host copy of any tensor.
  Tensor on_dev(const Tensor& host) const { return host.to_device(dev); }
};

using testing::mix;

// Exact f32 values over many magnitudes, so the summation order changes the rounding.
float contribution(int rank, int64_t i) {
  const uint64_t h = mix(static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(i));
  const auto mantissa = static_cast<int64_t>(h >> 40) - (int64_t{1} << 23);
  return std::ldexp(static_cast<float>(mantissa), static_cast<int>(h % 40) - 44);
}

Tensor filled(const Shape& shape, int rank, int64_t salt = 0) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = contribution(rank, i + salt);
  return t;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

using testing::error_of;

TEST_F(P2P, RingExchangeInBothDirectionsDoesNotDeadlock) {
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const int64_t n = int64_t{1} << 18;  // 1 MiB of f32: past every eager limit
  for (int rep = 0; rep < 3; ++rep) {
    Tensor to_next = on_dev(filled({n}, me, rep)), to_prev = on_dev(filled({n}, me, rep + 7));
    Tensor from_prev = Tensor::zeros({n}, DType::f32, MemCategory::other, dev);
    Tensor from_next = Tensor::zeros({n}, DType::f32, MemCategory::other, dev);
    // Odd ranks post both receives before any send (blocking calls in that order deadlock). With 2 ranks next is
    // prev: messages between one pair pair up in posting order, so every rank sends to_next before to_prev.
    const std::vector<P2POp> ops = me % 2 == 0 ? std::vector<P2POp>{{P2PKind::send, to_next, next},
                                                                    {P2PKind::recv, from_prev, prev},
                                                                    {P2PKind::send, to_prev, prev},
                                                                    {P2PKind::recv, from_next, next}}
                                               : std::vector<P2POp>{{P2PKind::recv, from_prev, prev},
                                                                    {P2PKind::recv, from_next, next},
                                                                    {P2PKind::send, to_next, next},
                                                                    {P2PKind::send, to_prev, prev}};
    batch_send_recv(ops, world);
    EXPECT_TRUE(bitwise_equal(testing::host(from_prev), filled({n}, prev, rep)));
    EXPECT_TRUE(bitwise_equal(testing::host(from_next), filled({n}, next, rep + 7)));
  }
}

TEST_F(P2P, SendRecvEveryDtype) {
  for (const DType t : {DType::f32, DType::f64, DType::i64, DType::i32, DType::bf16, DType::f16, DType::f8e4m3,
                        DType::f8e5m2, DType::boolean}) {
    const int64_t n = 37;
    const auto bytes = static_cast<size_t>(n * static_cast<int64_t>(dtype_size(t)));
    std::vector<uint8_t> pattern(bytes);
    for (size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<uint8_t>(i * 7 + static_cast<size_t>(t));
    if (t == DType::boolean)
      for (auto& b : pattern) b &= 1;
    for (int r = 1; r < P; ++r) {
      if (me == 0) {
        Tensor s = Tensor::empty({n}, t);
        std::memcpy(s.raw(), pattern.data(), bytes);
        send(on_dev(s), r, world);
      } else if (me == r) {
        Tensor got = Tensor::zeros({n}, t, MemCategory::other, dev);
        recv(got, 0, world);
        EXPECT_EQ(std::memcmp(testing::host(got).raw(), pattern.data(), bytes), 0) << dtype_name(t);
      }
    }
  }
  // Span forms: every rank sends its rank to rank 0, which receives them in rank order.
  if (me == 0) {
    for (int r = 1; r < P; ++r) {
      std::vector<int64_t> v(3, -1);
      recv(std::span<int64_t>(v), r, world);
      EXPECT_EQ(v, std::vector<int64_t>(3, r));
    }
  } else {
    const std::vector<int64_t> v(3, me);
    send(std::span<const int64_t>(v), 0, world);
  }
}

// Naive reference: out[.., r·m + j, ..] = in_r[.., j, ..].
TEST_F(P2P, GatherAndReduceScatterAlongDims) {
  const Shape shape = {2, 3, 4};
  for (int dim : {1, 2, -1, 0}) {
    const int d = dim < 0 ? dim + 3 : dim;
    Shape big = shape;
    big[d] *= P;
    Tensor in = filled(shape, me), out = Tensor::zeros(big, DType::f32, MemCategory::other, dev);
    all_gather_into(out, on_dev(in), dim, world);
    const Tensor got = testing::host(out);
    for (int r = 0; r < P; ++r) {
      const Tensor ref = filled(shape, r);
      for (int64_t a = 0; a < 2; ++a)
        for (int64_t b = 0; b < 3; ++b)
          for (int64_t c = 0; c < 4; ++c) {
            int64_t idx[3] = {a, b, c};
            idx[d] += r * shape[d];
            const int64_t at = (idx[0] * big[1] + idx[1]) * big[2] + idx[2];
            ASSERT_EQ(got.data<float>()[at], ref.data<float>()[(a * 3 + b) * 4 + c]) << "dim " << dim << " rank " << r;
          }
    }
    // reduce_scatter_from: out_r[.., j, ..] = Σ_q in_q[.., r·m + j, ..] in rank order, bitwise.
    Tensor rs_out = Tensor::zeros(shape, DType::f32, MemCategory::other, dev);
    reduce_scatter_from(rs_out, on_dev(filled(big, me, 100)), dim, world);
    const Tensor rs = testing::host(rs_out);
    for (int64_t a = 0; a < 2; ++a)
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t c = 0; c < 4; ++c) {
          int64_t idx[3] = {a, b, c};
          idx[d] += me * shape[d];
          const int64_t at = (idx[0] * big[1] + idx[1]) * big[2] + idx[2];
          float want = contribution(0, at + 100);
          for (int q = 1; q < P; ++q) want += contribution(q, at + 100);
          ASSERT_EQ(std::bit_cast<uint32_t>(rs.data<float>()[(a * 3 + b) * 4 + c]), std::bit_cast<uint32_t>(want));
        }
  }
}

TEST_F(P2P, AsyncReductionsAreBitwiseTheBlockingOnes) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{P - 1}, int64_t{1000}, int64_t{4099}}) {
    const Tensor x = filled({n}, me);
    Tensor blocking = on_dev(x), async = on_dev(x);
    all_reduce_sum(blocking, world);
    CommHandle h = all_reduce_sum_async(async, world);
    h.wait();
    EXPECT_TRUE(bitwise_equal(testing::host(blocking), testing::host(async))) << n;

    const Tensor big = filled({n * P}, me, 5);
    Tensor rs_b = Tensor::zeros({n}, DType::f32, MemCategory::other, dev);
    Tensor rs_a = Tensor::zeros({n}, DType::f32, MemCategory::other, dev);
    reduce_scatter_sum(rs_b, on_dev(big), world);
    CommHandle h2 = reduce_scatter_sum_async(rs_a, on_dev(big), world);  // the handle keeps the input alive
    h2.wait();
    EXPECT_TRUE(bitwise_equal(testing::host(rs_b), testing::host(rs_a))) << n;

    Tensor ag_b = Tensor::zeros({n * P}, DType::f32, MemCategory::other, dev);
    Tensor ag_a = Tensor::zeros({n * P}, DType::f32, MemCategory::other, dev);
    all_gather(ag_b, on_dev(x), world);
    CommHandle h3 = all_gather_async(ag_a, on_dev(x), world);
    while (!h3.test()) {
    }
    EXPECT_TRUE(bitwise_equal(testing::host(ag_b), testing::host(ag_a))) << n;
  }
}

// The progress thread completes nonblocking operations while the caller makes no comm call at all (computing): an
// all-reduce and a ring exchange posted, then only completed() -- which advances nothing -- is polled, with naps;
// the results equal the blocking ones. Without the thread (MOECORE_COMM_PROGRESS_THREAD=0) they would never finish.
TEST_F(P2P, ProgressThreadCompletesOperationsBetweenCommCalls) {
  ASSERT_TRUE(comm_progress_thread_running()) << "MPI did not grant MPI_THREAD_SERIALIZED";
  const int64_t n = 1 << 20;  // 4 MB: many fragments, several phases
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  Tensor sum = on_dev(filled({n}, me)), ref = on_dev(filled({n}, me));
  Tensor got = Tensor::zeros({n}, DType::f32, MemCategory::other, dev);
  std::vector<CommHandle> handles;
  handles.push_back(all_reduce_sum_async(sum, world));
  handles.push_back(irecv(got, prev, world));
  handles.push_back(isend(on_dev(filled({n}, me, 9)), next, world));
  for (const CommHandle& h : handles) {
    for (int i = 0; i < 30000 && !h.completed(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_TRUE(h.completed()) << "not completed after 30 s without comm calls";
  }
  for (CommHandle& h : handles) h.wait();
  all_reduce_sum(ref, world);
  EXPECT_TRUE(bitwise_equal(testing::host(sum), testing::host(ref)));
  EXPECT_TRUE(bitwise_equal(testing::host(got), filled({n}, prev, 9)));
}

TEST_F(P2P, HandlesInFlightCompleteInAnyOrder) {
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const int64_t n = 5000;
  std::vector<Tensor> bufs, refs;
  std::vector<CommHandle> handles;
  for (int k = 0; k < 3; ++k) {
    bufs.push_back(on_dev(filled({n}, me, 1000 * k)));
    refs.push_back(on_dev(filled({n}, me, 1000 * k)));
    handles.push_back(all_reduce_sum_async(bufs.back(), world));
  }
  Tensor got = Tensor::zeros({n}, DType::f32, MemCategory::other, dev);
  handles.push_back(irecv(got, prev, world));
  handles.push_back(isend(on_dev(filled({n}, me, 77)), next, world));
  // Even ranks wait last-to-first, odd ranks first-to-last: each wait must let the others progress.
  if (me % 2 == 0) std::reverse(handles.begin(), handles.end());
  for (CommHandle& h : handles) h.wait();
  for (int k = 0; k < 3; ++k) {
    all_reduce_sum(refs[static_cast<size_t>(k)], world);
    EXPECT_TRUE(bitwise_equal(testing::host(bufs[static_cast<size_t>(k)]), testing::host(refs[static_cast<size_t>(k)])))
        << k;
  }
  EXPECT_TRUE(bitwise_equal(testing::host(got), filled({n}, prev, 77)));
}

TEST_F(P2P, DebugModeNamesMismatchedTransfersOnBothRanks) {
  const CommOptions saved = comm_options();
  comm_set_options({.debug = true, .timeout_s = 20});
  const ProcessGroup g = dup("p2pdbg");
  // Rank 0 sends 8 f32 to rank 1, which receives 5: both throw, naming both sides; nothing moved.
  if (me == 0) {
    const std::string msg = error_of([&] { send(Tensor::zeros({8}, DType::f32, MemCategory::other, dev), 1, g); });
    EXPECT_HAS(msg, "point-to-point mismatch on group p2pdbg seen on rank 0");
    EXPECT_HAS(msg, "rank 0 (world rank 0) sends 8 f32 elements to rank 1 (world rank 1)");
    EXPECT_HAS(msg, "but rank 1 receives 5 f32 elements");
  } else if (me == 1) {
    const std::string msg = error_of([&] { recv(Tensor::zeros({5}, DType::f32, MemCategory::other, dev), 0, g); });
    EXPECT_HAS(msg, "point-to-point mismatch on group p2pdbg seen on rank 1");
    EXPECT_HAS(msg, "sends 8 f32 elements to rank 1 (world rank 1)");
    EXPECT_HAS(msg, "but rank 1 receives 5 f32 elements");
  }
  // A dtype mismatch in a batch.
  if (me < 2) {
    Tensor t = Tensor::zeros({4}, me == 0 ? DType::f32 : DType::i32, MemCategory::other, dev);
    const std::vector<P2POp> ops = {{me == 0 ? P2PKind::send : P2PKind::recv, t, 1 - me}};
    EXPECT_HAS(error_of([&] { batch_send_recv(ops, g); }), "sends 4 f32 elements");
  }
  // The nonblocking collectives are checked when posted.
  Tensor a = Tensor::zeros({me == P - 1 ? 5 : 8}, DType::f32, MemCategory::other, dev);
  const std::string msg = error_of([&] { all_reduce_sum_async(a, g).wait(); });
  EXPECT_HAS(msg, "collective mismatch on group p2pdbg");
  EXPECT_HAS(msg, "all_reduce_sum_async(f32, 5 elements");
  EXPECT_HAS(msg, "all_reduce_sum_async(f32, 8 elements");
  // Nothing was left half-done: the group still works, for transfers and collectives.
  if (me < 2) {
    Tensor t = on_dev(filled({6}, me));
    Tensor got = Tensor::zeros({6}, DType::f32, MemCategory::other, dev);
    batch_send_recv(std::vector<P2POp>{{P2PKind::send, t, 1 - me}, {P2PKind::recv, got, 1 - me}}, g);
    EXPECT_TRUE(bitwise_equal(testing::host(got), filled({6}, 1 - me)));
  }
  Tensor ones = on_dev(filled({3}, 0));
  all_reduce_sum_async(ones, g).wait();
  comm_set_options(saved);
}

TEST_F(P2P, SendNobodyReceivesTimesOut) {
  const CommOptions saved = comm_options();
  const ProcessGroup g = dup("p2ptmo");
  const std::vector<float> payload(16, 1.5f);
  if (me == 0) {
    comm_set_options({.debug = saved.debug, .timeout_s = 1.0});  // every rank keeps the same debug mode
    comm_set_phase("p2p timeout test");
    const std::string msg = error_of([&] { send(std::span<const float>(payload), 1, g); });
    comm_set_phase("");
    comm_set_options(saved);
    EXPECT_HAS(msg, "comm: send to rank 1");
    EXPECT_HAS(msg, "on group p2ptmo timed out after 1 s on rank 0 (world rank 0)");
    EXPECT_HAS(msg, "p2p timeout test");
    EXPECT_HAS(error_of([&] { send(std::span<const float>(payload), 1, g); }), "unusable after an earlier failure");
  }
  barrier(world);
  // Rank 1 takes the message after all, so no transfer outlives the test.
  if (me == 1) {
    std::vector<float> got(16);
    recv(std::span<float>(got), 0, g);
    EXPECT_EQ(got, payload);
  }
  barrier(world);
}

TEST_F(P2P, DroppedHandleIsReported) {
  const ProcessGroup g = dup("drop");
  Tensor buf = on_dev(filled({100}, me));
  { CommHandle h = all_reduce_sum_async(buf, g); }  // never waited for
  const std::string msg = error_of([&] { all_reduce_sum(buf, g); });
  EXPECT_HAS(msg, "unusable after an earlier failure");
  EXPECT_HAS(msg, "CommHandle of all_reduce_sum_async on group drop");
  EXPECT_HAS(msg, "destroyed without wait()");
  barrier(world);  // the dropped operation still completes: no rank is left waiting for it
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 30);
}
