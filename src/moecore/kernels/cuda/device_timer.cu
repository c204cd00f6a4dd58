// The CUDA side of DeviceTimer (kernels/device_timer.h): events on the legacy default stream, where every op runs.
// Every call is checked; an asynchronous fault of earlier work surfaces here, named by the call that saw it.
#include <cuda_runtime.h>

#include "moecore/core/error.h"
#include "moecore/kernels/device_timer.h"

namespace moecore::ops::timer_seam {
namespace {
void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess)
    MOECORE_FAIL("device timer (cuda): ", call, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e),
                 " (an error of earlier work on the device also surfaces here; run with CUDA_LAUNCH_BLOCKING=1 to "
                 "name it)");
}
}  // namespace

void* cuda_event_create() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreate(&e), "cudaEventCreate");
  return e;
}

void cuda_event_destroy(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));  // unchecked: called from destructors
}

void cuda_event_record(void* event) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), nullptr), "cudaEventRecord");
}

float cuda_event_elapsed_ms(void* from, void* to) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(to)), "cudaEventSynchronize");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)),
        "cudaEventElapsedTime");
  return ms;
}

void cuda_device_synchronize() {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace moecore::ops::timer_seam
