// Shared pieces of the lab bench: a wall clock, the in-run GEMM peak, and JSON line formatting.
// Speeds are always reported next to a peak measured in the same process (machines here are noisy).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "moecore/core/dtype.h"
#include "moecore/train/gemm_peak.h"

namespace moecore::bench {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using train::gemm_gflops;       // dense GEMM GFLOP/s of one shape (moecore/train/gemm_peak.h)
using train::gemm_peak_gflops;  // the in-run peak: best of a few large square GEMMs of this dtype

// Incremental builder of one JSON object on one line.
class JsonLine {
 public:
  JsonLine& add(const char* key, const std::string& value);
  JsonLine& add(const char* key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const char* key, double value);
  JsonLine& add(const char* key, int64_t value);
  JsonLine& add(const char* key, int value) { return add(key, static_cast<int64_t>(value)); }
  std::string str() const { return body_ + "}"; }

 private:
  void key(const char* k);
  std::string body_ = "{";
};

// The head of a MoE bench line (experts, moe-layer; host and device lines alike): name, dtype and the sizes N (tokens),
// H, F, E, K.
JsonLine moe_line_head(const char* name, DType dtype, int64_t N, int64_t H, int64_t F, int64_t E, int64_t K);

// For a bf16 line: how the CPU GEMMs multiply bf16 ("bf16_gemm": native or widened, kernels/cpu_isa.h) and the
// core's bf16 dot-product rate over its f32 FMA rate behind that choice ("bf16_dot_flop_ratio"; 0 without
// AVX512-BF16). Other dtypes add nothing.
JsonLine& add_bf16_gemm(JsonLine& line, DType dtype);

}  // namespace moecore::bench
