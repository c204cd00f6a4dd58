// The dropout mask's host arithmetic, shared by the CPU backend (cpu/dropout_mask.h) and the CUDA backend
// (cuda/cuda_util.cu's device_mask): philox_uniform's map from a Philox word to (0, 1) (core/rng.cpp), and the keep
// threshold and scale of a probability p. A word w keeps its element iff w >= threshold, which is
// philox_uniform(key, i) >= p. Not here: the Philox rounds (each backend's own, vectorised on the CPU).
#pragma once
#include <algorithm>
#include <cstdint>

namespace moecore::ops::dropout {

// philox_uniform's map from a 32-bit word to (0, 1).
inline float word_to_uniform(uint32_t w) {
  return std::min(static_cast<float>((static_cast<double>(w) + 0.5) * 0x1p-32), 0x1.fffffep-1f);
}

// The least word whose uniform is >= p, for p in [0, 1). The map is monotone, and its largest value, 0x1.fffffep-1,
// is >= any p < 1, so the search always ends on a word.
inline uint32_t keep_threshold(float p) {
  uint32_t lo = 0, hi = 0xFFFFFFFFu;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (word_to_uniform(mid) >= p)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// The factor of a kept element.
inline float keep_scale(float p) {
  return 1.0f / (1.0f - p);
}

}  // namespace moecore::ops::dropout
