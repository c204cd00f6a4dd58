// GPU test (label "gpu") of MOECORE_CUDA_SYNC=1: a kernel that faults raises at its own launch, naming the kernel,
// its op and the switch, instead of at a later synchronising call under another op's name. A fault leaves the
// process's CUDA context unusable, so ctest runs this test alone in its own process with the variable set
// (CudaSync.*.sync); in the plain run of test_cuda_ops it skips.
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_util.h"

namespace moecore {
namespace {

TEST(CudaSync, AFaultingKernelRaisesAtItsOwnLaunch) {
  SKIP_WITHOUT_GPU();
  const char* sync = std::getenv("MOECORE_CUDA_SYNC");
  if (!sync || std::string(sync) != "1")
    GTEST_SKIP() << "runs only with MOECORE_CUDA_SYNC=1, alone in its process (ctest's CudaSync.*.sync): the fault "
                    "it provokes leaves the CUDA context unusable";
  // moe_permute copies x's row row_token[0] = INT32_MIN: 2^31 rows of 2^16 f32 before x, far outside any mapping (the
  // host never reads row_token, so the device does).
  const int64_t H = int64_t{1} << 16;
  Tensor row_token = Tensor::empty({1}, DType::i32, MemCategory::other);
  row_token.data<int32_t>()[0] = std::numeric_limits<int32_t>::min();
  Tensor offsets = Tensor::empty({2}, DType::i64, MemCategory::other);
  offsets.data<int64_t>()[0] = 0;
  offsets.data<int64_t>()[1] = 1;
  // Never freed (kept reachable): after the fault every CUDA call fails, and this test ends the process's use of it.
  static auto* t =
      new std::vector<Tensor>{Tensor::empty({1, H}, DType::f32, MemCategory::other, Device::cuda),
                              Tensor::empty({1, H}, DType::f32, MemCategory::other, Device::cuda),
                              row_token.to_device(Device::cuda), offsets.to_device(Device::cuda), Tensor{}};
  std::vector<Tensor>& v = *t;
  // Under CUDA_LAUNCH_BLOCKING=1 the launch itself waits, and the launch check names the kernel before the switch's
  // synchronisation does.
  const char* blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
  const bool launch_blocks = blocking && std::string(blocking) == "1";
  const std::string e =
      testing::error_of([&] { ops::moe_permute(v[0], v[4], v[1], v[4], v[2], v[3], testing_cuda::ctx_of(true)); });
  EXPECT_NE(e.find("moe_permute"), std::string::npos) << e;
  EXPECT_NE(e.find("permute_kernel"), std::string::npos) << e;
  if (!launch_blocks) {
    EXPECT_NE(e.find("MOECORE_CUDA_SYNC=1"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace moecore
