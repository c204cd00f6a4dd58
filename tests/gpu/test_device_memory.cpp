// GPU tests (ctest label "gpu"): device memory through the core seam. Each test skips, naming why, when moecore was
// built without CUDA or no GPU can be used (a failure with MOECORE_REQUIRE_GPU=1), so the label is safe to run
// anywhere.
#include <cstring>

#include "gpu/gpu_test.h"
#include "moecore/core/backend_hooks.h"
#include "moecore/core/memory.h"
#include "test_util.h"

namespace moecore {
namespace {

TEST(DeviceMemory, RoundTripThroughTheGpu) {
  SKIP_WITHOUT_GPU();
  const Tensor host = testing::randn({3, 5}, "host");
  Tensor dev = Tensor::empty({3, 5}, DType::f32, MemCategory::other, Device::cuda);
  dev.copy_from(host);
  Tensor back = Tensor::zeros({3, 5}, DType::f32);
  back.copy_from(dev);
  EXPECT_EQ(std::memcmp(back.raw(), host.raw(), static_cast<size_t>(host.nbytes())), 0);
  dev.zero_();
  back.copy_from(dev);
  EXPECT_EQ(back.data<float>()[7], 0.0f);
}

// An allocation past the device's memory fails naming its size and category, the device, what moecore holds and the
// run's memory plan; the pool gives nothing away and the device goes on working.
TEST(DeviceMemory, OutOfMemoryNamesTheAllocationTheDeviceAndThePlan) {
  SKIP_WITHOUT_GPU();
  const Tensor held = Tensor::zeros({1024}, DType::f32, MemCategory::parameters, Device::cuda);
  memory_set_plan("memory plan:\n  parameters       4.0 KiB (a test's plan)\n");
  try {
    Tensor::empty({int64_t{1} << 42}, DType::f32, MemCategory::activations, Device::cuda);  // 16 TiB
    ADD_FAILURE() << "a 16 TiB allocation succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* part : {"out of cuda memory allocating", "of activations", "GiB free", "moecore holds",
                             "parameters", "the memory plan of this run", "a test's plan", "hint:"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " in: " << m;
  }
  memory_set_plan("");
  Tensor after = Tensor::empty({8}, DType::f32, MemCategory::other, Device::cuda);
  after.fill_(2.5f);
  EXPECT_EQ(after.to_device(Device::cpu).data<float>()[7], 2.5f);
}

TEST(DeviceMemory, WithoutAGpuDeviceTensorsFailWithAClearError) {
  if (device_unavailable_reason().empty()) GTEST_SKIP() << "a GPU is present: the no-GPU error path is not reachable";
  try {
    Tensor::empty({4}, DType::f32, MemCategory::other, Device::cuda);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("without CUDA") != std::string::npos || m.find("cuda") != std::string::npos) << m;
  }
}

}  // namespace
}  // namespace moecore
