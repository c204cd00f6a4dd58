// Which backends this build of the kernels library holds (ops.h: cuda_kernels_built).
#include "moecore/kernels/cpu/cpu_util.h"
#ifdef MOECORE_HAVE_CUDA_KERNELS
#include "moecore/kernels/cuda/ops_cuda.h"
#endif

namespace moecore::ops {

bool cuda_kernels_built() {
  return cpu::kCudaKernels;
}

std::string cuda_libraries_unavailable_reason() {
#ifdef MOECORE_HAVE_CUDA_KERNELS
  return cuda::cublas_unavailable_reason();
#else
  return "this build has no CUDA kernels (configure with -DMOECORE_CUDA=ON on a machine with nvcc)";
#endif
}

}  // namespace moecore::ops
