// The MoE router (Megatron's TopKRouter, docs/megatron-moe-spec.md §2-§4): gating linear (with an
// optional bias, Megatron's add_bias_linear) in fp32 or fp64, input jitter, score functions, (group-limited) top-k,
// expert bias, sinkhorn, forced balancing, capacity dropping and routing-map padding, plus every load-balancing loss
// and the z-loss. This file orders the stages; each computation is an op of kernels/ops_router.h (or ops.h), so the
// router runs on any device whose kernels exist. Not here: permutation (dispatcher.h) and expert compute (experts.h).
//
// Device residency: counts, losses and the router state are tensors on the router's device (ctx.device); no stage
// reads one on the host. router_stats_host copies all of the statistics to the host (logging, tests); the trainer
// copies only the losses tensor, once per micro-batch.
// Loss gradients: forward computes each loss and the gradient of their sum with respect to the logits
// (cache.dlogits_loss); router_backward adds it, times aux_grad_scale, to the gradient coming from the
// routing probabilities. Nothing is threaded through the model's return values.
// Token order: Megatron's sequence-major flattening of [S, B]: token t = s * B + b. It matters for seq_aux_loss
// (sequence b = the tokens t with t % B == b) and for the "position" drop policy, which keeps the lowest token
// indices, i.e. the earliest positions across all sequences (position s of every sequence before s + 1).
// Ties in every top-k break towards the lower expert (or token) index, deterministically.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <vector>

#include "moecore/kernels/ops_router.h"
#include "moecore/moe/config.h"
#include "moecore/parallel/comm.h"

namespace moecore::moe {

struct RouterDims {
  int64_t T = 0;  // this rank's tokens (S * B, or their SP share; sequence-major: t = s * B + b)
  int64_t B = 1;  // sequences in the micro-batch (seq_aux_loss: sequence b = tokens t % B == b)
  int64_t H = 0;  // hidden size
  int64_t E = 0;  // experts
  int64_t K = 0;  // top-k
  // global_aux_loss: the group its token counts are summed over (Megatron's TP x DP x CP; here the
  // data-parallel group). Null or size 1: this rank's counts alone.
  const ProcessGroup* global_aux_group = nullptr;
  // Sequence parallelism (Megatron's MoE under TP requires it): this rank's T tokens are sequence positions
  // [r * S/P, (r + 1) * S/P) of every sequence of the group's (P ranks) micro-batch, in the order s * B + b, so the
  // group's rows concatenated in rank order are the whole micro-batch. The load-balancing and z losses are then
  // computed over the all-gathered logits, as one rank would (spec §3: counts over TP x CP, each rank's partial P
  // with the global counts and token count add up to the full loss), and each rank keeps its own rows' gradient;
  // every rank logs the whole loss. Null or size 1: none.
  const ProcessGroup* sequence_group = nullptr;
  int64_t sequence_size() const { return sequence_group ? sequence_group->size() : 1; }
};

struct RouterWeights {
  Tensor weight;          // [E, H] f32 master (used for fp32/fp64 routing math)
  Tensor weight_compute;  // [E, H] in the dtype of x (aliases weight in fp32 models)
  Tensor bias{};          // [E] f32: logits += bias (Megatron's add_bias_linear); undefined: none
};

// Per-layer state that outlives one micro-batch. Tensors live on the router's device; copies of a state share
// them (clone each tensor for an independent copy).
struct RouterState {
  Tensor expert_bias;               // [E] f32, aux-loss-free bias (checkpointed); undefined when off
  Tensor local_tokens_per_expert;   // [E] i64 exact counts since the last optimizer step (bias update)
  Tensor global_tokens_per_expert;  // [E] i64 global_aux_loss accumulator over micro-batches
  // [E + 1] i64: one micro-batch's aux top-k counts per expert and its valid tokens, all-reduced over
  // global_aux_group before they join the accumulator (global_aux_loss only; undefined otherwise)
  Tensor global_aux_counts;
  int64_t global_aux_steps = 0;  // micro-batches accumulated in global_tokens_per_expert (counts calls, not data)
  int64_t calls = 0;             // forward calls (jitter / forced-balancing noise stream)
  uint64_t stream = 0;           // noise stream id, distinct per layer (the layer number)
};
RouterState router_state_init(const MoeConfig& cfg, Device device = Device::cpu);
// Bytes of the state's counter tensors (expert_bias is a parameter and counted with them).
int64_t router_state_bytes(const RouterState& st);
// Once per optimizer step: expert_bias += rate * sign(mean(c) - c) from the exact counts c, then reset the
// counters (expert bias and global_aux_loss). Counts are summed over data-parallel ranks by the caller.
// update_bias=false only resets the counters (a skipped step leaves the bias bit-identical).
void router_finish_step(RouterState& st, const MoeConfig& cfg, bool update_bias, const ops::Context& ctx);

// Statistics of the last forward, on the router's device. Coefficient-free loss values as Megatron logs them
// (loss / coeff; z_loss = mean lse^2), 0 when not configured or in evaluation.
struct RouterStats {
  Tensor tokens_per_expert;  // [E] i64 routed (token, expert) pairs after capacity, padding included
  Tensor losses;             // [5] f64: aux, seq_aux, global_aux, z, weighted (ops::router_loss slots)
  Tensor dropped;            // [1] i64 pairs removed by the capacity
};
RouterStats router_stats_alloc(int64_t E, Device device);

// A host snapshot of RouterStats, for logging.
struct RouterStatsHost {
  double aux_loss = 0, seq_aux_loss = 0, global_aux_loss = 0, z_loss = 0;
  double weighted_loss = 0;                // sum of coeff * value over configured losses (what is optimized)
  std::vector<int64_t> tokens_per_expert;  // [E]
  int64_t dropped = 0;
  // max over experts of tokens_per_expert / its mean (1 = perfectly balanced; 0 without tokens).
  double max_over_mean_load() const;
};
// The explicit device-to-host transfer of the statistics: the only place they cross to the host.
RouterStatsHost router_stats_host(const RouterStats& s);

// Saved for backward. Tensors in router dtype R (f32 or f64) unless stated.
struct RouterCache {
  Tensor x_jittered;    // [T, H] dtype of x (only with jitter)
  Tensor jitter;        // [T, H] f32 multiplicative noise (only with jitter)
  Tensor logits;        // [T, E] R
  Tensor scores;        // [T, E] R: softmax (pre-softmax / sinkhorn), sigmoid or sqrtsoftplus of the logits
  Tensor topk_idx;      // [T, K] i32 selected experts before capacity dropping
  Tensor topk_w;        // [T, K] R weights before scaling and dropping
  Tensor topk_kept;     // [T, K] bool: the selected pair survived capacity dropping (its prob is live)
  Tensor dlogits_loss;  // [T, E] R: d(sum of configured losses)/d logits
  Tensor dlogits;       // [T, E] R: workspace for backward (and for forward's intermediates)
  Tensor work;          // [min(T, 1024), H] f32 workspace, fp32 router with bf16 x or jitter (else undefined)
  Tensor forced_bias;   // [1, E] f32: --moe-router-force-biased's bias (else undefined)
  // Sequence parallelism only (P = d.sequence_size() > 1): the group's rows for the loss stage.
  Tensor logits_all;        // [P * T, E] R: every rank's logits, in rank order
  Tensor dlogits_loss_all;  // [P * T, E] R
  Tensor dlogits_all;       // [P * T, E] R: the loss stage's workspace
  Tensor padding_all;       // [P * T] bool (allocated with the padding mask's first use: only when given)
};
// Every tensor on `device`.
RouterCache router_cache_alloc(const RouterDims& d, const MoeConfig& cfg, DType x_dtype, Device device = Device::cpu);

// x [T, H] f32|bf16|f16 (the pre-MLP norm output, token t = s * B + b); padding_mask [T] bool in the same order
// (true = padding, excluded from losses and counts) or undefined. Outputs: probs [T, E] f32 (0 where not
// routed), map [T, E] bool (routed, including zero-weight padding slots) and stats (router_stats_alloc).
// training=false skips losses and counters (evaluation). Every tensor must be on ctx.device.
void router_forward(Tensor& probs, Tensor& map, RouterStats& stats, const Tensor& x, const Tensor& padding_mask,
                    const RouterWeights& w, RouterState& st, RouterCache& cache, const RouterDims& d,
                    const MoeConfig& cfg, bool training, const ops::Context& ctx);

// dprobs [T, E] f32: gradient of the objective w.r.t. probs. Only live selected pairs are read: the zero-weight
// slots of pad-to-capacity and alignment padding, and dropped pairs, carry constant probs and are ignored.
// dx [T, H] f32 += router input gradient; dweight [E, H] f32 += weight gradient; dbias [E] f32 += bias gradient
// (required iff w.bias is defined; the overload without it is for bias-free routers).
// aux_grad_scale multiplies the loss gradients (Megatron's main_loss_backward_scale: 1 / micro-batches).
void router_backward(Tensor& dx, Tensor& dweight, Tensor& dbias, const Tensor& dprobs, const Tensor& x,
                     const RouterWeights& w, RouterCache& cache, const RouterDims& d, const MoeConfig& cfg,
                     float aux_grad_scale, const ops::Context& ctx);
inline void router_backward(Tensor& dx, Tensor& dweight, const Tensor& dprobs, const Tensor& x, const RouterWeights& w,
                            RouterCache& cache, const RouterDims& d, const MoeConfig& cfg, float aux_grad_scale,
                            const ops::Context& ctx) {
  Tensor none;
  router_backward(dx, dweight, none, dprobs, x, w, cache, d, cfg, aux_grad_scale, ctx);
}

}  // namespace moecore::moe
