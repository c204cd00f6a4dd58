// Point-to-point transfers, nonblocking operations and gathers along a dim on size-1 groups (comm_single),
// which never touch a backend and so run identically in MPI and local builds: copies, the mailbox that pairs
// a group's transfers to itself, the argument errors, and a handle dropped without wait.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/comm.h"
#include "test_util.h"

namespace moecore {
namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

using testing::error_of;

Tensor iota(const Shape& shape, Device device = Device::cpu) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(i) + 0.5f;
  return t.to_device(device);
}

std::vector<float> values(const Tensor& t) {
  const Tensor h = t.to_device(Device::cpu);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

TEST(CommSingleP2P, TransfersToItselfPairInOrder) {
  for (const Device dev : {Device::cpu, Device::sim}) {
    const ProcessGroup g = comm_single("solo");
    const Tensor a = iota({4}, dev), b = iota({2, 3}, dev);
    Tensor ra = Tensor::zeros({4}, DType::f32, MemCategory::other, dev);
    Tensor rb = Tensor::zeros({2, 3}, DType::f32, MemCategory::other, dev);
    // Receive first, send second: the k-th send pairs with the k-th recv.
    CommHandle h1 = irecv(ra, 0, g), h2 = irecv(rb, 0, g);
    EXPECT_FALSE(h1.test());
    CommHandle h3 = isend(a, 0, g), h4 = isend(b, 0, g);
    h4.wait();
    h1.wait();
    EXPECT_TRUE(h3.test());
    h2.wait();
    EXPECT_EQ(values(ra), values(a));
    EXPECT_EQ(values(rb), values(b));
    // A batch posts all of its transfers before completing any.
    Tensor rc = Tensor::zeros({4}, DType::f32, MemCategory::other, dev);
    batch_send_recv(std::vector<P2POp>{{P2PKind::recv, rc, 0}, {P2PKind::send, a, 0}}, g);
    EXPECT_EQ(values(rc), values(a));
    // Span forms can only pair through an earlier nonblocking post.
    std::vector<float> s = {1, 2}, r(2);
    CommHandle h5 = isend(iota({2}), 0, g);
    recv(std::span<float>(r), 0, g);
    h5.wait();
    EXPECT_EQ(r, (std::vector<float>{0.5f, 1.5f}));
    EXPECT_HAS(error_of([&] { send(std::span<const float>(s), 0, g); }), "can never complete");
    CommHandle moved = std::move(h5);  // an empty handle: nothing to report
    moved.wait();
  }
}

TEST(CommSingleP2P, NonblockingCollectivesAreCopies) {
  const ProcessGroup g = comm_single("solo");
  Tensor buf = iota({5});
  all_reduce_sum_async(buf, g).wait();
  EXPECT_EQ(values(buf), values(iota({5})));
  Tensor out = Tensor::zeros({2, 3}, DType::f32, MemCategory::other, Device::sim);
  CommHandle h = all_gather_async(out, iota({2, 3}, Device::sim), g);
  EXPECT_TRUE(h.test());
  EXPECT_EQ(values(out), values(iota({2, 3})));
  Tensor rs = Tensor::zeros({6}, DType::f32);
  reduce_scatter_sum_async(rs, iota({6}), g).wait();
  EXPECT_EQ(values(rs), values(iota({6})));
  Tensor gi = Tensor::zeros({2, 3}, DType::f32);
  all_gather_into(gi, iota({2, 3}), 1, g);
  EXPECT_EQ(values(gi), values(iota({2, 3})));
  Tensor ro = Tensor::zeros({2, 3, 4}, DType::f32, MemCategory::other, Device::sim);
  reduce_scatter_from(ro, iota({2, 3, 4}, Device::sim), -1, g);
  EXPECT_EQ(values(ro), values(iota({2, 3, 4})));
}

TEST(CommSingleP2P, ArgumentErrors) {
  const ProcessGroup g = comm_single("solo");
  const Tensor t = iota({4});
  EXPECT_HAS(error_of([&] { send(t, 1, g); }), "destination 1 is not a rank of the group (0 .. 0)");
  EXPECT_HAS(error_of([&] { irecv(t, -1, g).wait(); }), "source -1 is not a rank of the group");
  EXPECT_HAS(error_of([&] { send(t, 0, ProcessGroup()); }), "default-constructed");
  EXPECT_HAS(error_of([&] { isend(iota({4, 2}).slice(1, 0, 1), 0, g).wait(); }), "is not contiguous");
  Tensor r3 = Tensor::zeros({3}, DType::f32);
  EXPECT_HAS(error_of([&] {
               batch_send_recv(std::vector<P2POp>{{P2PKind::send, t, 0}, {P2PKind::recv, r3, 0}}, g);
             }),
             "message #0 to itself has 4 f32 elements but its recv expects 3 f32");
  Tensor half = Tensor::zeros({2}, DType::f16);
  EXPECT_HAS(error_of([&] { all_reduce_sum_async(half, g).wait(); }), "dtype f16 cannot be reduced");
  EXPECT_HAS(error_of([&] { all_gather_async(Tensor::zeros({3}, DType::f32), t, g).wait(); }),
             "must hold group size × input = 1 × 4");
  EXPECT_HAS(error_of([&] {
               all_gather_into(Tensor::zeros({2, 4}, DType::f32), iota({2, 3}), 1, g);
             }),
             "the output tensor [2, 4] f32 must be the input tensor [2, 3] f32 with dim 1 multiplied by the group "
             "size 1");
  EXPECT_HAS(error_of([&] {
               reduce_scatter_from(Tensor::zeros({2, 3}, DType::f32), iota({2, 3}), 2, g);
             }),
             "dim 2 is out of range for the output tensor [2, 3] f32");
  EXPECT_HAS(error_of([&] { all_gather_into(t, t, 0, g); }), "overlap");
  // None of these broke the group.
  Tensor ok = iota({4});
  all_reduce_sum_async(ok, g).wait();
}

TEST(CommSingleP2P, DroppedHandleMakesTheGroupUnusable) {
  const ProcessGroup g = comm_single("dropped");
  Tensor buf = iota({3});
  { CommHandle h = all_reduce_sum_async(buf, g); }
  const std::string msg = error_of([&] { all_reduce_sum(buf, g); });
  EXPECT_HAS(msg, "unusable after an earlier failure");
  EXPECT_HAS(msg, "the CommHandle of all_reduce_sum_async on group dropped (call #1) on rank 0");
  EXPECT_HAS(msg, "destroyed without wait()");
  const ProcessGroup g2 = comm_single("reassigned");
  Tensor r = Tensor::zeros({3}, DType::f32);
  CommHandle h = irecv(r, 0, g2);
  h = CommHandle();  // assigning over a pending handle drops it too
  EXPECT_HAS(error_of([&] { send(buf, 0, g2); }), "CommHandle of irecv from rank 0 on group reassigned");
}

// Issue 27, defect 7: MOECORE_COMM_TIMEOUT_S=-5 switched the collective timeout off (and overrode
// --distributed-timeout-minutes), so a stopped rank hung the job; the comm variables are now checked like flags.
TEST(CommOptions, EnvironmentIsCheckedLikeAFlag) {
  struct Restore {
    ~Restore() {
      for (const char* n : {"MOECORE_COMM_TIMEOUT_S", "MOECORE_COMM_DEBUG", "MOECORE_COMM_PROGRESS_THREAD"})
        unsetenv(n);
    }
  } restore;
  for (const char* bad : {"-5", "-1e-9", "nan", "inf", "1e999", "1e8", "ten", ""}) {
    setenv("MOECORE_COMM_TIMEOUT_S", bad, 1);
    const std::string msg = error_of([] { (void)comm_options_from_env(); });
    EXPECT_HAS(msg, "MOECORE_COMM_TIMEOUT_S='" + std::string(bad) + "'");
    EXPECT_HAS(msg, "[0, 60000000]");
    EXPECT_HAS(error_of([] { (void)comm_timeout_from_env(); }), "MOECORE_COMM_TIMEOUT_S");
  }
  setenv("MOECORE_COMM_TIMEOUT_S", "0", 1);  // documented: waits forever
  EXPECT_EQ(comm_options_from_env().timeout_s, 0.0);
  EXPECT_EQ(comm_timeout_from_env(), 0.0);
  setenv("MOECORE_COMM_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(comm_options_from_env().timeout_s, 2.5);
  unsetenv("MOECORE_COMM_TIMEOUT_S");
  EXPECT_FALSE(comm_timeout_from_env().has_value());
  EXPECT_EQ(comm_options_from_env().timeout_s, 600.0);
  setenv("MOECORE_COMM_PROGRESS_THREAD", "off", 1);
  EXPECT_FALSE(comm_options_from_env().progress_thread);
  setenv("MOECORE_COMM_PROGRESS_THREAD", "2", 1);  // was: anything but "0" turned it on
  EXPECT_HAS(error_of([] { (void)comm_options_from_env(); }), "MOECORE_COMM_PROGRESS_THREAD='2'");
  unsetenv("MOECORE_COMM_PROGRESS_THREAD");
  EXPECT_TRUE(comm_options_from_env().progress_thread);
  setenv("MOECORE_COMM_DEBUG", "maybe", 1);
  EXPECT_HAS(error_of([] { (void)comm_options_from_env(); }), "MOECORE_COMM_DEBUG='maybe'");
}

}  // namespace
}  // namespace moecore
