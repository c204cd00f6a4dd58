// Private helper of the CPU backend: dropout keep factors (0 or 1/(1-p)) for runs of consecutive element
// indices, from an inline copy of Philox-4x32-10 that GCC vectorises across counter blocks. It must agree
// bit for bit with philox_uniform (core/rng.cpp): same counter {block, block >> 32, 1, 0}, same word per
// index, same word-to-float map; tests/kernels/test_dropout.cpp pins that. No tensor code here.
#pragma once
#include <algorithm>
#include <cstdint>

#include "moecore/kernels/common/dropout_mask.h"
#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/cpu_isa.h"

namespace moecore::ops::cpu {

// Philox-4x32-10 of counter blocks b0 .. b0+nb-1 under `key`, vectorised across blocks; the body of both variants
// below (always inlined, so each compiles it for its own instruction set; integer arithmetic: the same bits). The
// AVX-512 variant computes the blocks 1.6x as fast as the AVX2 one (one thread, this machine's Xeon).
[[gnu::always_inline]] inline void philox_blocks(uint32_t* words, const PhiloxKey& key, uint64_t b0, int64_t nb) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  const uint32_t key0 = key[0], key1 = key[1];
#pragma omp simd
  for (int64_t b = 0; b < nb; ++b) {
    const uint64_t block = b0 + static_cast<uint64_t>(b);
    uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32), c2 = 1, c3 = 0;
    uint32_t k0 = key0, k1 = key1;
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
      const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    words[4 * b] = c0;
    words[4 * b + 1] = c1;
    words[4 * b + 2] = c2;
    words[4 * b + 3] = c3;
  }
}
inline void philox_blocks_avx2(uint32_t* words, const PhiloxKey& key, uint64_t b0, int64_t nb) {
  philox_blocks(words, key, b0, nb);
}
MOECORE_TARGET_AVX512 inline void philox_blocks_avx512(uint32_t* words, const PhiloxKey& key, uint64_t b0, int64_t nb) {
  philox_blocks(words, key, b0, nb);
}

class DropoutMask {
 public:
  // p in (0, 1), checked by the caller. The threshold and scale: kernels/common/dropout_mask.h, shared with CUDA.
  explicit DropoutMask(const Dropout& d)
      : key_(d.key), scale_(dropout::keep_scale(d.p)), threshold_(dropout::keep_threshold(d.p)) {}
  float scale() const { return scale_; }

  // f[k] = scale() if element first + k is kept, else 0, for k < n.
  void factors(float* f, uint64_t first, int64_t n) const {
    constexpr int64_t kChunk = 64;  // counter blocks per pass: 256 words on the stack
    alignas(64) uint32_t words[4 * kChunk];
    const uint64_t end = first + static_cast<uint64_t>(n);
    const uint32_t threshold = threshold_;  // locals: member loads under a condition stop vectorisation
    const float scale = scale_;
    for (uint64_t b0 = first / 4; b0 * 4 < end; b0 += kChunk) {
      const int64_t nb = static_cast<int64_t>(std::min<uint64_t>(kChunk, (end + 3) / 4 - b0));
      blocks(words, b0, nb);
      const uint64_t lo = std::max(first, b0 * 4), hi = std::min(end, (b0 + nb) * 4);
      const uint32_t* w = words + (lo - b0 * 4);
      float* out = f + (lo - first);
      const int64_t m = static_cast<int64_t>(hi - lo);
#pragma omp simd
      for (int64_t k = 0; k < m; ++k) out[k] = select_f32(w[k] >= threshold, scale, 0.0f);
    }
  }

 private:
  // The four words of counter blocks b0 .. b0+nb-1, word j of block b at words[4 (b - b0) + j]: the AVX-512 variant
  // where the kernels run it (cpu_isa.h; the same bits), else the AVX2 one.
  void blocks(uint32_t* words, uint64_t b0, int64_t nb) const {
    if (cpu_kernel_isa() == CpuIsa::avx512) return philox_blocks_avx512(words, key_, b0, nb);
    philox_blocks_avx2(words, key_, b0, nb);
  }

  PhiloxKey key_;
  float scale_;
  uint32_t threshold_ = 0;
};

// Error naming p unless 0 <= p < 1 (NaN fails too).
inline void check_dropout(const Checker& ck, const Dropout& d) {
  if (!(d.p >= 0.0f && d.p < 1.0f)) ck.fail("dropout probability p must be in [0, 1), got ", d.p);
}

}  // namespace moecore::ops::cpu
