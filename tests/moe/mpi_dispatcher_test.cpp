// Multi-rank tests of the expert-parallel dispatchers (alltoall and allgather), run under mpirun with 2 and
// 4 ranks. Reference: on every rank, the same MoE layer with the local dispatcher and ALL experts on this
// rank's own tokens (routing and capacity are per rank in Megatron, so this is exactly what EP must
// reproduce); expert and router gradients of the reference are summed over the ranks. The EP layer holds
// only its E/EP experts. Outputs, input gradients and every gradient must match; two EP runs must be
// bitwise identical. Edge cases: an expert with no tokens, every token to one expert, a rank that sends
// nothing to other ranks, capacity dropping and pad-to-capacity, linear biases (each rank holds its experts'
// bias rows [E/EP, ...]; the router bias is replicated).
// Every layer and router runs on testing::test_device() (MOECORE_TEST_DEVICE); inputs are built on the host and
// moved there, results are read through host copies.
#include <gtest/gtest.h>

#include "mpi_test_support.h"
#include "test_util.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "moecore/core/error.h"
#include "moecore/core/rng.h"
#include "moecore/core/shard.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/parallel/comm.h"

namespace moecore::moe {
namespace {

using Mpi = testing_mpi::MpiTest;
using testing::host;
using testing::on_test_device;

Tensor dev_zeros(const Shape& shape, MemCategory category) {
  return Tensor::zeros(shape, DType::f32, category, testing::test_device());
}

enum class Routing { random, one_expert, own_rank };

struct LayerCase {
  int64_t T = 24, H = 16, F = 12, E = 8, K = 2;
  MoeConfig cfg;
  Routing routing = Routing::random;
  bool bias = false;   // Megatron's add_bias_linear: router and expert biases
  EchoDims echo{};     // MoE ECHO in the EP layer (its group is set by run_layer)
  float capacity = 0;  // the EP layer's static received-token capacity (x the average)
};

struct Run {
  Tensor y, dx;
  MoeLayerGrads g;
  RouterStatsHost stats;
  EchoStatsHost echo;     // with ECHO
  bool overflow = false;  // over the static received-token capacity
};

void expect_close(const Tensor& a, const Tensor& b, double rtol, const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  const Tensor fa = host(a).to(DType::f32), fb = host(b).to(DType::f32);
  const float* pa = fa.data<float>();
  const float* pb = fb.data<float>();
  double maxref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) maxref = std::max(maxref, std::fabs(static_cast<double>(pb[i])));
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_NEAR(pa[i], pb[i], rtol * maxref + 1e-30) << what << " element " << i;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  const Tensor ha = host(a), hb = host(b);
  return a.nbytes() == b.nbytes() && std::memcmp(ha.raw(), hb.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

// The expert-tensor-parallel slices (Megatron's layout: fc1's gate and up rows, fc2's columns) of a [El, ...]
// expert tensor, for ETP rank k of etp.
TensorShard fc1_slice(int k, int64_t etp) {
  return {1, 2, k, static_cast<int>(etp)};
}
TensorShard fc2_slice(int k, int64_t etp) {
  return {2, 1, k, static_cast<int>(etp)};
}

// The EP and ETP groups of a world of ep x etp ranks, ETP varying fastest (the expert rank generator's order):
// world rank r is ETP rank r % etp of EP rank r / etp.
struct ExpertGroups {
  ProcessGroup ep, etp;
};
ExpertGroups expert_groups(const ProcessGroup& world, int64_t etp) {
  const int P = world.size(), Q = static_cast<int>(etp);
  std::vector<std::vector<int>> ep_part(static_cast<size_t>(Q)), etp_part(static_cast<size_t>(P / Q));
  for (int r = 0; r < P; ++r) {
    ep_part[static_cast<size_t>(r % Q)].push_back(r);
    etp_part[static_cast<size_t>(r / Q)].push_back(r);
  }
  return {group_split(world, "ep", ep_part), group_split(world, "etp", etp_part)};
}

// Runs one layer forward+backward. ep == 1 (and etp == 1): local dispatcher with all E experts; else the given EP
// dispatcher with this rank's E/ep experts, each a 1/etp slice. Weights are the same full tensors on every rank,
// built on the host and moved to the test device.
Run run_layer(const LayerCase& s, const ProcessGroup& world, int64_t ep, DispatcherKind kind, int64_t etp = 1) {
  const int r = world.rank();
  const int64_t T = s.T, H = s.H, F = s.F, E = s.E, El = E / ep, first = r / etp % ep * El;
  const int k = static_cast<int>(r % etp);
  // Full weights, identical on every rank.
  Tensor router = Tensor::empty({E, H}, DType::f32, MemCategory::parameters);
  Tensor fc1 = Tensor::empty({E, 2 * F, H}, DType::f32, MemCategory::parameters);
  Tensor fc2 = Tensor::empty({E, H, F}, DType::f32, MemCategory::parameters);
  rng_fill_normal(router, 7, "router", 0.0f, 0.5f);
  rng_fill_normal(fc1, 7, "fc1", 0.0f, 0.2f);
  rng_fill_normal(fc2, 7, "fc2", 0.0f, 0.2f);
  Tensor rbias, b1, b2;
  if (s.bias) {
    rbias = Tensor::empty({E}, DType::f32, MemCategory::parameters);
    b1 = Tensor::empty({E, 2 * F}, DType::f32, MemCategory::parameters);
    b2 = Tensor::empty({E, H}, DType::f32, MemCategory::parameters);
    rng_fill_normal(rbias, 7, "router_bias", 0.0f, 0.5f);
    rng_fill_normal(b1, 7, "fc1_bias", 0.0f, 0.2f);
    rng_fill_normal(b2, 7, "fc2_bias", 0.0f, 0.2f);
  }
  // This rank's tokens and output gradient.
  Tensor x = Tensor::empty({T, H}, DType::f32, MemCategory::activations);
  Tensor dy = Tensor::empty({T, H}, DType::f32, MemCategory::activations);
  rng_fill_normal(x, 11, "x.rank" + std::to_string(r), 0.0f, 1.0f);
  rng_fill_normal(dy, 11, "dy.rank" + std::to_string(r), 0.0f, 1.0f);
  if (s.routing != Routing::random) {
    // Router rows are scaled unit vectors; tokens lean strongly towards two chosen experts.
    router.zero_();
    for (int64_t e = 0; e < E; ++e) router.data<float>()[e * H + e % H] = 1.0f;
    const int64_t e0 = s.routing == Routing::one_expert ? E - 2 : (r * E / world.size());
    float* xp = x.data<float>();
    for (int64_t t = 0; t < T; ++t) {
      xp[t * H + e0 % H] += 20.0f;
      xp[t * H + (e0 + 1) % H] += 10.0f;
    }
  }
  const Device dev = testing::test_device();
  // This rank's rows [first, first + El) of a full expert tensor (its ETP slice of them), on the device.
  auto mine = [&](const Tensor& t, const TensorShard& slice = {}) {
    return on_test_device(shard_slice(t.slice(0, first, first + El).clone(MemCategory::parameters), slice));
  };
  MoeLayerWeights w;
  const Tensor router_d = on_test_device(router);
  w.router = {router_d, router_d};
  w.experts = {mine(fc1, fc1_slice(k, etp)), mine(fc2, fc2_slice(k, etp))};
  Run out;
  out.g.router = dev_zeros({E, H}, MemCategory::gradients);
  out.g.experts = {dev_zeros({El, 2 * F / etp, H}, MemCategory::gradients),
                   dev_zeros({El, H, F / etp}, MemCategory::gradients)};
  if (s.bias) {  // (the fc1 bias sliced like fc1's rows, the fc2 bias whole on every ETP rank)
    w.router.bias = on_test_device(rbias);
    w.experts.fc1_bias = mine(b1, {1, 2, k, static_cast<int>(etp)});
    w.experts.fc2_bias = mine(b2);
    out.g.router_bias = dev_zeros({E}, MemCategory::gradients);
    out.g.experts.fc1_bias = dev_zeros({El, 2 * F / etp}, MemCategory::gradients);
    out.g.experts.fc2_bias = dev_zeros({El, H}, MemCategory::gradients);
  }
  MoeLayerDims d{T, 1, H, F, 0, DType::f32};
  d.ep = ep;
  d.etp = etp;
  d.etp_rank = k;
  d.dispatcher = ep * etp == 1 ? DispatcherKind::local : kind;
  d.device = dev;
  const ExpertGroups groups = etp > 1 ? expert_groups(world, etp) : ExpertGroups{world.renamed("ep"), {}};
  const ProcessGroup ep_group = ep * etp == 1 ? comm_single("ep") : groups.ep;
  if (ep > 1) d.received_capacity = s.capacity;
  if (ep > 1 && s.echo.enabled()) {
    d.echo = s.echo;
    d.echo.group = &ep_group;
    d.echo.biases = s.bias;
  }
  MoeLayerCache cache = moe_layer_cache_alloc(d, s.cfg);
  RouterState st = router_state_init(s.cfg, dev);
  out.y = Tensor::empty({T, H}, DType::f32, MemCategory::activations, dev);
  out.dx = Tensor::empty({T, H}, DType::f32, MemCategory::activations, dev);
  const Tensor xd = on_test_device(x), dyd = on_test_device(dy);
  const ops::Context ctx{dev};
  LocalDispatcher local;
  AllToAllDispatcher a2a(ep_group, etp > 1 ? groups.etp : comm_single("etp"));
  AllGatherDispatcher ag(ep * etp == 1 ? comm_single("etp_ep") : world.renamed("etp_ep"), etp);
  Dispatcher* disp = ep * etp == 1                      ? static_cast<Dispatcher*>(&local)
                     : kind == DispatcherKind::alltoall ? static_cast<Dispatcher*>(&a2a)
                                                        : &ag;
  moe_layer_forward(out.y, xd, Tensor(), w, st, cache, *disp, d, s.cfg, true, ctx);
  out.stats = router_stats_host(cache.stats);
  if (d.echo.enabled()) out.echo = echo_stats_host(cache.echo, w.experts);
  out.overflow = moe_layer_overflowed(cache);
  moe_layer_backward(out.dx, out.g, dyd, xd, w, cache, *disp, d, s.cfg, 1.0f, ctx);
  return out;
}

// etp: the EP layer runs at EP = P / etp with every expert split over etp ranks.
void check_against_reference(const LayerCase& s, const ProcessGroup& world, DispatcherKind kind, int64_t etp = 1) {
  const int64_t P = world.size(), El = s.E / (P / etp), first = world.rank() / etp * El;
  const int k = static_cast<int>(world.rank() % etp);
  // The reference's gradient of this rank's experts, its ETP slice.
  auto mine = [&](const Tensor& g, const TensorShard& slice) {
    return shard_slice(host(g).slice(0, first, first + El).clone(), slice);
  };
  Run ref = run_layer(s, world, 1, kind);
  // The reference's expert and router gradients summed over the ranks (every rank's tokens contribute).
  all_reduce_sum(ref.g.router, world);
  all_reduce_sum(ref.g.experts.fc1, world);
  all_reduce_sum(ref.g.experts.fc2, world);
  if (s.bias) {
    all_reduce_sum(ref.g.router_bias, world);
    all_reduce_sum(ref.g.experts.fc1_bias, world);
    all_reduce_sum(ref.g.experts.fc2_bias, world);
  }
  Run ep = run_layer(s, world, P / etp, kind, etp);
  all_reduce_sum(ep.g.router, world);
  if (s.bias) {
    all_reduce_sum(ep.g.router_bias, world);
    expect_close(ep.g.router_bias, ref.g.router_bias, 1e-5, "router bias gradient");
    expect_close(ep.g.experts.fc1_bias, mine(ref.g.experts.fc1_bias, {1, 2, k, static_cast<int>(etp)}), 1e-5,
                 "fc1 bias gradient");
    expect_close(ep.g.experts.fc2_bias, mine(ref.g.experts.fc2_bias, {}), 1e-5, "fc2 bias gradient");
  }
  expect_close(ep.y, ref.y, 1e-5, "output");
  expect_close(ep.dx, ref.dx, 1e-5, "input gradient");
  expect_close(ep.g.router, ref.g.router, 1e-5, "router gradient");
  expect_close(ep.g.experts.fc1, mine(ref.g.experts.fc1, fc1_slice(k, etp)), 1e-5, "fc1 gradient");
  expect_close(ep.g.experts.fc2, mine(ref.g.experts.fc2, fc2_slice(k, etp)), 1e-5, "fc2 gradient");
  EXPECT_EQ(ep.stats.tokens_per_expert, ref.stats.tokens_per_expert);
  EXPECT_EQ(ep.stats.dropped, ref.stats.dropped);
  // Determinism: a second EP run is bitwise identical.
  Run again = run_layer(s, world, P / etp, kind, etp);
  all_reduce_sum(again.g.router, world);
  EXPECT_TRUE(bitwise_equal(again.y, ep.y));
  EXPECT_TRUE(bitwise_equal(again.dx, ep.dx));
  EXPECT_TRUE(bitwise_equal(again.g.experts.fc1, ep.g.experts.fc1));
  EXPECT_TRUE(bitwise_equal(again.g.router, ep.g.router));
}

LayerCase base() {
  LayerCase s;
  s.cfg.num_experts = s.E;
  s.cfg.router_topk = s.K;
  s.cfg.load_balancing_type = {LoadBalancing::aux_loss};
  s.cfg.aux_loss_coeff = {1e-2f};
  s.cfg.z_loss_coeff = 1e-3f;
  return s;
}

TEST_F(Mpi, AllToAllDroplessMatchesLocal) {
  check_against_reference(base(), world, DispatcherKind::alltoall);
}
TEST_F(Mpi, AllGatherDroplessMatchesLocal) {
  check_against_reference(base(), world, DispatcherKind::allgather);
}

TEST_F(Mpi, CapacityDroppingUnderEp) {
  for (auto kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    LayerCase s = base();
    s.cfg.capacity_factor = 1.0f;
    check_against_reference(s, world, kind);
    s.cfg.drop_policy = DropPolicy::position;
    check_against_reference(s, world, kind);
  }
}

TEST_F(Mpi, LinearBiasesUnderEp) {
  for (auto kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    LayerCase s = base();
    s.bias = true;
    check_against_reference(s, world, kind);  // dropless
    s.cfg.capacity_factor = 1.0f;
    s.cfg.pad_expert_input_to_capacity = true;
    check_against_reference(s, world, kind);  // zero-probability filler rows carry the fc1 bias, weight 0
  }
}

TEST_F(Mpi, PadToCapacityUnderEp) {
  for (auto kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    LayerCase s = base();
    s.cfg.capacity_factor = 1.5f;
    s.cfg.pad_expert_input_to_capacity = true;
    check_against_reference(s, world, kind);
  }
}

TEST_F(Mpi, EveryTokenToOneExpert) {
  for (auto kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    LayerCase s = base();
    s.routing = Routing::one_expert;
    // Only the last rank's experts receive rows; every other rank's experts sit idle.
    check_against_reference(s, world, kind);
  }
}

TEST_F(Mpi, RankThatSendsNothingToOthers) {
  for (auto kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    LayerCase s = base();
    s.routing = Routing::own_rank;  // rank r's tokens go to two experts that rank r owns
    check_against_reference(s, world, kind);
  }
}

// Expert tensor parallelism: EP = P / 2 with every expert's fc1 and fc2 split over 2 ranks (at 2 ranks: EP 1 x
// ETP 2). Dropless, with capacity dropping, with all tokens on one expert, and with linear biases (the fc2 bias added
// by ETP rank 0 alone, its gradient on every ETP rank).
TEST_F(Mpi, ExpertTensorParallelMatchesLocal) {
  for (auto kind : {DispatcherKind::alltoall, DispatcherKind::allgather}) {
    LayerCase s = base();
    check_against_reference(s, world, kind, 2);
    s.cfg.capacity_factor = 1.0f;
    check_against_reference(s, world, kind, 2);
    s.cfg.capacity_factor = 0.0f;
    s.routing = Routing::one_expert;
    check_against_reference(s, world, kind, 2);
    s = base();
    s.bias = true;
    check_against_reference(s, world, kind, 2);
  }
}

TEST_F(Mpi, BuffersForAnotherLayoutAreRejected) {
  LayerCase s = base();
  MoeLayerDims d{s.T, 1, s.H, s.F, 0, DType::f32};
  d.ep = 3;
  d.dispatcher = DispatcherKind::alltoall;
  d.device = testing::test_device();
  try {
    (void)moe_layer_cache_alloc(d, s.cfg);
    ADD_FAILURE() << "8 experts over EP 3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(8) must be divisible by --expert-model-parallel-size (3)"),
              std::string::npos)
        << e.what();
  }
}

// MoE ECHO: with clones of hot experts, the EP layer's output, input gradient and every gradient equal the run without
// ECHO (rtol 1e-6 of the largest value: a clone's weight gradient is summed apart from its home's, then added), on
// random routing, on routing forced onto one rank's experts, and with the debug mode's random clones; with biases,
// several slots per rank, and the clones fetched again in backward. Two ECHO runs are bitwise identical.
void check_echo_against_echo_off(LayerCase s, const ProcessGroup& world, const char* what) {
  SCOPED_TRACE(what);
  const EchoDims echo = s.echo;
  s.echo = {};
  const Run off = run_layer(s, world, world.size(), DispatcherKind::alltoall);
  s.echo = echo;
  const Run on = run_layer(s, world, world.size(), DispatcherKind::alltoall);
  expect_close(on.y, off.y, 1e-6, "output");
  expect_close(on.dx, off.dx, 1e-6, "input gradient");
  expect_close(on.g.router, off.g.router, 1e-6, "router gradient");
  expect_close(on.g.experts.fc1, off.g.experts.fc1, 1e-6, "fc1 gradient");
  expect_close(on.g.experts.fc2, off.g.experts.fc2, 1e-6, "fc2 gradient");
  if (s.bias) {
    expect_close(on.g.router_bias, off.g.router_bias, 1e-6, "router bias gradient");
    expect_close(on.g.experts.fc1_bias, off.g.experts.fc1_bias, 1e-6, "fc1 bias gradient");
    expect_close(on.g.experts.fc2_bias, off.g.experts.fc2_bias, 1e-6, "fc2 bias gradient");
  }
  EXPECT_EQ(on.stats.tokens_per_expert, off.stats.tokens_per_expert);
  if (!echo.random) {
    EXPECT_LE(on.echo.max_over_mean_after(), on.echo.max_over_mean_before());
  }
  const Run again = run_layer(s, world, world.size(), DispatcherKind::alltoall);
  EXPECT_TRUE(bitwise_equal(again.y, on.y));
  EXPECT_TRUE(bitwise_equal(again.dx, on.dx));
  EXPECT_TRUE(bitwise_equal(again.g.experts.fc1, on.g.experts.fc1));
  EXPECT_TRUE(bitwise_equal(again.g.experts.fc2, on.g.experts.fc2));
}

TEST_F(Mpi, EchoMatchesEchoOff) {
  const int P = world.size();
  LayerCase s = base();
  s.echo.slots = P;
  check_echo_against_echo_off(s, world, "random routing, one slot per rank");
  s.routing = Routing::one_expert;
  check_echo_against_echo_off(s, world, "every token to the last rank's experts");
  {
    // The hot rank's load is spread: every other rank runs a clone.
    const moe::Run r = run_layer(s, world, P, DispatcherKind::alltoall);
    EXPECT_EQ(r.echo.clones, P - 1);
    EXPECT_DOUBLE_EQ(r.echo.max_over_mean_before(), static_cast<double>(P));
    EXPECT_LT(r.echo.max_over_mean_after(), 1.0 + 1.0 / P);
    EXPECT_EQ(r.echo.weight_bytes, (P - 1) * int64_t{3} * s.F * s.H * 4);
  }
  {
    // Top-1 routing with every token on one expert: its clones on every other rank take the load down to the average.
    LayerCase one = s;
    one.cfg.router_topk = 1;
    one.cfg.pre_softmax = true;
    check_echo_against_echo_off(one, world, "every token to one expert (top-1)");
    const moe::Run r = run_layer(one, world, P, DispatcherKind::alltoall);
    EXPECT_EQ(r.stats.tokens_per_expert[static_cast<size_t>(s.E - 2)], s.T);
    EXPECT_EQ(r.echo.clones, P - 1);
    EXPECT_DOUBLE_EQ(r.echo.max_over_mean_after(), 1.0);
  }
  s.echo.slots = 2 * P;
  check_echo_against_echo_off(s, world, "two slots per rank");
  s.echo.recompute_dispatch = true;
  check_echo_against_echo_off(s, world, "clones fetched again in backward");
  s = base();
  s.echo.slots = 2 * P;
  s.echo.random = true;
  check_echo_against_echo_off(s, world, "random clones (debug mode)");
  {
    const moe::Run r = run_layer(s, world, P, DispatcherKind::alltoall);
    EXPECT_GT(r.echo.clones, 0);
  }
  s.bias = true;
  check_echo_against_echo_off(s, world, "random clones with linear biases");
}

// The static received-token capacity: buffers for 1.25 x the average received rows. Every token routed to the last
// rank's experts overflows it there (the flag is set on that rank alone, its rows dropped: the routed output is zero);
// with ECHO the clones spread the load and nothing overflows, the result equal to the dropless layer. A capacity above
// any load changes nothing, bitwise.
TEST_F(Mpi, ReceivedTokenCapacityOverflowsOnlyWhereTheLoadExceedsIt) {
  const int P = world.size();
  LayerCase s = base();
  s.routing = Routing::one_expert;
  const moe::Run dropless = run_layer(s, world, P, DispatcherKind::alltoall);
  s.capacity = 1.25f;
  const moe::Run over = run_layer(s, world, P, DispatcherKind::alltoall);
  EXPECT_EQ(over.overflow, me == P - 1);
  EXPECT_FALSE(dropless.overflow);
  if (me == P - 1) {
    EXPECT_FALSE(bitwise_equal(over.y, dropless.y));
  }
  s.echo.slots = P;
  const moe::Run echo = run_layer(s, world, P, DispatcherKind::alltoall);
  EXPECT_FALSE(echo.overflow);
  expect_close(echo.y, dropless.y, 1e-6, "output with ECHO at capacity 1.25");
  expect_close(echo.dx, dropless.dx, 1e-6, "input gradient with ECHO at capacity 1.25");
  expect_close(echo.g.experts.fc1, dropless.g.experts.fc1, 1e-6, "fc1 gradient with ECHO at capacity 1.25");
  s = base();
  const moe::Run plain = run_layer(s, world, P, DispatcherKind::alltoall);
  s.capacity = static_cast<float>(P);
  const moe::Run roomy = run_layer(s, world, P, DispatcherKind::alltoall);
  EXPECT_FALSE(roomy.overflow);
  EXPECT_TRUE(bitwise_equal(roomy.y, plain.y));
  EXPECT_TRUE(bitwise_equal(roomy.dx, plain.dx));
  EXPECT_TRUE(bitwise_equal(roomy.g.experts.fc1, plain.g.experts.fc1));
}

TEST_F(Mpi, EchoNeedsTheAllToAllDispatcherAndDroplessRouting) {
  LayerCase s = base();
  MoeLayerDims d{s.T, 1, s.H, s.F, 0, DType::f32};
  d.ep = world.size();
  d.dispatcher = DispatcherKind::allgather;
  d.device = testing::test_device();
  const ProcessGroup ep = world.renamed("ep");
  d.echo.slots = world.size();
  d.echo.group = &ep;
  EXPECT_THROW((void)moe_layer_cache_alloc(d, s.cfg), Error);
  d.dispatcher = DispatcherKind::alltoall;
  s.cfg.capacity_factor = 1.0f;
  EXPECT_THROW((void)moe_layer_cache_alloc(d, s.cfg), Error);
  s.cfg.capacity_factor = 0.0f;
  d.echo.slots = world.size() + 1;
  EXPECT_THROW((void)moe_layer_cache_alloc(d, s.cfg), Error);
}

// global_aux_loss under data parallelism (docs/megatron-moe-spec.md §3.3): each rank's loss uses the counts and token
// count summed over the group, so the ranks' losses and router gradients add up to the single-process loss and gradient
// over all their tokens.
TEST_F(Mpi, GlobalAuxLossCountsAreSummedOverTheGroup) {
  const int64_t T = 24, H = 16, E = 8, K = 2;
  MoeConfig cfg;
  cfg.num_experts = E;
  cfg.router_topk = K;
  cfg.load_balancing_type = {LoadBalancing::global_aux_loss};
  cfg.aux_loss_coeff = {1e-2f};
  Tensor w = Tensor::empty({E, H}, DType::f32, MemCategory::parameters);
  rng_fill_normal(w, 3, "router", 0.0f, 0.5f);
  Tensor x_all = Tensor::empty({P * T, H}, DType::f32, MemCategory::activations);
  rng_fill_normal(x_all, 3, "x", 0.0f, 1.0f);
  const Tensor x = x_all.slice(0, me * T, (me + 1) * T).clone();
  const Device dev = testing::test_device();
  const ops::Context ctx{dev};
  const Tensor wd = on_test_device(w);
  const RouterWeights rw{wd, wd};
  auto route = [&](const Tensor& xs, int64_t n, const ProcessGroup* g, double& loss, Tensor& dw) {
    const RouterDims d{n, 1, H, E, K, g};
    RouterCache c = router_cache_alloc(d, cfg, DType::f32, dev);
    RouterState st = router_state_init(cfg, dev);
    Tensor probs = Tensor::empty({n, E}, DType::f32, MemCategory::activations, dev);
    Tensor map = Tensor::empty({n, E}, DType::boolean, MemCategory::activations, dev);
    RouterStats stats = router_stats_alloc(E, dev);
    const Tensor xd = on_test_device(xs);
    router_forward(probs, map, stats, xd, Tensor(), rw, st, c, d, cfg, true, ctx);
    loss = router_stats_host(stats).global_aux_loss;
    Tensor dprobs = dev_zeros({n, E}, MemCategory::other), dx = dev_zeros({n, H}, MemCategory::other);
    dw = dev_zeros({E, H}, MemCategory::other);
    router_backward(dx, dw, dprobs, xd, rw, c, d, cfg, 1.0f, ctx);
  };
  double loss_all = 0, loss_mine = 0;
  Tensor dw_all, dw_mine;
  route(x_all, P * T, nullptr, loss_all, dw_all);
  route(x, T, &world, loss_mine, dw_mine);
  std::vector<double> sum = {loss_mine};
  all_reduce_sum(sum, world);
  all_reduce_sum(dw_mine, world);
  EXPECT_NEAR(sum[0], loss_all, 1e-12 * loss_all);
  expect_close(dw_mine, dw_all, 1e-6, "router weight gradient of the global aux loss");
  // Without the group each rank normalises by its own counts: the sum is a different number.
  double alone = 0;
  Tensor dw_alone;
  route(x, T, nullptr, alone, dw_alone);
  std::vector<double> sum_alone = {alone};
  all_reduce_sum(sum_alone, world);
  EXPECT_GT(std::fabs(sum_alone[0] - loss_all), 1e-6 * loss_all);
}

}  // namespace
}  // namespace moecore::moe

int main(int argc, char** argv) {
  return moecore::testing_mpi::run_mpi_tests(argc, argv, 30, /*debug=*/true);
}
