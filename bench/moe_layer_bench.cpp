#include "bench/moe_layer_bench.h"

#include <algorithm>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/moe/moe_layer.h"

namespace moecore::bench {
namespace {

// One layer with its weights, state, buffers and inputs on one device (values drawn on the host).
struct MoeLayerSetup {
  moe::MoeConfig cfg;
  moe::MoeLayerDims d;
  moe::MoeLayerWeights w;
  moe::MoeLayerGrads g;
  moe::RouterState st;
  moe::MoeLayerCache cache;
  int64_t cache_bytes = 0;  // what the cache allocated (tracked memory before and after)
  moe::LocalDispatcher disp;
  Tensor x, dy, y, dx;

  MoeLayerSetup(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype, Device dev) {
    cfg.num_experts = E;
    cfg.router_topk = K;
    cfg.ffn_hidden_size = F;
    cfg.load_balancing_type = {moe::LoadBalancing::aux_loss};
    cfg.aux_loss_coeff = {1e-2f};
    cfg.validate();
    d = moe::MoeLayerDims{N, 1, H, F, 0, dtype};
    d.device = dev;
    auto param = [&](Shape s, const char* name, float std, DType dt, MemCategory cat) {
      return random_normal_on(dev, s, dt, name, std, cat, 5);
    };
    constexpr MemCategory P = MemCategory::parameters, G = MemCategory::gradients, A = MemCategory::activations;
    w.router = {param({E, H}, "router", 0.02f, DType::f32, P), param({E, H}, "router", 0.02f, dtype, P)};
    w.experts = {param({E, 2 * F, H}, "fc1", 0.02f, dtype, P), param({E, H, F}, "fc2", 0.02f, dtype, P)};
    g.router = Tensor::zeros({E, H}, DType::f32, G, dev);
    g.experts = {Tensor::zeros({E, 2 * F, H}, DType::f32, G, dev), Tensor::zeros({E, H, F}, DType::f32, G, dev)};
    st = moe::router_state_init(cfg, dev);
    const MemoryStats before = memory_stats();
    cache = moe::moe_layer_cache_alloc(d, cfg);
    cache_bytes = memory_stats().total_current - before.total_current;
    x = param({N, H}, "x", 1.0f, dtype, A);
    dy = param({N, H}, "dy", 1.0f, DType::f32, A);
    y = Tensor::empty({N, H}, DType::f32, A, dev);
    dx = Tensor::empty({N, H}, DType::f32, A, dev);
  }
  void forward(const ops::Context& ctx) {
    moe::moe_layer_forward(y, x, Tensor(), w, st, cache, disp, d, cfg, true, ctx);
  }
  void backward(const ops::Context& ctx) { moe::moe_layer_backward(dx, g, dy, x, w, cache, disp, d, cfg, 1.0f, ctx); }
  // Model FLOPs of the experts' forward (Megatron counts routed experts as ffn_mult * F * K per token; the router
  // GEMM, permutation and activation are not counted): 2 FLOPs per MAC; backward is twice the forward.
  double forward_flops() const {
    return 2.0 * static_cast<double>(d.T * cfg.router_topk) * static_cast<double>(d.H) * static_cast<double>(3 * d.F);
  }
};

}  // namespace

std::vector<std::string> bench_moe_layer(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype,
                                         int iters) {
  MoeLayerSetup s(N, H, F, E, K, dtype, Device::cpu);
  const moe::MoeLayerCache& cache = s.cache;
  auto run = [&](bool backward) {
    s.forward({});
    if (backward) s.backward({});
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
  const double peak = gemm_peak_gflops(dtype);
  const double g_fwd = s.forward_flops() / fwd / 1e9, g_both = 3 * s.forward_flops() / both / 1e9;
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
    out.push_back(moe_line_head(pass ? "moe_layer_fwd_bwd" : "moe_layer_fwd", dtype, N, H, F, E, K)
                      .add("gflops", g)
                      .add("peak_gflops", peak)
                      .add("ratio", g / peak)
                      .add("seconds", pass ? both : fwd)
                      .add("saved_bytes_per_token", static_cast<double>(saved) / static_cast<double>(N))
                      .add("layer_buffer_bytes", s.cache_bytes)
                      .str());
  }
  return out;
}

std::vector<std::string> bench_moe_layer_device(int64_t N, int64_t H, int64_t F, int64_t E, int64_t K, DType dtype,
                                                const DeviceRun& run, const DevicePeaks& peaks) {
  MoeLayerSetup s(N, H, F, E, K, dtype, run.device);
  const ops::Context ctx{run.device};
  const StageTimes t = device_time_stages(run, {[&] { s.forward(ctx); }, [&] { s.backward(ctx); }});
  auto b = [](const Tensor& x) { return static_cast<double>(x.nbytes()); };
  const double weights = b(s.w.router.weight_compute) + b(s.w.experts.fc1) + b(s.w.experts.fc2);
  const double grads = b(s.g.router) + b(s.g.experts.fc1) + b(s.g.experts.fc2);
  const double fwd_bytes = b(s.x) + weights + b(s.y) + static_cast<double>(s.cache_bytes);
  const double bwd_bytes = b(s.dy) + b(s.x) + weights + b(s.dx) + 2 * grads + static_cast<double>(s.cache_bytes);
  std::vector<std::string> out;
  for (int pass = 0; pass < 2; ++pass) {
    JsonLine line = moe_line_head(pass ? "moe_layer_fwd_bwd" : "moe_layer_fwd", dtype, N, H, F, E, K);
    line.add("fwd_ms", t.stage_ms[0]).add("bwd_ms", t.stage_ms[1]).add("layer_buffer_bytes", s.cache_bytes);
    if (run.device == Device::cuda)  // (which CUDA kernel; sim runs the CPU kernels)
      line.add("grouped_gemm_fc1",
               ops::grouped_gemm_kernel(s.cache.experts.h, s.cache.dispatch.permuted_x, s.w.experts.fc1, true));
    add_device_speed(line, run, peaks, pass ? t.total_ms : t.stage_ms[0], (pass ? 3 : 1) * s.forward_flops(),
                     pass ? fwd_bytes + bwd_bytes : fwd_bytes);
    out.push_back(line.str());
  }
  return out;
}

}  // namespace moecore::bench
