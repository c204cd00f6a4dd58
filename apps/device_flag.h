// --device of the commands that run ops (train, bench): cpu | cuda | sim, and cuda's start-up check. One check for
// every command, so `moecore train` and `moecore bench` refuse a missing GPU with the same message.
#pragma once
#include "apps/args.h"
#include "moecore/core/tensor.h"

namespace moecore::apps {

// The device named by a's --device flag. cpu and sim need nothing. cuda is checked before any work: the build must
// have the CUDA kernels (-DMOECORE_CUDA=ON), a CUDA device must be visible to this process (the runtime's answer and
// where the driver was looked for are named), cuBLAS must load (where it was looked for is named), and, until the NCCL
// backend exists, the run must be one process (the MPI backend moves host memory only). Each failure raises Error
// starting "--device cuda" and ending with the hint "use --device cpu".
Device device_from_flag(const Args& a, int world_size = 1);

}  // namespace moecore::apps
