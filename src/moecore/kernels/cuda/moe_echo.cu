// CUDA kernels of MoE ECHO (ops.h, "MoE ECHO"): the planner in one thread (kernels/moe_echo_plan.h, the CPU's
// arithmetic, so the plan is the CPU's bit for bit), the rerouting (the home columns copied element-wise, then one
// thread per expert walks its tokens in order) and the fold (per (token, expert), slots ascending); every
// element-wise kernel is a grid-stride loop, as grid_for caps the grid.
// Device contract (ops_cuda.h): slot_expert entries outside [-1, E) count as empty slots, and a slot asking a rank
// for more tokens than it routes takes those it has, instead of raising.
#include <type_traits>

#include "moecore/core/rng.h"
#include "moecore/kernels/cuda/cuda_util.cuh"
#include "moecore/kernels/cuda/ops_cuda.h"
#include "moecore/kernels/moe_echo_plan.h"

namespace moecore::ops::cuda {
namespace {

struct DeviceUniform {
  uint32_t key0, key1;
  __device__ float operator()(uint64_t i) const { return philox_uniform_dev(key0, key1, i); }
};

__global__ void echo_plan_kernel(int64_t* slot_expert, int64_t* slot_tokens, int64_t* loads, const int64_t* counts,
                                 int64_t P, int64_t E, int64_t Sl, bool random, DeviceUniform uniform,
                                 int64_t* scratch) {
  echo_plan::plan(slot_expert, slot_tokens, loads, counts, P, E, Sl, random, uniform, scratch);
}

struct Columns {
  int64_t E, El, Sl;
  __device__ int64_t home(int64_t e) const { return e / El * (El + Sl) + e % El; }
  __device__ int64_t slot(int64_t j) const { return j / Sl * (El + Sl) + El + j % Sl; }
};

// Every entry of map2 / probs2 from its home column, clone columns empty.
__global__ void echo_home_columns_kernel(bool* map2, float* probs2, const bool* map, const float* probs, int64_t T,
                                         int64_t W, Columns c) {
  MOECORE_GRID_STRIDE(i, T * W) {
    const int64_t t = i / W, col = i % W, block = col / (c.El + c.Sl), within = col % (c.El + c.Sl);
    const bool home = within < c.El;
    const int64_t e = block * c.El + within;
    map2[i] = home && map[t * c.E + e];
    probs2[i] = home ? probs[t * c.E + e] : 0.0f;
  }
}

// Expert e's slots, ascending, take consecutive runs of its tokens (ascending).
__global__ void echo_move_kernel(bool* map2, float* probs2, const bool* map, const float* probs,
                                 const int64_t* slot_expert, const int64_t* quota, int64_t T, int64_t W, int64_t S,
                                 Columns c) {
  MOECORE_GRID_STRIDE(e, c.E) {
    const int64_t he = c.home(e);
    int64_t t = 0;
    for (int64_t j = 0; j < S; ++j) {
      if (slot_expert[j] != e) continue;
      const int64_t sc = c.slot(j);
      for (int64_t n = quota[j]; n > 0 && t < T; ++t) {
        if (!map[t * c.E + e]) continue;
        map2[t * W + he] = false;
        probs2[t * W + he] = 0.0f;
        map2[t * W + sc] = true;
        probs2[t * W + sc] = probs[t * c.E + e];
        --n;
      }
    }
  }
}

template <class V>
__global__ void echo_fold_kernel(V* out, const V* in, const int64_t* slot_expert, int64_t T, int64_t W, int64_t S,
                                 Columns c) {
  MOECORE_GRID_STRIDE(i, T * c.E) {
    const int64_t t = i / c.E, e = i % c.E;
    V v = in[t * W + c.home(e)];
    for (int64_t j = 0; j < S; ++j)
      if (slot_expert[j] == e) {
        if constexpr (std::is_same_v<V, bool>)
          v = v || in[t * W + c.slot(j)];
        else
          v = v + in[t * W + c.slot(j)];
      }
    out[i] = v;
  }
}

}  // namespace

void moe_echo_plan(Tensor& slot_expert, Tensor& slot_tokens, Tensor& loads, const Tensor& counts,
                   int64_t slots_per_rank, uint64_t seed, const Context& ctx) {
  const Launch l(
      "moe_echo_plan", ctx,
      {{"slot_expert", &slot_expert}, {"slot_tokens", &slot_tokens}, {"loads", &loads}, {"counts", &counts}});
  const int64_t P = counts.size(0), E = counts.size(1), S = P * slots_per_rank;
  const int64_t words = echo_plan::scratch_words(P, E, S);
  WorkspaceCarver w;
  w.reserve<int64_t>(words);
  w.allocate(l);
  int64_t* scratch = w.take<int64_t>(words);
  const PhiloxKey key = philox_key(seed, "moe_echo_random_plan");
  echo_plan_kernel<<<1, 1, 0, l.stream()>>>(Launch::ptr<int64_t>(slot_expert), Launch::ptr<int64_t>(slot_tokens),
                                            Launch::ptr<int64_t>(loads), Launch::ptr<const int64_t>(counts), P, E,
                                            slots_per_rank, seed != 0, DeviceUniform{key[0], key[1]}, scratch);
  l.launched("echo_plan_kernel");
}

void moe_echo_reroute(Tensor& map2, Tensor& probs2, const Tensor& map, const Tensor& probs, const Tensor& slot_expert,
                      const Tensor& slot_tokens, int64_t rank, int64_t slots_per_rank, const Context& ctx) {
  const Launch l("moe_echo_reroute", ctx,
                 {{"map2", &map2},
                  {"probs2", &probs2},
                  {"map", &map},
                  {"probs", &probs},
                  {"slot_expert", &slot_expert},
                  {"slot_tokens", &slot_tokens}});
  const int64_t T = map.size(0), E = map.size(1), P = slot_tokens.size(0), S = slot_tokens.size(1);
  const int64_t W = map2.size(1);
  const Columns c{E, E / P, slots_per_rank};
  if (T * W > 0)
    echo_home_columns_kernel<<<grid_for(T * W), kThreads, 0, l.stream()>>>(
        Launch::ptr<bool>(map2), Launch::ptr<float>(probs2), Launch::ptr<const bool>(map),
        Launch::ptr<const float>(probs), T, W, c);
  l.launched("echo_home_columns_kernel");
  echo_move_kernel<<<grid_for(E), kThreads, 0, l.stream()>>>(
      Launch::ptr<bool>(map2), Launch::ptr<float>(probs2), Launch::ptr<const bool>(map),
      Launch::ptr<const float>(probs), Launch::ptr<const int64_t>(slot_expert),
      Launch::ptr<const int64_t>(slot_tokens) + rank * S, T, W, S, c);
  l.launched("echo_move_kernel");
}

void moe_echo_fold(Tensor& out, const Tensor& in, const Tensor& slot_expert, int64_t slots_per_rank,
                   const Context& ctx) {
  const Launch l("moe_echo_fold", ctx, {{"out", &out}, {"in", &in}, {"slot_expert", &slot_expert}});
  const int64_t T = out.size(0), E = out.size(1), S = slot_expert.numel(), P = S / slots_per_rank;
  const Columns c{E, E / P, slots_per_rank};
  if (T * E == 0) return;
  if (out.dtype() == DType::f32)
    echo_fold_kernel<float>
        <<<grid_for(T * E), kThreads, 0, l.stream()>>>(Launch::ptr<float>(out), Launch::ptr<const float>(in),
                                                       Launch::ptr<const int64_t>(slot_expert), T, in.size(1), S, c);
  else
    echo_fold_kernel<bool>
        <<<grid_for(T * E), kThreads, 0, l.stream()>>>(Launch::ptr<bool>(out), Launch::ptr<const bool>(in),
                                                       Launch::ptr<const int64_t>(slot_expert), T, in.size(1), S, c);
  l.launched("echo_fold_kernel");
}

}  // namespace moecore::ops::cuda
