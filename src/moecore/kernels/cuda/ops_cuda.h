// The CUDA kernels of ops.h (namespace moecore::ops::cuda), one declaration per op with the same signature and
// meaning as in ops.h. Only the public ops call these, after their shared entry checks (kernels/cpu/*.cpp:
// `if constexpr (cpu::kCudaKernels) if (ctx.device == Device::cuda) return cuda::<op>(..., ctx);`), so the
// functions here trust shapes, dtypes, strides and devices and never check them again. Defined in
// kernels/cuda/*.cu, built only when CMake finds nvcc (MOECORE_HAVE_CUDA_KERNELS); nothing calls them otherwise.
// Device-side contracts that differ from the CPU kernels, because the host never reads device data:
//   - counts (group_rows) are read on the device: a negative count counts as 0 and rows past R are ignored
//     instead of raising;
//   - embedding ids outside [0, V) give NaN rows (forward) or are skipped (backward), and labels >= V give a NaN
//     loss (and NaN gradient row), instead of raising.
// Not here: MoE permutation, router, attention (no CUDA kernel yet; those ops refuse cuda contexts).
#pragma once
#include "moecore/kernels/ops.h"

namespace moecore::ops::cuda {

// GEMM (gemm.cu): cuBLAS for the dense ones, moecore's own tiled grouped GEMM for the grouped ones.
void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Context& ctx);
void gemm_batched(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
                  const Context& ctx);
void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows, float beta,
                  const Context& ctx);
void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows, float beta,
                        const Context& ctx);

// Elementwise, layout, rotary embeddings and the optimizer (elementwise.cu).
void add(Tensor& out, const Tensor& a, const Tensor& b, const Context& ctx);
void scale(Tensor& x, float alpha, const Context& ctx);
void sum_squares(Tensor& acc, const Tensor& x, const Context& ctx);
void flag_nonfinite(Tensor& flag, const Tensor& x, const Context& ctx);
void swiglu_forward(Tensor& out, const Tensor& gate_up, const Context& ctx);
void swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up, const Context& ctx);
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

}  // namespace moecore::ops::cuda
