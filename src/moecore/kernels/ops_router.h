// The router's ops (Megatron's TopKRouter, docs/megatron-moe-spec.md §2-§4): input jitter, the fp64
// gating linear, forced-balancing noise, score functions with (group-limited) top-k, expert bias and sinkhorn,
// capacity dropping, routing-map padding and counts, the Jacobian of the routing weights, the load-balancing
// losses and the z-loss with their logit gradients, and the expert-bias update. moe/router.cpp orders them.
// Not here: communication (global_aux_loss's all-reduce runs between router_aux_scores and router_aux_losses)
// or the fp32 gating linear (ops::gemm). Every count, loss and index is a tensor on the op's device: no caller
// reads one to launch the next op.
//
// Router dtype R: f32 or f64, one per call (logits, scores, weights and their gradients). Tokens are
// sequence-major, t = s * B + b, so sequence b holds the tokens t with t % B == b. padding [T] bool marks tokens
// excluded from losses and counts (true = padding); an undefined padding means none.
// Ties in every top-k break towards the lower index. Threading: token rows run in parallel, sums over tokens run
// in token order (in double), so no result depends on the number of threads.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>

#include "moecore/kernels/ops.h"

namespace moecore::ops {

enum class ScoreFunction : uint8_t { softmax, sigmoid, sqrtsoftplus };
enum class DropPolicy : uint8_t { probs, position };

// Slots of a router losses tensor [5] f64: coefficient-free values (z = mean lse^2), then sum coeff * value.
namespace router_loss {
inline constexpr int64_t aux = 0, seq_aux = 1, global_aux = 2, z = 3, weighted = 4, count = 5;
}

// How logits become routing weights (Megatron's --moe-router-* flags).
struct RouterRouting {
  ScoreFunction score_function = ScoreFunction::softmax;
  bool pre_softmax = false;     // softmax over all E before top-k (softmax only)
  bool sinkhorn = false;        // sinkhorn balancing: softmax weights (sigmoid when K = 1)
  bool training = true;         // sinkhorn chooses experts on its balanced matrix in training only
  int64_t num_groups = 0;       // expert groups of group-limited top-k (0: off)
  int64_t group_topk = 0;       // groups a token may use
  int64_t group_score_k = 0;    // a group scores the sum of its top this-many scores
  float scaling_factor = 0.0f;  // routing weights are multiplied by it (0: by 1)
};

// Capacity dropping per expert column.
struct RouterCapacity {
  int64_t capacity = 0;  // tokens an expert keeps (0: dropless)
  DropPolicy drop_policy = DropPolicy::probs;
  bool pad_to_capacity = false;  // fill every column to exactly `capacity` with zero-weight tokens
};

// Coefficients of the configured losses (0: not configured).
struct RouterLossCoeffs {
  double aux = 0, seq_aux = 0, global_aux = 0, z = 0;
};

struct RouterAuxLoss {
  RouterLossCoeffs coeffs;
  ScoreFunction score_function = ScoreFunction::softmax;
  int64_t K = 1;             // top-k of the aux map
  int64_t B = 1;             // sequences (seq_aux_loss)
  int64_t global_steps = 0;  // micro-batches in global_tokens including this one (global_aux_loss)
};

// ---- Gating ------------------------------------------------------------------------------------
// Multiplicative input jitter: u[i] = (1 - eps) + 2 eps philox_uniform(key, first + i) in f32, i the flat index;
// xj[i] = x[i] * u[i] rounded to x's dtype. xj, x [T, H] one dtype f32|bf16|f16; u [T, H] f32; contiguous.
void router_jitter_forward(Tensor& xj, Tensor& u, const Tensor& x, float eps, PhiloxKey key, uint64_t first,
                           const Context& ctx);
// Its backward multiply: dx[i] += g[i] * u[i]. dx, g, u [N, H] f32, contiguous (row blocks of larger tensors).
void router_jitter_backward(Tensor& dx, const Tensor& g, const Tensor& u, const Context& ctx);
// Forced load balancing: logits[i] = philox_normal(key, first + i) (rounded to f32 for an f32 router).
// logits [T, E] R, contiguous.
void router_normal_logits(Tensor& logits, PhiloxKey key, uint64_t first, const Context& ctx);

// The fp64 router's gating linear: logits[t, e] = sum_h x[t, h] w[e, h] (+ bias[e]) in double, the f32 master
// weight widened. logits [T, E] f64; x [T, H] f32|bf16|f16; w [E, H] f32; bias [E] f32 or undefined.
void router_gating_f64(Tensor& logits, const Tensor& x, const Tensor& w, const Tensor& bias, const Context& ctx);
// Its backward: dw += dlogits^T x and dx += (dlogits w) * u, every output element summed in double in an order
// fixed by the shapes and rounded once. dx [T, H] f32; dw [E, H] f32; dlogits [T, E] f64; x [T, H] f32|bf16|f16 (the
// jittered input when there is jitter); u [T, H] f32 the jitter, or undefined for none.
void router_gating_f64_backward(Tensor& dx, Tensor& dw, const Tensor& dlogits, const Tensor& x, const Tensor& w,
                                const Tensor& u, const Context& ctx);
// dbias[e] += sum_t dlogits[t, e], in double and token order. dbias [E] f32; dlogits [T, E] f64.
void router_gating_f64_bias_grad(Tensor& dbias, const Tensor& dlogits, const Context& ctx);

// ---- Routing -----------------------------------------------------------------------------------
// Scores, top-k and weights of every token row (spec §2.5-§2.7):
//   softmax after top-k: select on z, w = softmax over the K selected logits
//   pre-softmax:         s = softmax(z) over all E, select on s, w = s at the selected experts
//   sigmoid-like f:      s = f(z), select on s + expert_bias, w = s / (sum of selected s + 1e-20) (K = 1: w = s)
//   sinkhorn:            s = softmax(z) (sigmoid when K = 1), select on the sinkhorn-balanced exp(z) in training
//                        and on s otherwise, w = s at the selected experts
// Group-limited top-k (num_groups > 0) keeps the group_topk groups with the largest sums of their top
// group_score_k selection values. Outputs: scores [T, E] R (s; untouched for softmax after top-k), topk_idx
// [T, K] i32 (descending), topk_w [T, K] R, sparse [T, E] R = w * scaling at the selected experts and 0 elsewhere,
// map [T, E] bool the selection. logits [T, E] R; expert_bias [E] f32 or undefined (sigmoid-like f only).
void router_route(Tensor& scores, Tensor& topk_idx, Tensor& topk_w, Tensor& sparse, Tensor& map, const Tensor& logits,
                  const Tensor& expert_bias, const RouterRouting& p, const Context& ctx);
// Capacity per expert column e (spec §4.2): the "probs" policy keeps the `capacity` largest sparse[:, e] (ties
// to the lower token), "position" the earliest routed tokens. map[t, e] becomes routed-and-kept, or with
// pad_to_capacity kept (the earliest unrouted tokens fill a short column); probs [T, E] f32 = sparse where kept,
// else 0; topk_kept [T, K] bool marks the selected pairs still in the map; dropped [1] i64 = selected pairs lost.
// Dropless (capacity 0 or above T): probs = sparse, map unchanged (all true with pad_to_capacity), nothing dropped.
void router_capacity(Tensor& probs, Tensor& map, Tensor& topk_kept, Tensor& dropped, const Tensor& sparse,
                     const Tensor& topk_idx, const RouterCapacity& p, const Context& ctx);
// Routing-map padding (--moe-router-padding-for-fp8): per column e, the first (-n_e) mod alignment unrouted
// tokens become routed (with probability 0), n_e the routed count. map [T, E] bool, alignment > 0.
void router_pad_map(Tensor& map, int64_t alignment, const Context& ctx);
// counts[e] = (accumulate ? counts[e] : 0) + #{t : map[t, e] and not padding[t]}. counts [E] i64; map [T, E] bool.
void router_map_counts(Tensor& counts, const Tensor& map, const Tensor& padding, bool accumulate, const Context& ctx);
// dlogits = d(sum_{t,e} probs[t, e] dprobs[t, e]) / d logits + loss_scale * dlogits_loss, through the weights of
// router_route for the kept pairs (dropped pairs and padding slots carry constant probs). dprobs [T, E] f32;
// dlogits, dlogits_loss, logits, scores [T, E] R; topk_idx [T, K] i32; topk_w [T, K] R; topk_kept [T, K] bool.
void router_route_backward(Tensor& dlogits, const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                           const Tensor& topk_idx, const Tensor& topk_w, const Tensor& topk_kept,
                           const Tensor& dlogits_loss, const RouterRouting& p, float loss_scale, const Context& ctx);

// ---- Losses (spec §3) -----------------------------------------------------------------------
// The aux losses' own scores and top-k (no bias, groups, capacity or scaling) of the valid rows: aux_scores [T, E]
// R = softmax(z), or f(z) / (sum f + 1e-20) for sigmoid-like f; aux_map [T, E] R = 1 at the top-K of aux_scores,
// else 0; padding rows 0 in both. counts [E + 1] i64 (or undefined): counts[e] = sum_t aux_map[t, e] and
// counts[E] = valid tokens, this micro-batch's share of global_aux_loss (all-reduced by the caller).
void router_aux_scores(Tensor& aux_scores, Tensor& aux_map, Tensor& counts, const Tensor& logits, const Tensor& padding,
                       ScoreFunction score_function, int64_t K, const Context& ctx);
// With P_b[e], c_b[e] the sums of aux_scores and aux_map over the valid tokens of sequence b, P, c their sums over
// sequences, N the valid tokens and switch(P, c, N) = E / (K N^2) sum_e P[e] c[e]:
//   losses[aux] = switch(P, c, N); losses[seq_aux] = mean_b switch(P_b, c_b, N / B);
//   losses[global_aux] = switch(P, G / global_steps, counts[E]), G = global_tokens after
//   global_tokens += counts[0..E) (counts: router_aux_scores' output summed over the group).
// A loss whose coefficient is 0 is written as 0 (and global_tokens is left alone). dlogits_loss [T, E] R holds
// aux_scores on entry and leaves with d(sum coeff * loss) / d logits (padding rows 0), the counts constant.
// losses [5] f64; global_tokens [E] i64 and counts [E + 1] i64 (undefined without global_aux_loss); aux_map,
// logits [T, E] R.
void router_aux_losses(Tensor& dlogits_loss, Tensor& losses, Tensor& global_tokens, const Tensor& aux_map,
                       const Tensor& logits, const Tensor& counts, const Tensor& padding, const RouterAuxLoss& p,
                       const Context& ctx);
// z-loss: losses[z] = mean over valid tokens of lse_t^2 (lse_t = logsumexp of logits row t);
// dlogits_loss[t, :] += coeff * 2 lse_t softmax(logits[t, :]) / N on valid rows. dlogits_loss, logits [T, E] R.
void router_z_loss(Tensor& dlogits_loss, Tensor& losses, const Tensor& logits, const Tensor& padding, double coeff,
                   const Context& ctx);
// losses[weighted] = aux * losses[aux] + seq_aux * losses[seq_aux] + global_aux * losses[global_aux] + z * losses[z].
void router_loss_weighted(Tensor& losses, const RouterLossCoeffs& coeffs, const Context& ctx);

// ---- Aux-loss-free balancing ----------------------------------------------------------------------
// Once per optimizer step: expert_bias[e] += rate * sign(mean(counts) - counts[e]), the sign taken exactly in
// integers (a tie leaves the bias alone). expert_bias [E] f32; counts [E] i64.
void router_expert_bias_update(Tensor& expert_bias, const Tensor& counts, float rate, const Context& ctx);

}  // namespace moecore::ops
