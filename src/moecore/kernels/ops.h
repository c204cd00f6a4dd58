// The whole op vocabulary of moecore. Every module (nn/, moe/, model/) calls these, never a backend.
// Each op dispatches on the device of its tensors: kernels/cpu/ always (the reference), kernels/cuda/
// when built. Shapes and dtypes are checked on entry; a mismatch raises moecore::Error naming the op,
// the shapes and the dtypes.
//
// Gradient contract: parameter gradients accumulate (+=); activation gradients are written unless the
// op says otherwise (e.g. rmsnorm_backward's accumulate_dx for the residual stream).
// Threading: CPU ops use OpenMP over the calling thread's team; results do not depend on thread count
// except where an op says so (gemm, gemm_batched and the grouped GEMMs run oneDNN, whose last bits can
// change with the number of threads; they are deterministic for a fixed thread count).
#pragma once
#include <cstdint>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::ops {

// Execution context: where and how an op runs. Passed last to every op.
struct Context {
  Device device = Device::cpu;
  void* stream = nullptr;  // cudaStream_t on the CUDA backend
};

// ---- GEMM --------------------------------------------------------------------------------------
// c = alpha * op(a) @ op(b) + beta * c, with op(x) = x^T when trans_x.
// a: [M, K] (or [K, M] when trans_a); b: [K, N] (or [N, K] when trans_b); c: [M, N].
// a and b share one dtype, f32 or bf16; c is f32 or bf16; accumulation is f32. Each 2-D operand needs
// a unit stride in its last dim; the row stride may be larger (views of wider tensors).
void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Context& ctx);
// The same per batch entry g: c[g] = alpha * op(a[g]) @ op(b[g]) + beta * c[g]; 3-D operands [G, ., .].
void gemm_batched(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
                  const Context& ctx);

// Grouped GEMM over contiguous row segments (MoE experts): group g owns rows [o_g, o_g + group_rows[g]) of
// a and c, with o_g the prefix sum. Groups with zero rows are allowed.
//   c[seg_g] = a[seg_g] @ op(b[g]) + beta * c[seg_g]
// a [R, K] f32|bf16; b [G, N, K] (trans_b) or [G, K, N], same dtype as a; c [R, N] f32|bf16.
void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const std::vector<int64_t>& group_rows,
                  float beta, const Context& ctx);
// Weight gradient of the above: c[g] = a[seg_g]^T @ b[seg_g] + beta * c[g].
// a [R, M], b [R, N] one dtype f32|bf16; c [G, M, N] f32. A group with no rows gets c[g] = beta * c[g].
void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const std::vector<int64_t>& group_rows,
                        float beta, const Context& ctx);

// ---- Embedding ---------------------------------------------------------------------------------
// out[n, :] = table[ids[n], :].  out [N, H] f32|bf16, ids [N] i32, table [V, H] f32.
// An id outside [0, V) raises Error naming the id and V.
void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, const Context& ctx);
// dtable[ids[n], :] += dout[n, :].  dtable [V, H] f32, dout [N, H] f32. Deterministic.
void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout, const Context& ctx);

// ---- Norms -------------------------------------------------------------------------------------
// RMSNorm: rstd[n] = 1 / sqrt(mean_h x[n,h]^2 + eps); y = x * rstd * w.
// y [N, H] f32|bf16, rstd [N] f32 (saved for backward), x [N, H] f32, w [H] f32.
void rmsnorm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, const Context& ctx);
// dx [N, H] f32 (written, or += when accumulate_dx), dw [H] f32 (+=), dy [N, H] f32|bf16.
void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      bool accumulate_dx, const Context& ctx);
// LayerNorm: y = (x - mean) * rstd * w + b.  mean, rstd [N] f32 saved; b [H] f32.
void layernorm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                       float eps, const Context& ctx);
void layernorm_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, bool accumulate_dx, const Context& ctx);

// ---- Attention ---------------------------------------------------------------------------------
// The fused QKV activation uses Megatron's layout, interleaved per KV group:
//   qkv [B, S, G, R + 2, D]  (stored as [B, S, G*(R+2)*D]); slots 0..R-1 of group g are query heads
//   g*R .. g*R+R-1, slot R is key head g, slot R+1 is value head g. Query heads = G*R.
struct QkvDims {
  int64_t B = 0;  // batch
  int64_t S = 0;  // sequence length
  int64_t G = 0;  // key/value heads (query groups)
  int64_t R = 0;  // query heads per group
  int64_t D = 0;  // head dim (even)
  int64_t width() const { return G * (R + 2) * D; }
  int64_t q_heads() const { return G * R; }
};

// Rotary table for positions 0..S-1: rope [S, D] f32, cos(pos * inv_freq_j) in column j and
// sin(...) in column D/2 + j, inv_freq_j = base^(-2j/D), j < D/2.
void rope_table(Tensor& rope, float base, const Context& ctx);
// Rotates the query and key slots of qkv in place (rotate-half convention: pairs (j, j + D/2)).
// qkv [B, S, G*(R+2)*D] f32|bf16. rope_backward applies the inverse rotation to a gradient in place.
void rope_forward(Tensor& qkv, const Tensor& rope, const QkvDims& dims, const Context& ctx);
void rope_backward(Tensor& dqkv, const Tensor& rope, const QkvDims& dims, const Context& ctx);

// Causal softmax attention with scale 1/sqrt(D); query head h reads key/value head h / R.
// out [B, S, G*R*D] (head-major columns), lse [B, G*R, S] f32 = log-sum-exp of each scaled score row,
// saved for backward. No [S, S] tensor is kept: backward recomputes scores block by block.
// qkv, out, dout and dqkv share one dtype, f32 or bf16; math is f32.
void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const QkvDims& dims, const Context& ctx);
// dqkv [B, S, G*(R+2)*D] written (query, key and value slots).
void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const QkvDims& dims, const Context& ctx);

// ---- Activations -------------------------------------------------------------------------------
// SwiGLU on Megatron's fused fc1 output: gate_up [N, 2F] = [gate | up]; out [N, F] = silu(gate) * up.
// All tensors share one dtype, f32 or bf16. dgate_up [N, 2F] written.
void swiglu_forward(Tensor& out, const Tensor& gate_up, const Context& ctx);
void swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up, const Context& ctx);
// GeLU (exact, erf form): out = x * Phi(x). out, x, dout, dx [N, F], one dtype, f32 or bf16.
void gelu_forward(Tensor& out, const Tensor& x, const Context& ctx);
void gelu_backward(Tensor& dx, const Tensor& dout, const Tensor& x, const Context& ctx);

// ---- Loss --------------------------------------------------------------------------------------
// Softmax cross-entropy on one chunk of logits, fused with its gradient. logits [N, V] f32 (row stride
// may exceed V); labels [N] i32, a negative label means "ignored" (loss 0, zero gradient).
// loss [N] f32 = logsumexp(logits[n]) - logits[n, labels[n]].
// With compute_grad, logits is overwritten by grad_scale * (softmax(logits[n]) - onehot(labels[n])), so
// no probability tensor is kept (callers chunk over tokens and reuse one logits buffer).
void softmax_cross_entropy(Tensor& loss, Tensor& logits, const Tensor& labels, float grad_scale, bool compute_grad,
                           const Context& ctx);

// ---- Elementwise -------------------------------------------------------------------------------
// out = a + b (out may alias a or b); all the same shape; f32 or bf16, any mix.
void add(Tensor& out, const Tensor& a, const Tensor& b, const Context& ctx);
// x *= alpha, f32.
void scale(Tensor& x, float alpha, const Context& ctx);
// Sum of squares of a float tensor, accumulated in double (for the global gradient norm).
double sum_squares(const Tensor& x, const Context& ctx);
// True when every element is finite.
bool all_finite(const Tensor& x, const Context& ctx);

// ---- Optimizer ---------------------------------------------------------------------------------
struct AdamWParams {
  float lr = 1e-3f;            // learning rate for this step
  float beta1 = 0.9f;          // first-moment decay
  float beta2 = 0.999f;        // second-moment decay
  float eps = 1e-8f;           // denominator term
  float weight_decay = 0.0f;   // decoupled decay (0 for norms and biases)
  int64_t step = 1;            // 1-based step for bias correction
  float grad_scale = 1.0f;     // multiplies the gradient first (gradient clipping, loss scaling)
};
// param, grad [*] f32; exp_avg, exp_avg_sq [*] f32 or bf16 (bf16 optimizer states).
// param -= lr*wd*param; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// param -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps).
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWParams& p,
                const Context& ctx);

}  // namespace moecore::ops
