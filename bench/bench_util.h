// Shared pieces of the lab bench: a wall clock, the in-run GEMM peak, and JSON line formatting.
// Speeds are always reported next to a peak measured in the same process (machines here are noisy).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "moecore/core/dtype.h"

namespace moecore::bench {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best GFLOP/s of a dense [M, K] x [K, N] GEMM (oneDNN through ops::gemm) over `reps` timed runs.
double gemm_gflops(DType dtype, int64_t M, int64_t N, int64_t K, int reps = 5);
// The in-run peak: the best of a few large square GEMMs of this dtype.
double gemm_peak_gflops(DType dtype);

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

}  // namespace moecore::bench
