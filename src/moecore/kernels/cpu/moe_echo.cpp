// CPU kernels of MoE ECHO (ops.h, "MoE ECHO"): the clone planner, the local rerouting of tokens to clone columns and
// its fold. The planner's arithmetic (kernels/moe_echo_plan.h) is the CUDA kernel's too: one thread, integers, the same
// plan on every rank and backend. On a cuda context each op dispatches to kernels/cuda/moe_echo.cu after the checks
// that read no tensor data.
#include <algorithm>

#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/moe_echo_plan.h"

namespace moecore::ops {
namespace {

struct Layout {
  int64_t P = 1, E = 0, El = 0, Sl = 0;
  int64_t S() const { return P * Sl; }
  int64_t columns() const { return P * (El + Sl); }
  int64_t home_column(int64_t e) const { return e / El * (El + Sl) + e % El; }
  int64_t slot_column(int64_t j) const { return j / Sl * (El + Sl) + El + j % Sl; }
};

Layout layout_of(const cpu::Checker& ck, int64_t P, int64_t E, int64_t slots_per_rank) {
  if (P < 1 || E < 1 || E % P != 0 || slots_per_rank < 1)
    ck.fail("need P >= 1 ranks, E >= 1 experts divisible by P and slots_per_rank >= 1; got P ", P, ", E ", E,
            ", slots_per_rank ", slots_per_rank);
  return {P, E, E / P, slots_per_rank};
}

}  // namespace

void moe_echo_plan(Tensor& slot_expert, Tensor& slot_tokens, Tensor& loads, const Tensor& counts,
                   int64_t slots_per_rank, uint64_t seed, const Context& ctx) {
  const cpu::Checker ck(
      "moe_echo_plan", ctx,
      {{"slot_expert", &slot_expert}, {"slot_tokens", &slot_tokens}, {"loads", &loads}, {"counts", &counts}},
      cpu::Backends::cpu_and_cuda);
  ck.rank("counts", 2);
  ck.dtype("counts", DType::i64);
  ck.contiguous("counts");
  const Layout L = layout_of(ck, counts.size(0), counts.size(1), slots_per_rank);
  const int64_t S = L.S();
  for (const char* n : {"slot_expert", "slot_tokens", "loads"}) {
    ck.dtype(n, DType::i64);
    ck.contiguous(n);
  }
  ck.shape("slot_expert", Shape{S});
  ck.shape("slot_tokens", Shape{L.P, S});
  ck.shape("loads", Shape{2, L.P});
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::moe_echo_plan(slot_expert, slot_tokens, loads, counts, slots_per_rank, seed, ctx);
  const int64_t* C = counts.data<int64_t>();
  for (int64_t i = 0; i < L.P * L.E; ++i)
    if (C[i] < 0) ck.fail("counts must be >= 0, got ", C[i], " at [", i / L.E, ", ", i % L.E, "]");
  std::vector<int64_t> scratch(static_cast<size_t>(echo_plan::scratch_words(L.P, L.E, S)));
  const PhiloxKey key = philox_key(seed, "moe_echo_random_plan");
  echo_plan::plan(
      slot_expert.data<int64_t>(), slot_tokens.data<int64_t>(), loads.data<int64_t>(), C, L.P, L.E, L.Sl, seed != 0,
      [&](uint64_t i) { return philox_uniform(key, i); }, scratch.data());
}

void moe_echo_reroute(Tensor& map2, Tensor& probs2, const Tensor& map, const Tensor& probs, const Tensor& slot_expert,
                      const Tensor& slot_tokens, int64_t rank, int64_t slots_per_rank, const Context& ctx) {
  const cpu::Checker ck("moe_echo_reroute", ctx,
                        {{"map2", &map2},
                         {"probs2", &probs2},
                         {"map", &map},
                         {"probs", &probs},
                         {"slot_expert", &slot_expert},
                         {"slot_tokens", &slot_tokens}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("slot_tokens", 2);
  ck.rank("map", 2);
  const int64_t T = map.size(0), E = map.size(1);
  const Layout L = layout_of(ck, slot_tokens.size(0), E, slots_per_rank);
  if (rank < 0 || rank >= L.P) ck.fail("rank ", rank, " outside [0, ", L.P, ")");
  ck.dtype("map", DType::boolean);
  ck.dtype("map2", DType::boolean);
  ck.dtype("probs", DType::f32);
  ck.dtype("probs2", DType::f32);
  ck.shape("probs", Shape{T, E});
  ck.shape("map2", Shape{T, L.columns()});
  ck.shape("probs2", Shape{T, L.columns()});
  ck.shape("slot_expert", Shape{L.S()});
  ck.shape("slot_tokens", Shape{L.P, L.S()});
  for (const char* n : {"map2", "probs2", "map", "probs", "slot_expert", "slot_tokens"}) ck.contiguous(n);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::moe_echo_reroute(map2, probs2, map, probs, slot_expert, slot_tokens, rank, slots_per_rank, ctx);
  const int64_t S = L.S(), W = L.columns();
  const bool* m = map.data<bool>();
  const float* p = probs.data<float>();
  bool* m2 = map2.data<bool>();
  float* p2 = probs2.data<float>();
  const int64_t* se = slot_expert.data<int64_t>();
  const int64_t* quota = slot_tokens.data<int64_t>() + rank * S;
  std::fill(m2, m2 + T * W, false);
  std::fill(p2, p2 + T * W, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      m2[t * W + L.home_column(e)] = m[t * E + e];
      p2[t * W + L.home_column(e)] = p[t * E + e];
    }
  for (int64_t j = 0; j < S; ++j) {
    if (se[j] < -1 || se[j] >= E) ck.fail("slot_expert[", j, "] = ", se[j], " is not an expert or -1");
    if (quota[j] < 0 || (se[j] < 0 && quota[j] != 0))
      ck.fail("slot_tokens[", rank, ", ", j, "] = ", quota[j], " for a slot of expert ", se[j]);
  }
  // Per expert, its slots in ascending order take consecutive runs of the expert's tokens.
  for (int64_t e = 0; e < E; ++e) {
    int64_t t = 0;
    const int64_t he = L.home_column(e);
    for (int64_t j = 0; j < S; ++j) {
      if (se[j] != e) continue;
      const int64_t sc = L.slot_column(j);
      for (int64_t n = quota[j]; n > 0; ++t) {
        if (t == T)
          ck.fail("slot ", j, " asks rank ", rank, " for ", quota[j], " tokens of expert ", e, ", more than it routes");
        if (!m[t * E + e]) continue;
        m2[t * W + he] = false;
        p2[t * W + he] = 0.0f;
        m2[t * W + sc] = true;
        p2[t * W + sc] = p[t * E + e];
        --n;
      }
    }
  }
}

void moe_echo_fold(Tensor& out, const Tensor& in, const Tensor& slot_expert, int64_t slots_per_rank,
                   const Context& ctx) {
  const cpu::Checker ck("moe_echo_fold", ctx, {{"out", &out}, {"in", &in}, {"slot_expert", &slot_expert}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("out", 2);
  ck.rank("in", 2);
  ck.rank("slot_expert", 1);
  ck.same_dtype("in", "out");
  if (out.dtype() != DType::f32 && out.dtype() != DType::boolean)
    ck.fail("out must be f32 or bool, got ", dtype_name(out.dtype()));
  ck.dtype("slot_expert", DType::i64);
  const int64_t T = out.size(0), E = out.size(1), S = slot_expert.numel();
  if (slots_per_rank < 1 || S % slots_per_rank != 0) ck.fail("slot_expert has ", S, " slots, not P x ", slots_per_rank);
  const Layout L = layout_of(ck, S / slots_per_rank, E, slots_per_rank);
  ck.shape("in", Shape{T, L.columns()});
  for (const char* n : {"out", "in", "slot_expert"}) ck.contiguous(n);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_echo_fold(out, in, slot_expert, slots_per_rank, ctx);
  const int64_t* se = slot_expert.data<int64_t>();
  for (int64_t j = 0; j < S; ++j)
    if (se[j] < -1 || se[j] >= E) ck.fail("slot_expert[", j, "] = ", se[j], " is not an expert or -1");
  const int64_t W = L.columns();
  auto fold = [&](auto* o, const auto* i, auto add) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) o[t * E + e] = i[t * W + L.home_column(e)];
      for (int64_t j = 0; j < S; ++j)
        if (se[j] >= 0) o[t * E + se[j]] = add(o[t * E + se[j]], i[t * W + L.slot_column(j)]);
    }
  };
  if (out.dtype() == DType::f32)
    fold(out.data<float>(), in.data<float>(), [](float a, float b) { return a + b; });
  else
    fold(out.data<bool>(), in.data<bool>(), [](bool a, bool b) { return a || b; });
}

}  // namespace moecore::ops
