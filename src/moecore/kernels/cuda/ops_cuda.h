// The CUDA kernels of ops.h (namespace moecore::ops::cuda), one declaration per op with the same signature and
// meaning as in ops.h. Only the public ops call these, after their shared entry checks (kernels/cpu/*.cpp:
// `if constexpr (cpu::kCudaKernels) if (ctx.device == Device::cuda) return cuda::<op>(..., ctx);`), so the
// functions here trust shapes, dtypes, strides and devices and never check them again. Defined in
// kernels/cuda/*.cu, built only when CMake finds nvcc (MOECORE_HAVE_CUDA_KERNELS); nothing calls them otherwise.
// Device-side contracts that differ from the CPU kernels, because the host never reads device data:
//   - counts (group_rows) are read on the device: a negative count counts as 0 and rows past R are ignored
//     instead of raising;
//   - embedding ids outside [0, V) (or outside [0, vocab_size) for the vocabulary-parallel lookup) give NaN rows
//     (forward) or are skipped (backward), and labels >= V give a NaN loss (and NaN gradient row), instead of raising;
//   - moe_plan cuts routed pairs beyond row_token's M rows off (the last experts' last tokens get token_rows -1 and
//     counts / offsets count only the rows given, as if those pairs were dropped) instead of raising; moe_permute
//     stops at offsets[E] rows, moe_unpermute(_probs) treats a token_rows entry >= M as unrouted, moe_sort_chunks
//     counts a negative chunk count as 0 and moves no row past the smaller of out and in;
//   - attention supports head dims D <= 256 (larger raise, naming the op);
//   - moe_echo_reroute and moe_echo_fold count slot_expert entries outside [-1, E) as empty slots, and a slot asking
//     for more of a rank's tokens than it routes takes those there are (the CPU kernels raise).
// Every op of ops.h and ops_router.h has a CUDA kernel here.
#pragma once
#include <string>

#include "moecore/kernels/ops.h"
#include "moecore/kernels/ops_router.h"

namespace moecore::ops::cuda {

// Why cuBLAS cannot be loaded (naming the library and where it was looked for); empty when it loads.
std::string cublas_unavailable_reason();
// GEMM (gemm.cu): cuBLAS for the dense ones, moecore's own tiled grouped GEMM for the grouped ones.
void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Context& ctx);
void gemm_batched(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
                  const Context& ctx);
void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows, float beta,
                  const Context& ctx);
void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows, float beta,
                        const Context& ctx);
// Why the grouped GEMMs' tensor-core path (Hopper, CUTLASS: grouped_gemm_sm90.cu) declines these operands on this
// device, a fixed text, or null when it takes them (then the SIMT kernel does not run).
const char* sm90_grouped_gemm_declines(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_b);
const char* sm90_grouped_wgrad_declines(const Tensor& c, const Tensor& a, const Tensor& b);

// Elementwise, layout, rotary embeddings and the optimizer (elementwise.cu).
void add(Tensor& out, const Tensor& a, const Tensor& b, const Context& ctx);
void scale(Tensor& x, float alpha, const Context& ctx);
void sum_squares(Tensor& acc, const Tensor& x, const Context& ctx);
void flag_nonfinite(Tensor& flag, const Tensor& x, const Context& ctx);
void count_zeros(Tensor& acc, const Tensor& x, float scale, const Context& ctx);
void glu_forward(Tensor& out, const Tensor& gate_up, const GluParams& p, const Context& ctx);
void glu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up, const GluParams& p, const Context& ctx);
void gelu_forward(Tensor& out, const Tensor& x, const Context& ctx);
void gelu_backward(Tensor& dx, const Tensor& dout, const Tensor& x, const Context& ctx);
void transpose_01(Tensor& out, const Tensor& in, const Context& ctx);
void qkv_slots_gather(Tensor& packed, const Tensor& qkv, const QkvDims& dims, int64_t slot, int64_t count,
                      const Context& ctx);
void qkv_slots_scatter(Tensor& qkv, const Tensor& packed, const QkvDims& dims, int64_t slot, int64_t count,
                       const Context& ctx);
void rope_table(Tensor& rope, float base, const Context& ctx);
void rope_forward(Tensor& qkv, const Tensor& rope, const QkvDims& dims, const Context& ctx);
void rope_backward(Tensor& dqkv, const Tensor& rope, const QkvDims& dims, const Context& ctx);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWParams& p,
                const Context& ctx);
void lion_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, const LionParams& p, const Context& ctx);
void muon_momentum(Tensor& u, Tensor& momentum, const Tensor& grad, const MuonMomentumParams& p, const Context& ctx);
void muon_update(Tensor& param, const Tensor& o, float lr, float weight_decay, const Context& ctx);

// Norms (norms.cu).
void rmsnorm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, const Context& ctx);
void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      bool accumulate_dx, const Context& ctx);
void layernorm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                       float eps, const Context& ctx);
void layernorm_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, bool accumulate_dx, const Context& ctx);

// Biases and dropout (bias_dropout.cu).
void bias_add(Tensor& y, const Tensor& bias, const Context& ctx);
void bias_grad(Tensor& dbias, const Tensor& dy, const Context& ctx);
void bias_add_grouped(Tensor& y, const Tensor& bias, const Tensor& group_rows, const Context& ctx);
void bias_grad_grouped(Tensor& dbias, const Tensor& dy, const Tensor& group_rows, const Context& ctx);
void bias_add_grouped_scaled(Tensor& y, const Tensor& bias, const Tensor& row_scale, const Tensor& group_rows,
                             const Context& ctx);
void bias_grad_grouped_scaled(Tensor& dbias, Tensor& drow_scale, const Tensor& dy, const Tensor& bias,
                              const Tensor& row_scale, const Tensor& group_rows, const Context& ctx);
void dropout_forward(Tensor& y, const Tensor& x, const Dropout& d, const Context& ctx);
void dropout_backward(Tensor& dx, const Tensor& dy, const Dropout& d, const Context& ctx);
void bias_dropout_add(Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& bias, const Dropout& d,
                      const Context& ctx);
void bias_dropout_add_backward(Tensor& dx, Tensor& dbias, const Tensor& dy, const Dropout& d, const Context& ctx);

// Embedding and losses (embedding_loss.cu).
void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, const Context& ctx);
void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout, const Context& ctx);
void softmax_cross_entropy(Tensor& loss, Tensor& logits, const Tensor& labels, float grad_scale, bool compute_grad,
                           const Context& ctx);
void vocab_parallel_ce_stats(Tensor& stats, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                             const Context& ctx);
void vocab_parallel_ce_merge(Tensor& lse, const Tensor& gathered, const Tensor& labels, int64_t vocab_size,
                             const Context& ctx);
void vocab_parallel_ce_finish(Tensor& loss, Tensor& logits, const Tensor& lse, const Tensor& labels,
                              int64_t vocab_start, float grad_scale, bool compute_grad, const Context& ctx);
void loss_totals(Tensor& totals, const Tensor& loss, const Tensor& labels, const Context& ctx);
void embedding_forward_shard(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start,
                             int64_t vocab_size, const Context& ctx);
void embedding_backward_shard(Tensor& dtable, const Tensor& ids, const Tensor& dout, int64_t vocab_start,
                              const Context& ctx);

// MoE permutation and expert rows (moe.cu).
void moe_plan(Tensor& counts, Tensor& offsets, Tensor& token_rows, Tensor& row_token, const Tensor& map,
              const Context& ctx);
void moe_permute(Tensor& rows, Tensor& row_probs, const Tensor& x, const Tensor& probs, const Tensor& row_token,
                 const Tensor& offsets, const Context& ctx);
void moe_unpermute(Tensor& y, const Tensor& rows, const Tensor& token_rows, bool accumulate, const Context& ctx);
void moe_unpermute_probs(Tensor& out, const Tensor& values, const Tensor& token_rows, const Context& ctx);
void moe_sort_chunks(Tensor& out, const Tensor& in, const Tensor& chunk_counts, int64_t P, int64_t El, bool inverse,
                     const Context& ctx);
void moe_chunk_counts(Tensor& counts, Tensor& offsets, const Tensor& chunk_counts, int64_t P, const Context& ctx);

// MoE ECHO (moe_echo.cu).
void moe_echo_plan(Tensor& slot_expert, Tensor& slot_tokens, Tensor& loads, const Tensor& counts,
                   int64_t slots_per_rank, uint64_t seed, const Context& ctx);
void moe_echo_reroute(Tensor& map2, Tensor& probs2, const Tensor& map, const Tensor& probs, const Tensor& slot_expert,
                      const Tensor& slot_tokens, int64_t rank, int64_t slots_per_rank, const Context& ctx);
void moe_echo_fold(Tensor& out, const Tensor& in, const Tensor& slot_expert, int64_t slots_per_rank,
                   const Context& ctx);
void moe_scale_rows(Tensor& a, const Tensor& act, const Tensor& p, const Tensor& group_rows, const Context& ctx);
void moe_scale_rows_backward(Tensor& dp, Tensor& da, Tensor& a, const Tensor& act, const Tensor& p,
                             const Tensor& group_rows, bool accumulate, const Context& ctx);
void moe_shared_gate_forward(Tensor& y, Tensor& s, const Tensor& x, const Tensor& g, const Tensor& out,
                             const Context& ctx);
void moe_shared_gate_backward(Tensor& dout, Tensor& dx, Tensor& dg, const Tensor& dy, const Tensor& x, const Tensor& g,
                              const Tensor& out, const Tensor& s, const Context& ctx);

// Attention (attention.cu).
void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& kv, const QkvDims& dims,
                       const Dropout& dropout, const AttentionOptions& opt, const Context& ctx);
void attention_backward(Tensor& dq, Tensor& dkv, Tensor* dsinks, const Tensor& dout, const Tensor& q, const Tensor& kv,
                        const Tensor& out, const Tensor& lse, const QkvDims& dims, const Dropout& dropout,
                        const AttentionOptions& opt, const Context& ctx);

// Router gating, routing, capacity and counts (router.cu).
void router_jitter_forward(Tensor& xj, Tensor& u, const Tensor& x, float eps, PhiloxKey key, uint64_t first,
                           const Context& ctx);
void router_jitter_backward(Tensor& dx, const Tensor& g, const Tensor& u, const Context& ctx);
void router_normal_logits(Tensor& logits, PhiloxKey key, uint64_t first, const Context& ctx);
void router_gating_f64(Tensor& logits, const Tensor& x, const Tensor& w, const Tensor& bias, const Context& ctx);
void router_gating_f64_backward(Tensor& dx, Tensor& dw, const Tensor& dlogits, const Tensor& x, const Tensor& w,
                                const Tensor& u, const Context& ctx);
void router_gating_f64_bias_grad(Tensor& dbias, const Tensor& dlogits, const Context& ctx);
void router_expert_bias_update(Tensor& expert_bias, const Tensor& counts, float rate, const Context& ctx);
void router_route(Tensor& scores, Tensor& topk_idx, Tensor& topk_w, Tensor& sparse, Tensor& map, const Tensor& logits,
                  const Tensor& expert_bias, const RouterRouting& p, const Context& ctx);
void router_capacity(Tensor& probs, Tensor& map, Tensor& topk_kept, Tensor& dropped, const Tensor& sparse,
                     const Tensor& topk_idx, const RouterCapacity& p, const Context& ctx);
void router_pad_map(Tensor& map, int64_t alignment, const Context& ctx);
void router_map_counts(Tensor& counts, const Tensor& map, const Tensor& padding, bool accumulate, const Context& ctx);
void router_route_backward(Tensor& dlogits, const Tensor& dprobs, const Tensor& logits, const Tensor& scores,
                           const Tensor& topk_idx, const Tensor& topk_w, const Tensor& topk_kept,
                           const Tensor& dlogits_loss, const RouterRouting& p, float loss_scale, const Context& ctx);

// Router losses (router_losses.cu).
void router_aux_scores(Tensor& aux_scores, Tensor& aux_map, Tensor& counts, const Tensor& logits, const Tensor& padding,
                       ScoreFunction score_function, int64_t K, const Context& ctx);
void router_aux_losses(Tensor& dlogits_loss, Tensor& losses, Tensor& global_tokens, const Tensor& aux_map,
                       const Tensor& logits, const Tensor& counts, const Tensor& padding, const RouterAuxLoss& p,
                       const Context& ctx);
void router_z_loss(Tensor& dlogits_loss, Tensor& losses, const Tensor& logits, const Tensor& padding, double coeff,
                   const Context& ctx);
void router_loss_weighted(Tensor& losses, const RouterLossCoeffs& coeffs, const Context& ctx);

}  // namespace moecore::ops::cuda
