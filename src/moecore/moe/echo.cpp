// MoE ECHO in the layer: plan and rerouting (ops), the alltoall expert dispatcher and the clone-gradient reduction
// (point to point over the EP group, in slot order, so every sum is deterministic).
#include "moecore/moe/echo.h"

#include <algorithm>
#include <type_traits>

#include "moecore/core/error.h"
#include "moecore/moe/dispatcher.h"

namespace moecore::moe {
namespace {

// The tensors of one expert (index i along dim 0) of a weight or gradient set, in a fixed order: fc1, fc2 and the
// biases when defined.
std::vector<Tensor> expert_parts(const Tensor& fc1, const Tensor& fc2, const Tensor& b1, const Tensor& b2, int64_t i) {
  std::vector<Tensor> v = {fc1.slice(0, i, i + 1), fc2.slice(0, i, i + 1)};
  if (b1.defined()) {
    v.push_back(b1.slice(0, i, i + 1));
    v.push_back(b2.slice(0, i, i + 1));
  }
  return v;
}
std::vector<Tensor> parts(const ExpertWeights& w, int64_t i) {
  return expert_parts(w.fc1, w.fc2, w.fc1_bias, w.fc2_bias, i);
}
std::vector<Tensor> parts(const ExpertGrads& g, int64_t i) {
  return expert_parts(g.fc1, g.fc2, g.fc1_bias, g.fc2_bias, i);
}

ExpertGrads grads_alloc(int64_t n, const ExpertDims& e, bool biases, MemCategory cat) {
  ExpertGrads g;
  g.fc1 = Tensor::zeros({n, e.fc1_rows(), e.H}, DType::f32, cat, e.device);
  g.fc2 = Tensor::zeros({n, e.H, e.F}, DType::f32, cat, e.device);
  if (biases) {
    g.fc1_bias = Tensor::zeros({n, e.fc1_rows()}, DType::f32, cat, e.device);
    g.fc2_bias = Tensor::zeros({n, e.H}, DType::f32, cat, e.device);
  }
  return g;
}

double max_over_mean(const std::vector<int64_t>& v) {
  int64_t sum = 0, mx = 0;
  for (int64_t x : v) sum += x, mx = std::max(mx, x);
  return sum == 0 ? 0.0 : static_cast<double>(mx) * static_cast<double>(v.size()) / static_cast<double>(sum);
}

}  // namespace

void echo_check_dispatcher_type(const std::string& s) {
  if (s == "alltoall") return;
  if (s == "hybridep")
    MOECORE_FAIL("--moe-echo-expert-dispatcher-type hybridep: Megatron's device-side (sync-free) dispatcher needs ",
                 "the GPU backend, which moecore does not have yet; use alltoall");
  MOECORE_FAIL("--moe-echo-expert-dispatcher-type: expected alltoall (or hybridep on GPU), got '", s, "'");
}

void echo_check_layout(int64_t slots, float received_capacity, int64_t ep, int64_t etp, DispatcherKind dispatcher,
                       const MoeConfig& cfg) {
  if (received_capacity > 0 && (ep < 2 || dispatcher != DispatcherKind::alltoall || etp != 1))
    MOECORE_FAIL("--moe-received-token-capacity / --moe-expert-rank-capacity-factor (", received_capacity,
                 ") sizes what each expert-parallel rank receives: it needs --expert-model-parallel-size > 1, "
                 "--moe-token-dispatcher-type alltoall and --expert-tensor-parallel-size 1; got EP ",
                 ep, ", ", dispatcher_kind_name(dispatcher), ", ETP ", etp);
  if (slots <= 0) return;
  if (ep < 2)
    MOECORE_FAIL(
        "--moe-enable-echo clones experts onto other expert-parallel ranks: it needs "
        "--expert-model-parallel-size > 1, got ",
        ep);
  if (slots % ep != 0)
    MOECORE_FAIL("--moe-num-echo-experts (", slots, ") must be divisible by --expert-model-parallel-size (", ep,
                 "): every EP rank holds the same number of clone slots");
  if (dispatcher != DispatcherKind::alltoall)
    MOECORE_FAIL("--moe-enable-echo needs --moe-token-dispatcher-type alltoall, got ",
                 dispatcher_kind_name(dispatcher));
  if (etp != 1)
    MOECORE_FAIL("--moe-enable-echo with --expert-tensor-parallel-size ", etp,
                 " is not supported yet (clones of expert slices); use ETP 1");
  if (cfg.capacity_factor > 0 || cfg.router_padding_alignment > 0)
    MOECORE_FAIL("--moe-enable-echo is dropless: it does not combine with --moe-expert-capacity-factor (",
                 cfg.capacity_factor, ") or --moe-router-padding-for-fp8");
}

void echo_check_layout(const MoeConfig& cfg, int64_t ep, int64_t etp, DispatcherKind dispatcher) {
  echo_check_layout(cfg.enable_echo ? cfg.num_echo_experts : 0, cfg.received_token_capacity, ep, etp, dispatcher, cfg);
}

EchoCache echo_cache_alloc(const EchoDims& d, int64_t T, int64_t E, const ExpertDims& home) {
  MOECORE_CHECK(d.group != nullptr && d.enabled(), "echo_cache_alloc: ECHO needs its EP group and slots");
  EchoCache c;
  c.ep = d.group->size();
  c.rank = d.group->rank();
  MOECORE_CHECK(c.ep > 1 && d.slots % c.ep == 0 && E % c.ep == 0, "echo_cache_alloc: ", d.slots, " slots and ", E,
                " experts over EP ", c.ep, " (echo_check_layout refuses this layout)");
  c.El = E / c.ep;
  c.Sl = d.slots / c.ep;
  c.recompute_dispatch = d.recompute_dispatch;
  const int64_t S = d.slots, W = c.ep * (c.El + c.Sl);
  const MemCategory act = MemCategory::activations, ws = MemCategory::workspace;
  c.counts = Tensor::zeros({c.ep, E}, DType::i64, act, home.device);
  c.slot_expert = Tensor::zeros({S}, DType::i64, act, home.device);
  c.slot_tokens = Tensor::zeros({c.ep, S}, DType::i64, act, home.device);
  c.loads = Tensor::zeros({2, c.ep}, DType::i64, act, home.device);
  c.map = Tensor::zeros({T, W}, DType::boolean, act, home.device);
  c.probs = Tensor::zeros({T, W}, DType::f32, act, home.device);
  c.dprobs = Tensor::zeros({T, W}, DType::f32, ws, home.device);
  c.clones.fc1 = Tensor::zeros({c.Sl, home.fc1_rows(), home.H}, home.compute, act, home.device);
  c.clones.fc2 = Tensor::zeros({c.Sl, home.H, home.F}, home.compute, act, home.device);
  if (d.biases) {
    c.clones.fc1_bias = Tensor::zeros({c.Sl, home.fc1_rows()}, DType::f32, act, home.device);
    c.clones.fc2_bias = Tensor::zeros({c.Sl, home.H}, DType::f32, act, home.device);
  }
  c.clone_grads = grads_alloc(c.Sl, home, d.biases, ws);
  c.grad_in = grads_alloc(1, home, d.biases, ws);
  c.slot_expert_host.assign(static_cast<size_t>(S), -1);
  c.fetches = std::make_shared<std::vector<CommHandle>>();
  c.fetches->reserve(static_cast<size_t>(4 * S));
  return c;
}

namespace {
template <class Cache>  // EchoCache, const or not
auto scratch_of(Cache& c) {
  using T = std::conditional_t<std::is_const_v<Cache>, const Tensor, Tensor>;
  std::vector<T*> v = {
      &c.dprobs,      &c.clone_grads.fc1, &c.clone_grads.fc2,  &c.clone_grads.fc1_bias, &c.clone_grads.fc2_bias,
      &c.grad_in.fc1, &c.grad_in.fc2,     &c.grad_in.fc1_bias, &c.grad_in.fc2_bias};
  if (c.recompute_dispatch)
    for (T* t : {&c.clones.fc1, &c.clones.fc2, &c.clones.fc1_bias, &c.clones.fc2_bias}) v.push_back(t);
  return v;
}
}  // namespace

std::vector<Tensor*> echo_scratch_tensors(EchoCache& c) {
  return scratch_of(c);
}
std::vector<const Tensor*> echo_scratch_tensors(const EchoCache& c) {
  return scratch_of(c);
}

std::vector<const Tensor*> echo_routing_tensors(const EchoCache& c) {
  return {&c.counts, &c.slot_expert, &c.slot_tokens, &c.loads, &c.map, &c.probs};
}

std::vector<const Tensor*> echo_refilled_tensors(const EchoCache& c) {
  if (c.recompute_dispatch) return {};
  return {&c.clones.fc1, &c.clones.fc2, &c.clones.fc1_bias, &c.clones.fc2_bias};
}

void echo_plan(EchoCache& c, const Tensor& counts, const Tensor& map, const Tensor& probs, const EchoDims& d,
               const ops::Context& ctx) {
  all_gather(c.counts, counts, *d.group);
  // The debug mode draws a fresh random plan per layer and forward, the same on every rank.
  const uint64_t seed = d.random ? (d.seed * 0x9E3779B97F4A7C15ull) ^ (c.plans + 1) : 0;
  ++c.plans;
  ops::moe_echo_plan(c.slot_expert, c.slot_tokens, c.loads, c.counts, c.Sl, seed, ctx);
  ops::moe_echo_reroute(c.map, c.probs, map, probs, c.slot_expert, c.slot_tokens, c.rank, c.Sl, ctx);
  c.slot_expert.copy_to_host(c.slot_expert_host.data(), static_cast<int64_t>(c.slot_expert_host.size()));
}

void echo_fetch_clones_start(EchoCache& c, const ExpertWeights& home, const EchoDims& d) {
  const ProcessGroup& g = *d.group;
  MOECORE_CHECK(c.fetches && c.fetches->empty(), "echo_fetch_clones_start: a fetch is still in flight");
  std::vector<CommHandle>& pending = *c.fetches;
  for (size_t j = 0; j < c.slot_expert_host.size(); ++j) {
    const int64_t e = c.slot_expert_host[j];
    if (e < 0) continue;
    const int from = static_cast<int>(e / c.El), to = static_cast<int>(static_cast<int64_t>(j) / c.Sl);
    MOECORE_CHECK(from != to, "echo_fetch_clones: slot ", j, " clones expert ", e, " of its own rank");
    if (to == g.rank())
      for (Tensor& t : parts(c.clones, static_cast<int64_t>(j) % c.Sl)) pending.push_back(irecv(t, from, g));
    if (from == g.rank())
      for (const Tensor& t : parts(home, e % c.El)) pending.push_back(isend(t, to, g));
  }
}

void echo_fetch_clones_wait(EchoCache& c) {
  for (CommHandle& h : *c.fetches) h.wait();
  c.fetches->clear();
}

void echo_reduce_clone_grads(ExpertGrads& home, EchoCache& c, const EchoDims& d, const ops::Context& ctx) {
  const ProcessGroup& g = *d.group;
  MOECORE_CHECK(c.fetches->empty(), "echo_reduce_clone_grads: a clone fetch is still in flight");
  std::vector<CommHandle>& sends = *c.fetches;  // (the fetch's handle buffer, free now)
  for (size_t j = 0; j < c.slot_expert_host.size(); ++j) {
    const int64_t e = c.slot_expert_host[j];
    if (e >= 0 && static_cast<int64_t>(j) / c.Sl == g.rank())
      for (const Tensor& t : parts(c.clone_grads, static_cast<int64_t>(j) % c.Sl))
        sends.push_back(isend(t, static_cast<int>(e / c.El), g));
  }
  // Home: the clones' gradients in slot order, each added once it arrives.
  const std::vector<Tensor> in = parts(c.grad_in, 0);
  for (size_t j = 0; j < c.slot_expert_host.size(); ++j) {
    const int64_t e = c.slot_expert_host[j];
    if (e < 0 || e / c.El != g.rank()) continue;
    const int from = static_cast<int>(static_cast<int64_t>(j) / c.Sl);
    std::vector<Tensor> dst = parts(home, e % c.El);
    for (size_t i = 0; i < in.size(); ++i) {
      recv(in[i], from, g);
      ops::add(dst[i], dst[i], in[i], ctx);
    }
  }
  for (CommHandle& h : sends) h.wait();
  sends.clear();
}

int64_t echo_home_rows(const DispatchBuffers& b, const EchoCache& c) {
  const AllToAllState* s = std::get_if<AllToAllState>(&b.state);
  MOECORE_CHECK(s, "echo_home_rows: needs the alltoall dispatcher's state");
  const AllToAllState& p = *s;
  MOECORE_CHECK(p.etp == 1 && static_cast<int64_t>(p.chunk_counts_host.size()) == p.ep * (c.El + c.Sl),
                "echo_home_rows: needs the alltoall dispatcher's host counts over El + Sl local experts");
  int64_t n = 0;
  for (int64_t s = 0; s < p.ep; ++s)
    for (int64_t le = 0; le < c.El; ++le) n += p.chunk_counts_host[static_cast<size_t>(s * (c.El + c.Sl) + le)];
  return n;
}

EchoStatsHost echo_stats_host(const EchoCache& c, const ExpertWeights& home) {
  EchoStatsHost s;
  std::vector<int64_t> loads(static_cast<size_t>(2 * c.ep));
  c.loads.copy_to_host(loads.data(), 2 * c.ep);
  s.before.assign(loads.begin(), loads.begin() + c.ep);
  s.after.assign(loads.begin() + c.ep, loads.end());
  int64_t per_clone = 0;
  for (const Tensor& t : parts(home, 0)) per_clone += t.nbytes();
  for (int64_t e : c.slot_expert_host) s.clones += e >= 0;
  s.weight_bytes = s.clones * per_clone;
  return s;
}

double EchoStatsHost::max_over_mean_before() const {
  return max_over_mean(before);
}
double EchoStatsHost::max_over_mean_after() const {
  return max_over_mean(after);
}

}  // namespace moecore::moe
