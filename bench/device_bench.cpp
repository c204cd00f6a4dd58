// Device bench helpers (see device_bench.h). The peaks use the same timing as every bench line: a peak and a
// figure measured alike are comparable.
#include "bench/device_bench.h"

#include <algorithm>

#include "moecore/core/rng.h"
#include "moecore/kernels/device_timer.h"
#include "moecore/kernels/ops.h"

namespace moecore::bench {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace

StageTimes device_time_stages(const DeviceRun& run, const std::vector<std::function<void()>>& stages) {
  const int n = static_cast<int>(stages.size());
  if (n < 1 || n >= ops::DeviceTimer::kMarks)
    MOECORE_FAIL("bench: ", n, " stages to time; the device timer holds 1 to ", ops::DeviceTimer::kMarks - 1);
  if (run.iters < 1) MOECORE_FAIL("bench: --iters ", run.iters, " must be at least 1");
  for (int w = 0; w < run.warmup; ++w)
    for (const auto& s : stages) s();
  ops::device_synchronize(run.device);
  ops::DeviceTimer timer(run.device);
  std::vector<std::vector<double>> per_stage(static_cast<size_t>(n));
  std::vector<double> totals;
  for (int it = 0; it < run.iters; ++it) {
    timer.mark(0);
    for (int s = 0; s < n; ++s) {
      stages[static_cast<size_t>(s)]();
      timer.mark(s + 1);
    }
    for (int s = 0; s < n; ++s) per_stage[static_cast<size_t>(s)].push_back(timer.elapsed_ms(s, s + 1));
    totals.push_back(timer.elapsed_ms(0, n));
  }
  StageTimes t;
  for (const auto& v : per_stage) t.stage_ms.push_back(median(v));
  t.total_ms = median(totals);
  return t;
}

Tensor random_normal_on(Device device, const Shape& shape, DType dtype, const char* name, float std,
                        MemCategory category, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32, category);
  rng_fill_normal(t, seed, name, 0.0f, std);
  if (dtype != DType::f32) t = t.to(dtype, category);
  return t.to_device(device, category);
}

DevicePeaks device_peaks_measure(const DeviceRun& run) {
  DevicePeaks p;
  const ops::Context ctx{run.device};
  {
    const int64_t n = run.peak_gemm;
    const Tensor a = random_normal_on(run.device, {n, n}, DType::bf16, "bench.peak.a", 1.0f);
    const Tensor b = random_normal_on(run.device, {n, n}, DType::bf16, "bench.peak.b", 1.0f);
    Tensor c = Tensor::empty({n, n}, DType::bf16, MemCategory::workspace, run.device);
    p.gemm_ms = device_time_stages(run, {[&] { ops::gemm(c, a, false, b, true, 1.0f, 0.0f, ctx); }}).total_ms;
    p.tflops =
        2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / (p.gemm_ms * 1e-3) / 1e12;
  }
  const int64_t elems = std::max<int64_t>(run.peak_copy_bytes / 4, 1);
  const Tensor src = Tensor::zeros({elems}, DType::f32, MemCategory::workspace, run.device);
  Tensor dst = Tensor::zeros({elems}, DType::f32, MemCategory::workspace, run.device);
  p.copy_ms = device_time_stages(run, {[&] { dst.copy_from(src); }}).total_ms;
  p.copy_bytes = src.nbytes();
  p.gbps = 2.0 * static_cast<double>(p.copy_bytes) / (p.copy_ms * 1e-3) / 1e9;
  return p;
}

std::string device_peaks_line(const DeviceRun& run, const DevicePeaks& peaks) {
  return JsonLine()
      .add("name", "device_peaks")
      .add("device", device_name(run.device))
      .add("timer", ops::DeviceTimer::clock(run.device))
      .add("iters", run.iters)
      .add("peak_gemm_mnk", run.peak_gemm)
      .add("peak_dtype", "bf16")
      .add("peak_gemm_ms", peaks.gemm_ms)
      .add("peak_tflops", peaks.tflops)
      .add("peak_copy_bytes", peaks.copy_bytes)
      .add("peak_copy_ms", peaks.copy_ms)
      .add("peak_gbps", peaks.gbps)
      .str();
}

JsonLine& add_device_speed(JsonLine& line, const DeviceRun& run, const DevicePeaks& peaks, double ms, double flops,
                           double bytes) {
  const double tflops = flops / (ms * 1e-3) / 1e12;
  line.add("device", device_name(run.device))
      .add("timer", ops::DeviceTimer::clock(run.device))
      .add("iters", run.iters)
      .add("median_ms", ms)
      .add("tflops", tflops)
      .add("peak_tflops", peaks.tflops)
      .add("ratio", tflops / peaks.tflops);
  if (bytes > 0) {
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    line.add("bytes", static_cast<int64_t>(bytes))
        .add("gbps", gbps)
        .add("peak_gbps", peaks.gbps)
        .add("gbps_ratio", gbps / peaks.gbps);
  }
  return line;
}

}  // namespace moecore::bench
