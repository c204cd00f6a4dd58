#include "apps/device_flag.h"

#include <string>

#include "moecore/core/backend_hooks.h"
#include "moecore/kernels/ops.h"

namespace moecore::apps {

Device device_from_flag(const Args& a, int world_size) {
  const Device d = parse_device(a.str("--device"));
  if (d != Device::cuda) return d;
  if (!ops::cuda_kernels_built())
    MOECORE_FAIL(
        "--device cuda: this build has no CUDA kernels (configure with -DMOECORE_CUDA=ON on a machine with "
        "nvcc); use --device cpu");
  if (const std::string why = device_unavailable_reason(); !why.empty())
    MOECORE_FAIL("--device cuda: no CUDA device is visible to this process: ", why, "; use --device cpu");
  if (const std::string why = ops::cuda_libraries_unavailable_reason(); !why.empty())
    MOECORE_FAIL("--device cuda: ", why, "; use --device cpu");
  if (world_size > 1)
    MOECORE_FAIL("--device cuda with ", world_size,
                 " processes: multi-process runs on the GPU need the NCCL backend, not built yet (MPI moves host "
                 "memory only); run one process, or use --device cpu");
  return d;
}

}  // namespace moecore::apps
