// The CUDA side of DeviceTimer (kernels/device_timer.h) in builds without the CUDA kernels: every entry point raises
// naming the missing build option (kernels/cuda/device_timer.cu replaces this file when MOECORE_HAVE_CUDA_KERNELS is
// defined for the kernels library). cpu and sim timers never reach it.
#ifndef MOECORE_HAVE_CUDA_KERNELS
#include <string>

#include "moecore/core/error.h"
#include "moecore/kernels/device_timer.h"

namespace moecore::ops::timer_seam {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  MOECORE_FAIL("device timer: ", what,
               " needs the CUDA kernels, and this build has none (configure with -DMOECORE_CUDA=ON on a machine with "
               "nvcc)");
}
}  // namespace

void* cuda_event_create() {
  no_cuda("a cuda event");
}
void cuda_event_destroy(void*) {}
void cuda_event_record(void*) {
  no_cuda("recording a cuda event");
}
float cuda_event_elapsed_ms(void*, void*) {
  no_cuda("timing cuda events");
}
void cuda_device_synchronize() {
  no_cuda("cudaDeviceSynchronize");
}

}  // namespace moecore::ops::timer_seam
#endif
