// Routed experts: SwiGLU (or GeLU) MLPs over expert-major rows, with the routing probability applied after
// the activation (Megatron's memory-efficient path, docs/megatron-moe-spec.md §5.3/§7.1):
//   h = x W1_e^T (+ b1_e);  a = act(h) * p;  y = a W2_e^T (+ p * b2_e)          for the rows of expert e
// The optional biases are Megatron's add_bias_linear: the fc2 bias is weighted by the routing probability, so
// y = p * (act(h) W2_e^T + b2_e) (TEGroupedMLP._apply_bias, MLP.forward with per_token_scale).
// The grouped version runs one grouped GEMM per projection over variable row counts (experts with zero
// rows allowed) read on the device; the sequential version (Megatron's SequentialMLP) loops over experts with
// plain GEMMs, so like Megatron's it copies the counts to the host first, and is the test reference.
// tokens_per_expert is [E] i64 on the layer's device; the rows it covers may be fewer than x's (buffers sized
// for the worst case): rows past them are neither read nor written.
// Saved for backward: x (the dispatcher's permuted input), h and the unscaled activation; never the output.
// Gradient contract: weight gradients accumulate (+=); dx and dprobs are written.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <vector>

#include "moecore/kernels/ops.h"
#include "moecore/nn/fp8.h"

namespace moecore::moe {

struct ExpertDims {
  int64_t E = 0;           // local experts (core/dims.h's El: E / EP, the model's E)
  int64_t H = 0;           // hidden size
  int64_t F = 0;           // expert ffn size
  ops::MlpActivation act;  // fc1 rows: 2F (a gated linear unit, [gate; up]) or F (GeLU)
  int64_t max_rows = 0;    // rows the caches are sized for
  // Expert tensor parallelism: every slice holds the whole fc2 bias and computes its gradient (each sees every row and
  // its whole output gradient), but only one slice (ETP rank 0) adds it to its partial output and its dy . b2 term to
  // dprobs, so that the sum over the slices has it once.
  bool adds_fc2_bias = true;
  // Selective recompute of the activation (--recompute-modules moe_act): backward computes act(h) again from the fc1
  // output before it reads the cache's act, so that buffer may be shared (by every layer of a model).
  bool recompute_act = false;
  DType compute = DType::f32;
  Device device = Device::cpu;     // where the caches live
  nn::Fp8Training* fp8 = nullptr;  // the experts' GEMMs run FP8 under this recipe (nn/fp8.h); null: not
  std::string_view layer{};        // the layer's parameter prefix, naming the GEMMs in errors
  int64_t fc1_rows() const { return act.fc1_width(F); }
  nn::Linear linear(const char* name) const { return {fp8, layer, name, E}; }
};

// Biases are optional (undefined: none, bitwise the bias-free layer); give both or neither.
struct ExpertWeights {
  Tensor fc1;         // [E, fc1_rows, H] compute dtype (one contiguous tensor for all experts)
  Tensor fc2;         // [E, H, F] compute dtype
  Tensor fc1_bias{};  // [E, fc1_rows] f32, added before the activation
  Tensor fc2_bias{};  // [E, H] f32, added times the routing probability
};
struct ExpertGrads {
  Tensor fc1;         // [E, fc1_rows, H] f32
  Tensor fc2;         // [E, H, F] f32
  Tensor fc1_bias{};  // [E, fc1_rows] f32 (defined iff the weights have biases)
  Tensor fc2_bias{};  // [E, H] f32
};
struct ExpertCache {
  Tensor h;    // [max_rows, fc1_rows] compute: fc1 output
  Tensor act;  // [max_rows, F] compute: act(h), unscaled
};
struct ExpertWorkspace {
  Tensor a;   // [max_rows, F] compute: act * p (forward and backward)
  Tensor da;  // [max_rows, F] compute
  Tensor dh;  // [max_rows, fc1_rows] compute
};
ExpertCache expert_cache_alloc(const ExpertDims& d);
ExpertWorkspace expert_workspace_alloc(const ExpertDims& d);

// x [R, H] compute; probs [R] f32; tokens_per_expert [E] i64 with sum <= R; y [R, H] compute (written).
void experts_forward(Tensor& y, const Tensor& x, const Tensor& probs, const Tensor& tokens_per_expert,
                     const ExpertWeights& w, ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d,
                     const ops::Context& ctx);
// dy [R, H] compute. dx [R, H] f32 and dprobs [R] f32 written (dprobs includes the fc2 bias term dy . b2_e);
// grads +=.
void experts_backward(Tensor& dx, Tensor& dprobs, ExpertGrads& g, const Tensor& dy, const Tensor& x,
                      const Tensor& probs, const Tensor& tokens_per_expert, const ExpertWeights& w,
                      const ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d, const ops::Context& ctx);

// The per-expert reference (plain GEMMs, same math), for tests and --no-moe-grouped-gemm.
void experts_forward_sequential(Tensor& y, const Tensor& x, const Tensor& probs, const Tensor& tokens_per_expert,
                                const ExpertWeights& w, ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d,
                                const ops::Context& ctx);
void experts_backward_sequential(Tensor& dx, Tensor& dprobs, ExpertGrads& g, const Tensor& dy, const Tensor& x,
                                 const Tensor& probs, const Tensor& tokens_per_expert, const ExpertWeights& w,
                                 const ExpertCache& cache, ExpertWorkspace& ws, const ExpertDims& d,
                                 const ops::Context& ctx);

// Shared expert (spec §8): a dense MLP on every token, optionally scaled per token by sigmoid(x . gate).
// No biases: Megatron's SharedExpertMLP asserts add_bias_linear == False, and its gate is bias-free.
// The shared expert's activation and, with FP8, its linears' recipe and layer prefix (as ExpertDims's).
struct SharedExpertDims {
  ops::MlpActivation act;
  nn::Fp8Training* fp8 = nullptr;
  std::string_view layer{};
  nn::Linear linear(const char* name) const { return {fp8, layer, name}; }
};
struct SharedExpertWeights {
  Tensor fc1;   // [fc1_rows(Fs), H] compute
  Tensor fc2;   // [H, Fs] compute
  Tensor gate;  // [1, H] f32, or undefined without --moe-shared-expert-gate
};
struct SharedExpertGrads {
  Tensor fc1, fc2, gate;  // f32, same shapes (gate undefined without the gate)
};
struct SharedExpertCache {
  Tensor h;                 // [T, fc1_rows] compute
  Tensor act;               // [T, Fs] compute
  Tensor out;               // [T, H] f32: ungated output (gate backward)
  Tensor gate_s;            // [T] f32: sigmoid(x . gate)
  Tensor dact, dh, dout_c;  // backward workspace
};
SharedExpertCache shared_expert_cache_alloc(int64_t T, int64_t H, int64_t Fs, bool glu, bool gate, DType compute,
                                            Device device = Device::cpu);
// y [T, H] f32 += shared expert output of x [T, H] compute.
void shared_expert_forward(Tensor& y, const Tensor& x, const SharedExpertWeights& w, SharedExpertCache& cache,
                           const SharedExpertDims& d, const ops::Context& ctx);
// Selective recompute (shared_experts): cache.h and cache.act again from x, as forward computes them.
void shared_expert_refill(const Tensor& x, const SharedExpertWeights& w, SharedExpertCache& cache,
                          const SharedExpertDims& d, const ops::Context& ctx);
// dy [T, H] f32; dx [T, H] f32 +=; grads +=.
void shared_expert_backward(Tensor& dx, SharedExpertGrads& g, const Tensor& dy, const Tensor& x,
                            const SharedExpertWeights& w, SharedExpertCache& cache, const SharedExpertDims& d,
                            const ops::Context& ctx);

}  // namespace moecore::moe
