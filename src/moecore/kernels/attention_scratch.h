// The host memory the CPU attention kernels keep between calls (cpu::scratch: f32 copies of K and V for the
// forward, of Q, dout and the per-chunk dQ for the backward), so that the memory plan can count it. Not an op: a
// size query beside ops.h; a cuda context keeps no such copies.
#pragma once
#include <cstdint>

#include "moecore/kernels/ops.h"

namespace moecore::ops {

// Bytes the CPU attention_forward and attention_backward of `dims` hold in their grow-only scratch at the peak: the
// backward's buffer while it replaces the forward's (one buffer, grown in place by reallocation).
int64_t attention_host_scratch_bytes(const QkvDims& dims);

}  // namespace moecore::ops
