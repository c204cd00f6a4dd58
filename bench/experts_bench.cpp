// Experts bench (see experts_bench.h). FLOPs count the six GEMMs only: forward fc1 and fc2, backward their
// input and weight gradients, 3 passes x 2 x R x H x (fc1_rows + F); the activation and probability steps
// are not counted but are timed. Routing: each token picks K distinct experts uniformly at random, so
// tokens_per_expert ~ R/E with binomial spread. Best of a few timed steps after one warm-up step.
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

Tensor random_tensor(const Shape& s, DType dtype, const char* name, float std) {
  Tensor t = Tensor::empty(s, DType::f32, MemCategory::workspace);
  rng_fill_normal(t, 1, name, 0.0f, std);
  return dtype == DType::f32 ? t : t.to(dtype, MemCategory::workspace);
}

}  // namespace

std::vector<std::string> bench_experts_lines(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype) {
  const int64_t R = N * K;
  moe::ExpertDims d;
  d.E = E;
  d.H = H;
  d.F = F;
  d.swiglu = true;
  d.max_rows = R;
  d.compute = dtype;
  const std::vector<int64_t> tpe_host = random_tokens_per_expert(N, E, K);
  Tensor tpe = Tensor::empty({E}, DType::i64, MemCategory::workspace);
  std::copy(tpe_host.begin(), tpe_host.end(), tpe.data<int64_t>());
  const moe::ExpertWeights w{random_tensor({E, d.fc1_rows(), H}, dtype, "bench.fc1", 0.02f),
                             random_tensor({E, H, F}, dtype, "bench.fc2", 0.02f)};
  moe::ExpertGrads g{Tensor::zeros({E, d.fc1_rows(), H}, DType::f32, MemCategory::workspace),
                     Tensor::zeros({E, H, F}, DType::f32, MemCategory::workspace)};
  const Tensor x = random_tensor({R, H}, dtype, "bench.x", 1.0f);
  const Tensor dy = random_tensor({R, H}, dtype, "bench.dy", 1.0f);
  Tensor probs = Tensor::empty({R}, DType::f32, MemCategory::workspace);
  rng_fill_uniform(probs, 1, "bench.probs", 0.0f, 1.0f);
  Tensor y = Tensor::empty({R, H}, dtype, MemCategory::workspace);
  Tensor dx = Tensor::empty({R, H}, DType::f32, MemCategory::workspace);
  Tensor dprobs = Tensor::empty({R}, DType::f32, MemCategory::workspace);
  moe::ExpertCache cache = moe::expert_cache_alloc(d);
  moe::ExpertWorkspace ws = moe::expert_workspace_alloc(d);
  const ops::Context ctx;

  double fwd = 1e30, bwd = 1e30, step = 1e30;
  for (int r = 0; r < 4; ++r) {  // run 0 warms up (scratch growth, oneDNN kernels)
    const double t0 = now_seconds();
    moe::experts_forward(y, x, probs, tpe, w, cache, ws, d, ctx);
    const double t1 = now_seconds();
    moe::experts_backward(dx, dprobs, g, dy, x, probs, tpe, w, cache, ws, d, ctx);
    const double t2 = now_seconds();
    if (r == 0) continue;
    fwd = std::min(fwd, t1 - t0);
    bwd = std::min(bwd, t2 - t1);
    step = std::min(step, t2 - t0);
  }
  const double flops =
      3.0 * 2.0 * static_cast<double>(R) * static_cast<double>(H) * static_cast<double>(d.fc1_rows() + F);
  const double peak = gemm_peak_gflops(dtype);
  const double gflops = flops / step / 1e9;
  const auto [mn, mx] = std::minmax_element(tpe_host.begin(), tpe_host.end());
  return {JsonLine()
              .add("name", "experts")
              .add("dtype", std::string(dtype_name(dtype)))
              .add("N", N)
              .add("H", H)
              .add("F", F)
              .add("E", E)
              .add("K", K)
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

}  // namespace moecore::bench
