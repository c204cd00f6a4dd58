#include "bench/gemm_bench.h"

#include <tuple>

#include "bench/bench_util.h"

namespace moecore::bench {

std::vector<std::string> bench_gemm_lines() {
  std::vector<std::string> out;
  // (M, N, K): square sizes, then GPT-2-small shapes at 1024 tokens (qkv, proj, fc1, fc2, logits chunk).
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {{1024, 1024, 1024}, {2048, 2048, 2048}, {1024, 2304, 768},
                                                          {1024, 768, 768},   {1024, 3072, 768},  {1024, 768, 3072},
                                                          {333, 50257, 768}};
  for (DType dt : {DType::f32, DType::bf16}) {
    const double peak = gemm_peak_gflops(dt);
    for (const auto& [m, n, k] : shapes) {
      const double g = gemm_gflops(dt, m, n, k, 3);
      out.push_back(JsonLine()
                        .add("name", "gemm")
                        .add("dtype", std::string(dtype_name(dt)))
                        .add("M", m)
                        .add("N", n)
                        .add("K", k)
                        .add("gflops", g)
                        .add("peak_gflops", peak)
                        .add("ratio", g / peak)
                        .str());
    }
  }
  return out;
}

}  // namespace moecore::bench
