#include "bench/moe_layer_bench.h"

#include <algorithm>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/moe/moe_layer.h"

namespace moecore::bench {

std::vector<std::string> bench_moe_layer(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype,
                                         int iters) {
  moe::MoeConfig cfg;
  cfg.num_experts = E;
  cfg.router_topk = K;
  cfg.ffn_hidden_size = F;
  cfg.load_balancing_type = {moe::LoadBalancing::aux_loss};
  cfg.aux_loss_coeff = {1e-2f};
  cfg.validate();
  const moe::MoeLayerDims d{N, 1, H, F, 0, dtype};
  auto param = [&](Shape s, const char* name, float std) {
    Tensor t = Tensor::empty(s, DType::f32, MemCategory::parameters);
    rng_fill_normal(t, 5, name, 0.0f, std);
    return t;
  };
  const Tensor router = param({E, H}, "router", 0.02f);
  moe::MoeLayerWeights w;
  w.router = {router, router.to(dtype, MemCategory::parameters)};
  w.experts = {param({E, 2 * F, H}, "fc1", 0.02f).to(dtype, MemCategory::parameters),
               param({E, H, F}, "fc2", 0.02f).to(dtype, MemCategory::parameters)};
  moe::MoeLayerGrads g;
  g.router = Tensor::zeros({E, H}, DType::f32, MemCategory::gradients);
  g.experts = {Tensor::zeros({E, 2 * F, H}, DType::f32, MemCategory::gradients),
               Tensor::zeros({E, H, F}, DType::f32, MemCategory::gradients)};
  moe::RouterState st = moe::router_state_init(cfg);
  const MemoryStats before = memory_stats();
  moe::MoeLayerCache cache = moe::moe_layer_cache_alloc(d, cfg);
  const int64_t cache_bytes = memory_stats().total_current - before.total_current;
  moe::LocalDispatcher disp;
  const Tensor x = param({N, H}, "x", 1.0f).to(dtype, MemCategory::activations);
  const Tensor dy = param({N, H}, "dy", 1.0f);
  Tensor y = Tensor::empty({N, H}, DType::f32, MemCategory::activations);
  Tensor dx = Tensor::empty({N, H}, DType::f32, MemCategory::activations);
  auto run = [&](bool backward) {
    moe::moe_layer_forward(y, x, Tensor(), w, st, cache, disp, d, cfg, true, {});
    if (backward) moe::moe_layer_backward(dx, g, dy, x, w, cache, disp, d, cfg, 1.0f, {});
  };
  run(true);  // warm-up
  double fwd = 1e30, both = 1e30;
  for (int i = 0; i < iters; ++i) {
    double t0 = now_seconds();
    run(false);
    fwd = std::min(fwd, now_seconds() - t0);
    t0 = now_seconds();
    run(true);
    both = std::min(both, now_seconds() - t0);
  }
  // Model FLOPs of the experts (Megatron counts routed experts as ffn_mult * F * K per token; the router
  // GEMM, permutation and activation are not counted): 2 FLOPs per MAC, forward = 1 pass, backward = 2.
  const double mac_fwd = static_cast<double>(N * K) * static_cast<double>(H) * static_cast<double>(3 * F);
  const double peak = gemm_peak_gflops(dtype);
  const double g_fwd = 2 * mac_fwd / fwd / 1e9, g_both = 6 * mac_fwd / both / 1e9;
  const int64_t R = cache.dispatch.plan.row_bound;  // dropless: exactly N * K rows
  // Saved for backward per token: router logits/scores/top-k, probs/map, permuted inputs and probs, and the
  // experts' fc1 output and activation (the routed expert output [N*K, H] is not kept).
  const int64_t c = static_cast<int64_t>(dtype_size(dtype));
  const int64_t saved = cache.router.logits.nbytes() + cache.router.scores.nbytes() + cache.router.topk_idx.nbytes() +
                        cache.router.topk_w.nbytes() + cache.router.dlogits_loss.nbytes() + cache.probs.nbytes() +
                        cache.map.nbytes() + R * (H * c + 4) + R * (3 * F) * c;
  std::vector<std::string> out;
  for (int pass = 0; pass < 2; ++pass) {
    const double g = pass ? g_both : g_fwd;
    out.push_back(JsonLine()
                      .add("name", pass ? "moe_layer_fwd_bwd" : "moe_layer_fwd")
                      .add("dtype", std::string(dtype_name(dtype)))
                      .add("N", N)
                      .add("H", H)
                      .add("F", F)
                      .add("E", E)
                      .add("K", K)
                      .add("gflops", g)
                      .add("peak_gflops", peak)
                      .add("ratio", g / peak)
                      .add("seconds", pass ? both : fwd)
                      .add("saved_bytes_per_token", static_cast<double>(saved) / static_cast<double>(N))
                      .add("layer_buffer_bytes", cache_bytes)
                      .str());
  }
  return out;
}

}  // namespace moecore::bench
