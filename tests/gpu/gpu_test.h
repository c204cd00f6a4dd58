// The switches every GPU test shares (tests/gpu/, tests/test_cuda_*.cpp): SKIP_WITHOUT_GPU() skips a test when no
// CUDA device can be used, naming why (device_unavailable_reason: the build, the runtime's answer, the /dev/nvidia*
// nodes), and fails it instead under MOECORE_REQUIRE_GPU=1, so a GPU run that cannot reach its device is red, not
// green. Device-parameterised tests run on gpu_test_device(): cuda, or the simulated device for their ".sim" twin.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/env.h"
#include "moecore/core/tensor.h"

namespace moecore::testing {

// What SKIP_WITHOUT_GPU does: nothing (a device is there), skip, or fail; `message` says why.
struct GpuGate {
  bool skip = false, fail = false;
  std::string message;
};
// MOECORE_REQUIRE_GPU, a switch (core/env.h): on makes a missing device a failure; unset or off a skip; anything
// else fails naming it.
inline GpuGate gpu_gate() {
  bool require = false;
  try {
    require = env_switch("MOECORE_REQUIRE_GPU", false, "a missing GPU fails");
  } catch (const Error& e) {
    return {false, true, e.what()};
  }
  const std::string why = device_unavailable_reason();
  if (why.empty()) return {};
  if (require) return {false, true, "MOECORE_REQUIRE_GPU=1, but no CUDA device can be used: " + why};
  return {true, false,
          "GPU test skipped, no CUDA device can be used: " + why + " (MOECORE_REQUIRE_GPU=1 fails instead)"};
}

// The device of a device-parameterised GPU test: cuda; sim with MOECORE_TEST_DEVICE=sim (ctest's ".sim" twin,
// label "sim": the simulated device runs the CPU kernels, so the twin runs anywhere and matches the CPU bit for bit).
// Any other value of the variable (the other floors' cpu) leaves cuda.
inline Device gpu_test_device() {
  const char* v = std::getenv("MOECORE_TEST_DEVICE");
  return v && std::string(v) == "sim" ? Device::sim : Device::cuda;
}

}  // namespace moecore::testing

// At the start of a GPU test: skip (or, with MOECORE_REQUIRE_GPU=1, fail) naming what is missing.
#define SKIP_WITHOUT_GPU()                                                            \
  do {                                                                                \
    const ::moecore::testing::GpuGate moecore_gate_ = ::moecore::testing::gpu_gate(); \
    if (moecore_gate_.fail) FAIL() << moecore_gate_.message;                          \
    if (moecore_gate_.skip) GTEST_SKIP() << moecore_gate_.message;                    \
  } while (0)

// SKIP_WITHOUT_GPU() unless the test runs on the simulated device (gpu_test_device()).
#define SKIP_WITHOUT_GPU_TEST_DEVICE()                                                       \
  do {                                                                                       \
    if (::moecore::testing::gpu_test_device() != ::moecore::Device::sim) SKIP_WITHOUT_GPU(); \
  } while (0)
