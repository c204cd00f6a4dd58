// The row chunks of the norms' parameter gradients, shared by the CPU kernels (cpu/norms.cpp) and the CUDA kernels
// (cuda/norms.cu): dw and db are reduced over N through per-chunk partials, with chunk boundaries fixed by N alone,
// so both backends (and any thread count) sum the same rows in the same order.
#pragma once
#include <cstdint>

#include "moecore/kernels/common/hd.h"

namespace moecore::ops {

// Rows [chunk * rows_per, ...) form chunk `chunk`; at most 128 chunks keep the partials small.
struct RowChunks {
  int64_t count = 0, rows_per = 1;
  MOECORE_HD explicit RowChunks(int64_t N) {
    count = (N + 7) / 8 < 128 ? (N + 7) / 8 : 128;
    rows_per = count ? (N + count - 1) / count : 1;
    count = rows_per ? (N + rows_per - 1) / rows_per : 0;
  }
};

}  // namespace moecore::ops
