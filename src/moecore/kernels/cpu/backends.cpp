// Which backends this build of the kernels library holds (ops.h: cuda_kernels_built).
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {

bool cuda_kernels_built() {
  return cpu::kCudaKernels;
}

}  // namespace moecore::ops
