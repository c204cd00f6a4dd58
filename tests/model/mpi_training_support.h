// What the multi-rank training-equivalence programs (mpi_tp_training_test, mpi_pipeline_test) share: the fixture that
// keeps the 8-rank test apart, the relative error, the element-wise comparison of gradients against the single-process
// run's, and a scratch directory every rank agrees on.
#pragma once
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"
#include "moecore/parallel/comm.h"
#include "mpi_test_support.h"

namespace moecore::testing_mpi {

// At 2 and 4 ranks every test but EightRanksMatchOneProcess runs; at 8 ranks only that one.
class EightRanksApartTest : public MpiTest {
 protected:
  void SetUp() override {
    const bool eight =
        std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) == "EightRanksMatchOneProcess";
    if (eight != (P == 8)) GTEST_SKIP() << (eight ? "needs 8 ranks" : "runs at 2 and 4 ranks");
  }
};

inline double rel(double a, double b) {
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

// Every tensor of `got` against the one of the same name in `ref` (host f32, whole tensors). Row-parallel GEMMs split
// the reduction over ranks (partial sums added in rank order): the same terms summed in another order, hence the
// absolute floor for near-zero entries; and 1e-9 for gradients that vanish in exact arithmetic (the key-norm bias:
// softmax ignores a shift shared by every key), whose values are rounding noise of ~1e-10 in either run.
// rtol and floor (times the tensor's largest value) loosen it for runs that differ by more than the layout's
// reduction order (Megatron-FSDP's per-micro-batch reductions over 20 Adam steps).
inline void expect_close(const std::map<std::string, Tensor>& got, const std::map<std::string, Tensor>& ref,
                         double rtol = 1e-5, double floor = 1e-6) {
  for (const auto& [name, g] : got) {
    ASSERT_TRUE(ref.count(name)) << name;
    const Tensor& r = ref.at(name);
    ASSERT_TRUE(g.shape() == r.shape()) << name << ": " << g.str() << " vs " << r.str();
    const float* a = g.data<float>();
    const float* b = r.data<float>();
    double maxref = 0;
    for (int64_t i = 0; i < r.numel(); ++i) maxref = std::max(maxref, std::fabs(static_cast<double>(b[i])));
    for (int64_t i = 0; i < r.numel(); ++i)
      ASSERT_NEAR(a[i], b[i], rtol * std::fabs(b[i]) + floor * maxref + 1e-9) << name << " element " << i;
  }
}

// /tmp/<prefix><rank 0's pid>_<what>: the same path on every rank (collective over world).
inline std::string shared_dir(const ProcessGroup& world, const std::string& prefix, const std::string& what) {
  std::vector<int64_t> pid = {world.rank() == 0 ? static_cast<int64_t>(::getpid()) : 0};
  broadcast(std::span<int64_t>(pid), 0, world);
  const std::string dir = "/tmp/" + prefix + std::to_string(pid[0]) + "_" + what;
  barrier(world);
  return dir;
}

}  // namespace moecore::testing_mpi
