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

namespace {
// "tensor cores" when the sm90 path takes the operands (why == null), else "SIMT: why".
[[maybe_unused]] std::string kernel_of(const char* why) {
  return why ? std::string("SIMT: ") + why : "tensor cores";
}
}  // namespace

std::string grouped_gemm_kernel(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_b) {
#ifdef MOECORE_HAVE_CUDA_KERNELS
  return kernel_of(cuda::sm90_grouped_gemm_declines(c, a, b, trans_b));
#else
  return "SIMT: this build has no CUDA kernels";
#endif
}

std::string grouped_wgrad_kernel(const Tensor& c, const Tensor& a, const Tensor& b) {
#ifdef MOECORE_HAVE_CUDA_KERNELS
  return kernel_of(cuda::sm90_grouped_wgrad_declines(c, a, b));
#else
  return "SIMT: this build has no CUDA kernels";
#endif
}

}  // namespace moecore::ops
