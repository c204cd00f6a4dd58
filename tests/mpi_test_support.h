// Shared harness of the multi-rank test programs (tests/<floor>/mpi_*.cpp, run under mpirun): the fixture
// whose TearDown fails every rank when any rank failed (so rank 0's report is the whole story), a printer
// that lets the other ranks report only their own failures, prefixed with the rank, and the main that starts
// MPI with a short timeout (a failing test must not hang) and turns every rank's result into one exit code.
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <string>
#include <vector>

#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/parallel/comm.h"

namespace moecore::testing_mpi {

// Iteration `it` of checkpoint root `got` holds exactly the files of root `want`'s, byte for byte (an asynchronous
// save against a synchronous one). Returns the number of files.
inline size_t expect_same_checkpoint_files(const std::string& got, const std::string& want, int64_t it) {
  const std::string a = io::checkpoint_iteration_dir(got, it), s = io::checkpoint_iteration_dir(want, it);
  size_t files = 0;
  for (const auto& de : std::filesystem::directory_iterator(s)) {
    const std::string name = de.path().filename().string();
    EXPECT_EQ(io::read_file(a + "/" + name), io::read_file(s + "/" + name)) << "iteration " << it << ": " << name;
    ++files;
  }
  EXPECT_EQ(files, static_cast<size_t>(std::distance(std::filesystem::directory_iterator(a), {}))) << it;
  return files;
}

class MpiTest : public ::testing::Test {
 protected:
  ProcessGroup world = comm_world();
  int P = world.size();
  int me = world.rank();
  void TearDown() override {
    std::vector<int64_t> failed = {HasFailure() ? int64_t{1} << world.rank() : 0};
    all_reduce_sum(failed, world);
    if (failed[0] && !HasFailure()) ADD_FAILURE() << "failed on other ranks (bit mask " << failed[0] << ")";
  }
};

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

// timeout_s applies unless MOECORE_COMM_TIMEOUT_S is set; debug turns on the cross-rank op matching.
inline int run_mpi_tests(int argc, char** argv, double timeout_s, bool debug = false) {
  CommOptions options = comm_options_from_env();
  if (!comm_timeout_from_env()) options.timeout_s = timeout_s;
  options.debug = options.debug || debug;
  comm_init(argc, argv, options);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = 0;
  {
    const ProcessGroup world = comm_world();
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (world.rank() != 0) {
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(world.rank()));
    }
    std::vector<int64_t> any = {RUN_ALL_TESTS() != 0 ? 1 : 0};
    all_reduce_sum(any, world);
    failed = any[0] != 0;
  }
  comm_finalize();
  return failed;
}

}  // namespace moecore::testing_mpi
