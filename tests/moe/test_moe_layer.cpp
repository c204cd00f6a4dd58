// The MoE layer as a whole (local dispatcher): linear biases (Megatron's add_bias_linear) against the
// bias-free layer and against finite differences, and the shared-expert restriction. Per-op math lives in
// test_router*.cpp and test_dispatch_experts.cpp; the reference comparison in tests/model/test_moe_layer_golden.cpp.
// The layer lives on testing::test_device() (MOECORE_TEST_DEVICE); inputs are built on the host and moved there,
// results are read through host copies, and finite differences perturb a host copy that each evaluation uploads.
#include <cmath>
#include <string>
#include <variant>

#include "moecore/moe/moe_layer.h"
#include "test_util.h"

namespace moecore::moe {
namespace {

using testing::host;
using testing::to_vector;

// N(0, std^2) from a named stream, built on the host and moved to the test device.
Tensor randn(const Shape& shape, const char* name, float std = 1.0f) {
  return testing::on_test_device(testing::randn(shape, name, std));
}
Tensor zeros(const Shape& shape) {
  return Tensor::zeros(shape, DType::f32, MemCategory::other, testing::test_device());
}

struct Layer {
  MoeConfig cfg;
  MoeLayerDims d;
  MoeLayerWeights w;
  MoeLayerGrads g;
  Tensor x, dy, y, dx;
  RouterState st;
  MoeLayerCache cache;
  LocalDispatcher disp;
  ops::Context ctx{testing::test_device()};

  // T = 12 tokens (B = 2), H = 8, F = 6, E = 4, K = 2, SwiGLU, aux + seq_aux loss; with a capacity when cf > 0.
  Layer(bool bias, float cf = 0.0f, int64_t Fs = 0) {
    cfg.num_experts = 4;
    cfg.router_topk = 2;
    cfg.load_balancing_type = {LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss};
    cfg.aux_loss_coeff = {0.1f, 0.2f};
    cfg.capacity_factor = cf;
    cfg.pad_expert_input_to_capacity = cf > 0;
    d = {12, 2, 8, 6, Fs, DType::f32};
    d.device = ctx.device;
    const int64_t E = 4, H = 8, F = 6;
    Tensor router = randn({E, H}, "layer.router", 0.5f);
    w.router = {router, router};
    w.experts = {randn({E, 2 * F, H}, "layer.fc1", 0.3f), randn({E, H, F}, "layer.fc2", 0.3f)};
    g.router = zeros({E, H});
    g.experts = {zeros({E, 2 * F, H}), zeros({E, H, F})};
    if (bias) {
      w.router.bias = randn({E}, "layer.router_bias", 0.5f);
      w.experts.fc1_bias = randn({E, 2 * F}, "layer.fc1_bias", 0.3f);
      w.experts.fc2_bias = randn({E, H}, "layer.fc2_bias", 0.3f);
      g.router_bias = zeros({E});
      g.experts.fc1_bias = zeros({E, 2 * F});
      g.experts.fc2_bias = zeros({E, H});
    }
    if (Fs > 0) {
      w.shared.fc1 = randn({2 * Fs, H}, "layer.sfc1", 0.3f);
      w.shared.fc2 = randn({H, Fs}, "layer.sfc2", 0.3f);
      g.shared.fc1 = zeros({2 * Fs, H});
      g.shared.fc2 = zeros({H, Fs});
    }
    x = randn({12, H}, "layer.x");
    dy = randn({12, H}, "layer.dy");
    y = Tensor::empty({12, H}, DType::f32, MemCategory::other, ctx.device);
    dx = Tensor::empty({12, H}, DType::f32, MemCategory::other, ctx.device);
    st = router_state_init(cfg, ctx.device);
    cache = moe_layer_cache_alloc(d, cfg);
  }
  double forward() {
    moe_layer_forward(y, x, Tensor(), w, st, cache, disp, d, cfg, true, ctx);
    return testing::weighted_sum(y, dy) + router_stats_host(cache.stats).weighted_loss;
  }
  void backward() { moe_layer_backward(dx, g, dy, x, w, cache, disp, d, cfg, 1.0f, ctx); }
  // Central differences of forward() with respect to the device tensor t: a host copy is perturbed and uploaded
  // before each evaluation (with a fresh router state), and t holds its original values again afterwards.
  Tensor numerical_gradient(Tensor& t) {
    Tensor h = host(t).clone();
    auto loss = [&] {
      t.copy_from(h);
      st = router_state_init(cfg, ctx.device);
      return forward();
    };
    Tensor grad = testing::numerical_gradient(loss, h);
    t.copy_from(h);
    return grad;
  }
};

// Zero biases give the bias-free layer bit for bit (adding +0 is exact); nonzero ones change the output.
TEST(MoeLayer, ZeroBiasesEqualNoBiases) {
  Layer plain(false), zero(true), biased(true);
  for (Tensor* t : {&zero.w.router.bias, &zero.w.experts.fc1_bias, &zero.w.experts.fc2_bias}) t->zero_();
  plain.forward();
  zero.forward();
  biased.forward();
  plain.backward();
  zero.backward();
  EXPECT_EQ(to_vector(plain.y), to_vector(zero.y));
  EXPECT_EQ(to_vector(plain.dx), to_vector(zero.dx));
  EXPECT_EQ(to_vector(plain.g.router), to_vector(zero.g.router));
  EXPECT_EQ(to_vector(plain.g.experts.fc1), to_vector(zero.g.experts.fc1));
  EXPECT_EQ(to_vector(plain.g.experts.fc2), to_vector(zero.g.experts.fc2));
  EXPECT_NE(to_vector(plain.y), to_vector(biased.y));
}

// Central differences (f32, step 1e-2) of sum(y * dy) + weighted aux losses with respect to every bias, and to
// the input (the fc2 bias reaches the router through dprobs = dy . b2): rtol 1e-2, atol 2e-3. Dropless and
// with pad-to-capacity; elements whose step flips a routing decision would show as outliers, so the weights
// are drawn with clear margins at this size.
TEST(MoeLayer, BiasGradientsMatchFiniteDifferences) {
  for (float cf : {0.0f, 1.0f}) {
    SCOPED_TRACE(cf > 0 ? "capacity 1.0, padded" : "dropless");
    Layer l(true, cf);
    l.forward();
    l.backward();
    if (cf > 0) {
      EXPECT_GT(router_stats_host(l.cache.stats).dropped, 0);
    }
    EXPECT_TENSOR_NEAR(l.g.router_bias, l.numerical_gradient(l.w.router.bias), 1e-2, 2e-3);
    EXPECT_TENSOR_NEAR(l.g.experts.fc1_bias, l.numerical_gradient(l.w.experts.fc1_bias), 1e-2, 2e-3);
    EXPECT_TENSOR_NEAR(l.g.experts.fc2_bias, l.numerical_gradient(l.w.experts.fc2_bias), 1e-2, 2e-3);
    EXPECT_TENSOR_NEAR(l.dx, l.numerical_gradient(l.x), 1e-2, 2e-3);
  }
}

// Megatron's SharedExpertMLP asserts add_bias_linear == False: the layer refuses biases with a shared expert.
TEST(MoeLayer, BiasesWithASharedExpertAreRejected) {
  Layer l(true, 0.0f, 5);
  try {
    l.forward();
    ADD_FAILURE() << "biases with a shared expert were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add_bias_linear"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("shared expert"), std::string::npos) << e.what();
  }
  Layer ok(false, 0.0f, 5);
  EXPECT_NO_THROW(ok.forward());
}

// Each EP dispatcher's state carries its own named scratch. A cache allocated alone holds its saved tensors and the
// scratch; one that shares another's scratch aliases it and allocates only its saved tensors; the memory plan's two
// counts (moe_layer_cache_bytes, moe_layer_scratch_bytes) are what was allocated. (Allocation only: no process group.)
TEST(MoeLayer, DispatcherScratchIsNamedSharedAndCountedOnce) {
  MoeConfig cfg;
  cfg.num_experts = 4;
  cfg.router_topk = 2;
  for (DispatcherKind kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    SCOPED_TRACE(dispatcher_kind_name(kind));
    MoeLayerDims d{12, 2, 8, 6, 0, DType::f32};
    d.ep = 2;
    d.dispatcher = kind;
    d.device = testing::test_device();
    const int64_t before = memory_stats().total_current;
    const MoeLayerCache a = moe_layer_cache_alloc(d, cfg);
    const int64_t first = memory_stats().total_current;
    EXPECT_EQ(first - before, moe_layer_cache_bytes(a) + moe_layer_scratch_bytes(a));
    // The dispatcher's own scratch, by name, is part of the scratch count.
    std::vector<const Tensor*> named;
    if (const auto* s = std::get_if<AllToAllState>(&a.dispatch.state)) {
      const AllToAllScratch& w = s->scratch;
      named = {&w.send_x, &w.send_f, &w.send_p, &w.stage_x, &w.stage_f, &w.stage_p};
    } else {
      const AllGatherScratch& w = std::get<AllGatherState>(a.dispatch.state).scratch;
      named = {&w.gx, &w.gprobs, &w.gy, &w.gdprobs, &w.ty};
    }
    int64_t named_bytes = 0;
    for (const Tensor* t : named) {
      ASSERT_TRUE(t->defined());
      named_bytes += t->nbytes();
    }
    EXPECT_GT(named_bytes, 0);
    EXPECT_GE(moe_layer_scratch_bytes(a), named_bytes);
    const MoeLayerCache b = moe_layer_cache_alloc(d, cfg, &a);
    EXPECT_EQ(memory_stats().total_current - first, moe_layer_cache_bytes(b));
    EXPECT_EQ(moe_layer_scratch_bytes(b), moe_layer_scratch_bytes(a));
    EXPECT_TRUE(b.dispatch.expert_out.same_data(a.dispatch.expert_out));
    if (kind == DispatcherKind::alltoall)
      EXPECT_TRUE(std::get<AllToAllState>(b.dispatch.state)
                      .scratch.send_x.same_data(std::get<AllToAllState>(a.dispatch.state).scratch.send_x));
    else
      EXPECT_TRUE(std::get<AllGatherState>(b.dispatch.state)
                      .scratch.gy.same_data(std::get<AllGatherState>(a.dispatch.state).scratch.gy));
  }
}

// A dispatcher refuses buffers allocated for another one, naming itself.
TEST(MoeLayer, DispatcherRefusesAnotherDispatchersBuffers) {
  Layer l(false);
  MoeLayerDims d = l.d;
  d.ep = 2;
  d.dispatcher = DispatcherKind::allgather;
  l.cache = moe_layer_cache_alloc(d, l.cfg);
  try {
    l.forward();
    ADD_FAILURE() << "the local dispatcher ran on all-gather buffers";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("local dispatcher"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moecore::moe
