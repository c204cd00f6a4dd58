#include "bench/gemm_bench.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "bench/bench_util.h"
#include "moecore/kernels/ops.h"

namespace moecore::bench {

std::vector<GemmShape> gemm_default_shapes() {
  return {{1024, 1024, 1024}, {2048, 2048, 2048}, {1024, 2304, 768}, {1024, 768, 768},
          {1024, 3072, 768},  {1024, 768, 3072},  {333, 50257, 768}};
}

std::vector<GemmShape> gemm_parse_shapes(const std::string& text, const char* flag) {
  std::vector<GemmShape> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t end = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, end - pos);
    GemmShape s;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%" SCNd64 "x%" SCNd64 "x%" SCNd64 "%c", &s.M, &s.N, &s.K, &tail) != 3 || s.M < 1 ||
        s.N < 1 || s.K < 1)
      MOECORE_FAIL(flag, " '", text, "': item '", item,
                   "' is not MxNxK with three positive integers (e.g. 1024x768x3072; items separated by commas)");
    out.push_back(s);
    pos = end + 1;
  }
  return out;
}

std::vector<std::string> bench_gemm_lines(const std::vector<GemmShape>& shapes) {
  std::vector<std::string> out;
  for (DType dt : {DType::f32, DType::bf16}) {
    const double peak = gemm_peak_gflops(dt);
    for (const auto& [m, n, k] : shapes) {
      const double g = gemm_gflops(dt, m, n, k, 3);
      JsonLine line;
      line.add("name", "gemm")
          .add("dtype", std::string(dtype_name(dt)))
          .add("M", m)
          .add("N", n)
          .add("K", k)
          .add("gflops", g)
          .add("peak_gflops", peak)
          .add("ratio", g / peak);
      out.push_back(add_bf16_gemm(line, dt).str());
    }
  }
  return out;
}

std::vector<std::string> bench_gemm_device_lines(const std::vector<GemmShape>& shapes, const DeviceRun& run,
                                                 const DevicePeaks& peaks) {
  std::vector<std::string> out;
  const ops::Context ctx{run.device};
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const auto& [m, n, k] : shapes) {
      const Tensor a = random_normal_on(run.device, {m, k}, dt, "bench.gemm.a", 1.0f);
      const Tensor b = random_normal_on(run.device, {n, k}, dt, "bench.gemm.b", 1.0f);
      Tensor c = Tensor::empty({m, n}, DType::f32, MemCategory::workspace, run.device);
      const double ms = device_time_stages(run, {[&] { ops::gemm(c, a, false, b, true, 1.0f, 0.0f, ctx); }}).total_ms;
      const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
      const double bytes = static_cast<double>(a.nbytes() + b.nbytes() + c.nbytes());
      JsonLine line;
      line.add("name", "gemm")
          .add("dtype", std::string(dtype_name(dt)))
          .add("out_dtype", "f32")
          .add("M", m)
          .add("N", n)
          .add("K", k);
      out.push_back(add_device_speed(line, run, peaks, ms, flops, bytes).str());
    }
  }
  return out;
}

}  // namespace moecore::bench
