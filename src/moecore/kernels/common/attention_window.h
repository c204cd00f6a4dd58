// The visibility rule of causal attention with a sliding window, shared by the CPU (cpu/attention.cpp) and the CUDA
// (cuda/attention.cu) kernels: which keys a query sees and which block ranges can hold a visible pair, so both
// backends skip the same blocks. Positions are key positions (the query i of S sits at Sk - S + i). window < 0: no
// window (every earlier key); window W >= 0: the query at position p sees keys max(0, p - W) .. p (W + 1 keys).
// Not here: the softmax arithmetic (each backend's kernel), sinks (an initial running max and sum).
#pragma once
#include <cstdint>

#include "moecore/kernels/common/hd.h"

namespace moecore::ops::attn_window {

MOECORE_HD_FORCEINLINE bool visible(int64_t p, int64_t k, int64_t window) {
  return k <= p && (window < 0 || k >= p - window);
}
// The first key that the query at position p sees.
MOECORE_HD_FORCEINLINE int64_t first_key(int64_t p, int64_t window) {
  return window < 0 || p <= window ? 0 : p - window;
}
// One past the last query position that sees key k (callers clip to their query range).
MOECORE_HD_FORCEINLINE int64_t end_position(int64_t k, int64_t window, int64_t positions_end) {
  return window < 0 || k + window + 1 > positions_end ? positions_end : k + window + 1;
}
// Whether key k0 lies before the window of the query at position p_last (a block of keys from k0 then needs the
// window mask for its queries up to p_last).
MOECORE_HD_FORCEINLINE bool clips(int64_t p_last, int64_t k0, int64_t window) {
  return window >= 0 && k0 < p_last - window;
}

}  // namespace moecore::ops::attn_window
