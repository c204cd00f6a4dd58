// Experts bench (see experts_bench.h). FLOPs count the six GEMMs only: forward fc1 and fc2, backward their
// input and weight gradients, 3 passes x 2 x R x H x (fc1_rows + F); the activation and probability steps
// are not counted but are timed. Routing: each token picks K distinct experts uniformly at random, so
// tokens_per_expert ~ R/E with binomial spread. On the CPU the best of a few timed steps after one warm-up step;
// on a device (--device) the median of the timed steps after the warm-up ones (device_bench.h).
#include "bench/experts_bench.h"

#include <algorithm>
#include <numeric>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/moe/experts.h"

namespace moecore::bench {
namespace {

std::vector<int64_t> random_tokens_per_expert(int64_t N, int64_t E, int64_t K) {
  const PhiloxKey key = philox_key(1, "bench.experts.routing");
  std::vector<int64_t> counts(E, 0), perm(E);
  for (int64_t t = 0; t < N; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t k = 0; k < K; ++k) {  // partial Fisher-Yates: K distinct experts
      const auto u = philox_uniform(key, static_cast<uint64_t>(t * K + k));
      const int64_t j = k + std::min<int64_t>(E - k - 1, static_cast<int64_t>(u * static_cast<float>(E - k)));
      std::swap(perm[k], perm[j]);
      ++counts[perm[k]];
    }
  }
  return counts;
}

// Everything the two calls take, on one device: host-drawn values, one same-dtype transfer each.
struct ExpertsSetup {
  moe::ExpertDims d;
  std::vector<int64_t> tpe_host;
  Tensor tpe;  // [E] i64
  moe::ExpertWeights w;
  moe::ExpertGrads g;
  Tensor x, dy, probs, y, dx, dprobs;
  moe::ExpertCache cache;
  moe::ExpertWorkspace ws;
  // The least traffic of one forward + backward (see experts_bench.h).
  double bytes() const {
    auto b = [](const Tensor& t) { return static_cast<double>(t.nbytes()); };
    const double weights = b(w.fc1) + b(w.fc2), saved = b(cache.h) + b(cache.act);
    return (b(x) + weights + b(probs) + b(y) + saved) +
           (b(dy) + b(x) + b(probs) + weights + saved + b(dx) + b(dprobs) + 2 * (b(g.fc1) + b(g.fc2)));
  }
};

ExpertsSetup experts_setup(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype, Device dev) {
  constexpr MemCategory ws = MemCategory::workspace;
  ExpertsSetup s;
  const int64_t R = N * K;
  s.d.E = E;
  s.d.H = H;
  s.d.F = F;
  s.d.act.glu = true;
  s.d.max_rows = R;
  s.d.compute = dtype;
  s.d.device = dev;
  s.tpe_host = random_tokens_per_expert(N, E, K);
  Tensor tpe = Tensor::empty({E}, DType::i64, ws);
  std::copy(s.tpe_host.begin(), s.tpe_host.end(), tpe.data<int64_t>());
  s.tpe = tpe.to_device(dev, ws);
  s.w = {random_normal_on(dev, {E, s.d.fc1_rows(), H}, dtype, "bench.fc1", 0.02f),
         random_normal_on(dev, {E, H, F}, dtype, "bench.fc2", 0.02f)};
  s.g = {Tensor::zeros({E, s.d.fc1_rows(), H}, DType::f32, ws, dev), Tensor::zeros({E, H, F}, DType::f32, ws, dev)};
  s.x = random_normal_on(dev, {R, H}, dtype, "bench.x", 1.0f);
  s.dy = random_normal_on(dev, {R, H}, dtype, "bench.dy", 1.0f);
  Tensor probs = Tensor::empty({R}, DType::f32, ws);
  rng_fill_uniform(probs, 1, "bench.probs", 0.0f, 1.0f);
  s.probs = probs.to_device(dev, ws);
  s.y = Tensor::empty({R, H}, dtype, ws, dev);
  s.dx = Tensor::empty({R, H}, DType::f32, ws, dev);
  s.dprobs = Tensor::empty({R}, DType::f32, ws, dev);
  s.cache = moe::expert_cache_alloc(s.d);
  s.ws = moe::expert_workspace_alloc(s.d);
  return s;
}

// FLOPs of one forward + backward (the six GEMMs).
double experts_flops(const ExpertsSetup& s, int64_t R) {
  return 3.0 * 2.0 * static_cast<double>(R) * static_cast<double>(s.d.H) * static_cast<double>(s.d.fc1_rows() + s.d.F);
}

}  // namespace

std::vector<std::string> bench_experts_lines(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype) {
  const int64_t R = N * K;
  ExpertsSetup s = experts_setup(N, H, F, E, K, dtype, Device::cpu);
  const ops::Context ctx;

  double fwd = 1e30, bwd = 1e30, step = 1e30;
  for (int r = 0; r < 4; ++r) {  // run 0 warms up (scratch growth, oneDNN kernels)
    const double t0 = now_seconds();
    moe::experts_forward(s.y, s.x, s.probs, s.tpe, s.w, s.cache, s.ws, s.d, ctx);
    const double t1 = now_seconds();
    moe::experts_backward(s.dx, s.dprobs, s.g, s.dy, s.x, s.probs, s.tpe, s.w, s.cache, s.ws, s.d, ctx);
    const double t2 = now_seconds();
    if (r == 0) continue;
    fwd = std::min(fwd, t1 - t0);
    bwd = std::min(bwd, t2 - t1);
    step = std::min(step, t2 - t0);
  }
  const double flops = experts_flops(s, R);
  const double peak = gemm_peak_gflops(dtype);
  const double gflops = flops / step / 1e9;
  const auto [mn, mx] = std::minmax_element(s.tpe_host.begin(), s.tpe_host.end());
  return {moe_line_head("experts", dtype, N, H, F, E, K)
              .add("rows", R)
              .add("rows_min", *mn)
              .add("rows_max", *mx)
              .add("fwd_ms", fwd * 1e3)
              .add("bwd_ms", bwd * 1e3)
              .add("gflops", gflops)
              .add("peak_gflops", peak)
              .add("ratio", gflops / peak)
              .str()};
}

std::vector<std::string> bench_experts_device_lines(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype,
                                                    const DeviceRun& run, const DevicePeaks& peaks) {
  const int64_t R = N * K;
  ExpertsSetup s = experts_setup(N, H, F, E, K, dtype, run.device);
  const ops::Context ctx{run.device};
  const StageTimes t = device_time_stages(
      run,
      {[&] { moe::experts_forward(s.y, s.x, s.probs, s.tpe, s.w, s.cache, s.ws, s.d, ctx); },
       [&] { moe::experts_backward(s.dx, s.dprobs, s.g, s.dy, s.x, s.probs, s.tpe, s.w, s.cache, s.ws, s.d, ctx); }});
  const auto [mn, mx] = std::minmax_element(s.tpe_host.begin(), s.tpe_host.end());
  JsonLine line = moe_line_head("experts", dtype, N, H, F, E, K);
  line.add("rows", R)
      .add("rows_min", *mn)
      .add("rows_max", *mx)
      .add("fwd_ms", t.stage_ms[0])
      .add("bwd_ms", t.stage_ms[1]);
  if (run.device == Device::cuda)  // (which CUDA kernel; sim runs the CPU kernels)
    line.add("grouped_gemm_fc1", ops::grouped_gemm_kernel(s.cache.h, s.x, s.w.fc1, true));
  return {add_device_speed(line, run, peaks, t.total_ms, experts_flops(s, R), s.bytes()).str()};
}

}  // namespace moecore::bench
