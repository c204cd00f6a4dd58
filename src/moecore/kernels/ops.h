// The whole op vocabulary of moecore (with the router's ops in ops_router.h). Every module (nn/, moe/, model/)
// calls these, never a backend, and never addresses tensor data itself (tests/format/check_device_seam.cmake).
// Each op dispatches on the device of its tensors: kernels/cpu/ always (the reference), kernels/cuda/
// when built. Shapes and dtypes are checked on entry; a mismatch raises moecore::Error naming the op,
// the shapes and the dtypes.
//
// Gradient contract: parameter gradients accumulate (+=); activation gradients are written unless the
// op says otherwise (e.g. rmsnorm_backward's accumulate_dx for the residual stream).
// Threading: CPU ops use OpenMP over the calling thread's team; results do not depend on thread count
// except where an op says so (gemm, gemm_batched and the grouped GEMMs run oneDNN, whose last bits can
// change with the number of threads; they are deterministic for a fixed thread count).
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moecore/core/rng.h"
#include "moecore/core/tensor.h"
#include "moecore/kernels/common/glu.h"
#include "moecore/kernels/common/muon.h"

namespace moecore::ops {

// True when this build has the CUDA kernels (kernels/cuda/, built with -DMOECORE_CUDA=ON): every op then runs on a
// cuda context as well.
bool cuda_kernels_built();
// Why the libraries the CUDA kernels load at run time (cuBLAS, dlopen'ed) are unusable, naming each and where it was
// looked for; empty when they load. Without the CUDA kernels: says so.
std::string cuda_libraries_unavailable_reason();
// The kernel that gemm_grouped (gemm_grouped_wgrad) runs for these operands on a cuda context of this device: "tensor
// cores" (Hopper: CUTLASS's grouped GEMM) or "SIMT: <why not the tensor cores>". Benchmarks and the GPU tests name it.
std::string grouped_gemm_kernel(const Tensor& c, const Tensor& a, const Tensor& b, bool trans_b);
std::string grouped_wgrad_kernel(const Tensor& c, const Tensor& a, const Tensor& b);

// Execution context: where and how an op runs. Passed last to every op.
struct Context {
  Device device = Device::cpu;
  void* stream = nullptr;  // cudaStream_t on the CUDA backend
};

// Counter-based dropout. Element i of the op's logical tensor (its flat row-major index; each op below
// states it) is KEPT iff philox_uniform(key, i) >= p, and kept values are multiplied by s = 1 / (1 - p),
// computed once in f32. Nothing is saved: backward regenerates the same mask from (key, i), so callers
// keep only the key (one fresh key per call site and step, e.g. philox_key(seed, "layer3.attn.step42")).
// The mask depends on (key, i) alone: not on threads, blocking or device. p = 0 is the identity and
// draws no random numbers. An op given p outside [0, 1) raises Error naming p.
struct Dropout {
  float p = 0.0f;   // drop probability in [0, 1); 0 = identity
  PhiloxKey key{};  // Philox key of this mask
  bool active() const { return p > 0.0f; }
};

// ---- GEMM --------------------------------------------------------------------------------------
// c = alpha * op(a) @ op(b) + beta * c, with op(x) = x^T when trans_x.
// a: [M, K] (or [K, M] when trans_a); b: [K, N] (or [N, K] when trans_b); c: [M, N].
// a and b share one dtype, f32, bf16 or f16; c is f32, bf16 or f16; accumulation is f32. Each 2-D operand needs
// a unit stride in its last dim; the row stride may be larger (views of wider tensors).
void gemm(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
          const Context& ctx);
// The same per batch entry g: c[g] = alpha * op(a[g]) @ op(b[g]) + beta * c[g]; 3-D operands [G, ., .].
void gemm_batched(Tensor& c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha, float beta,
                  const Context& ctx);

// Grouped GEMM over contiguous row segments (MoE experts): group g owns rows [o_g, o_g + n_g) of a and c,
// with n = group_rows ([G] i64 on the op's device: the per-expert counts never visit the host) and o_g its
// prefix sum. Groups with zero rows are allowed; the counts may sum to fewer than R rows (buffers sized for
// the worst case): rows past the sum are neither read nor written. A negative count or a sum above R raises.
//   c[seg_g] = a[seg_g] @ op(b[g]) + beta * c[seg_g]
// a [R, K] f32|bf16|f16; b [G, N, K] (trans_b) or [G, K, N], same dtype as a; c [R, N] f32|bf16|f16.
void gemm_grouped(Tensor& c, const Tensor& a, const Tensor& b, bool trans_b, const Tensor& group_rows, float beta,
                  const Context& ctx);
// Weight gradient of the above: c[g] = a[seg_g]^T @ b[seg_g] + beta * c[g].
// a [R, M], b [R, N] one dtype f32|bf16|f16; c [G, M, N] f32. A group with no rows gets c[g] = beta * c[g].
void gemm_grouped_wgrad(Tensor& c, const Tensor& a, const Tensor& b, const Tensor& group_rows, float beta,
                        const Context& ctx);

// ---- MoE token permutation (docs/megatron-moe-spec.md §5.1) ---------------------------------------------
// Rows are grouped by expert (ascending), and within an expert by ascending source token. Every count,
// offset and index below is a tensor on the op's device: the host never reads them to launch the next op.
//
// The plan of a routing map [T, E] bool: counts [E] i64 (rows per expert), offsets [E + 1] i64 (prefix sums),
// token_rows [T, E] i32 (the row of routed pair (t, e), -1 where not routed), row_token [M] i32 (the token of
// each row; rows from offsets[E] to M are set to -1). Raises when the routed pairs exceed M rows.
void moe_plan(Tensor& counts, Tensor& offsets, Tensor& token_rows, Tensor& row_token, const Tensor& map,
              const Context& ctx);
// rows[r] = x[row_token[r]] and row_probs[r] = probs[row_token[r], e(r)] (e(r): the expert whose segment of
// offsets holds r) for r < offsets[E]; later rows are untouched. x [T, H] f32|bf16|f16 and rows [M, H] f32|bf16|f16
// (any mix; unit last strides); probs [T, E] f32 and row_probs [M] f32, or both undefined (rows only).
void moe_permute(Tensor& rows, Tensor& row_probs, const Tensor& x, const Tensor& probs, const Tensor& row_token,
                 const Tensor& offsets, const Context& ctx);
// y[t] = sum over e ascending with token_rows[t, e] >= 0 of rows[token_rows[t, e]] (f32 sum, one rounding;
// 0 for a token routed nowhere), or y += that sum with accumulate. y [T, H] f32, rows [M, H] f32|bf16|f16, unit
// last strides; token_rows [T, E] i32.
void moe_unpermute(Tensor& y, const Tensor& rows, const Tensor& token_rows, bool accumulate, const Context& ctx);
// out[t, e] = values[token_rows[t, e]] where routed, else 0. out [T, E] f32 (unit last stride: it may be a
// column block of a wider tensor), values [M] f32, token_rows [T, E] i32.
void moe_unpermute_probs(Tensor& out, const Tensor& values, const Tensor& token_rows, const Context& ctx);
// The all-to-all dispatcher's chunk sort. chunk_counts [P * El] i64 holds the rows of chunk (s, le), source
// rank s and local expert le. The receive layout orders chunks [s][le], the expert layout [le][s].
// inverse = false: out (expert layout) <- in (receive layout); true: out (receive layout) <- in (expert).
// out and in: contiguous, one dtype, rows along dim 0; rows past the chunks are untouched.
void moe_sort_chunks(Tensor& out, const Tensor& in, const Tensor& chunk_counts, int64_t P, int64_t El, bool inverse,
                     const Context& ctx);
// Rows per local expert of the expert layout: counts[le] = sum_s chunk_counts[s * El + le]; offsets [El + 1]
// their prefix sums. chunk_counts [P * El], counts [El], offsets [El + 1], all i64.
void moe_chunk_counts(Tensor& counts, Tensor& offsets, const Tensor& chunk_counts, int64_t P, const Context& ctx);

// ---- MoE ECHO: elastic cloning of hot experts (docs/echo-folding-perf.md §A) ----------------------------
// P expert-parallel ranks, rank r hosting the home experts [r El, (r + 1) El) of E = P El; S = P Sl clone slots, slot j
// on rank j / Sl. The extended expert columns E' = P (El + Sl) put each rank's block as [home experts..., slots...]:
// home expert e is column (e / El)(El + Sl) + e % El, slot j is column (j / Sl)(El + Sl) + El + j % Sl.
//
// The planner, from counts [P, E] i64 (routed pairs source rank s sends to expert e; the same on every rank, so every
// rank computes the same plan). load_e = sum_s counts[s, e]; a rank's load is the sum over its experts; avg =
// floor(total / P). Step 1: spare[r] = max(0, avg - load_r); on each rank the experts sorted by load ascending (ties:
// lower index first) and summed, the part of each expert above avg is its spill. Step 2, slots_per_rank == 1
// (approximate bin packing): spills in 8 FIFO buckets (bucket 0: spill >= avg; 1..7: equal intervals of [0, avg) from
// the top), filled by spill descending; ranks by spare descending (ties: lower rank) each take the head of the first
// non-empty bucket and run min(spill, spare) of its pairs in their slot, the rest re-queued by its new size.
// slots_per_rank > 1 (water-filling): spills descending and spares descending laid on one number line, their overlaps
// the transfers; each rank keeps its slots_per_rank largest (ties: lower expert), in that order in its slots. Step 3:
// each slot's budget over the source ranks, floor(budget counts[s, e] / load_e) each, then the residues from the
// sources in rank order out of what they have left. seed != 0 (debug mode): slot j clones an expert of another rank
// drawn from (seed, j) with pairs left, and takes 20-40 % (drawn likewise) of its pairs not yet moved. Outputs:
// slot_expert [S] i64 (-1: empty slot), slot_tokens [P, S] i64 (pairs of source s run in slot j; a slot's row sums to
// its budget), loads [2, P] i64 (pairs each rank receives before and after the plan).
void moe_echo_plan(Tensor& slot_expert, Tensor& slot_tokens, Tensor& loads, const Tensor& counts,
                   int64_t slots_per_rank, uint64_t seed, const Context& ctx);
// The local rerouting of source rank `rank`: the first slot_tokens[rank, j] tokens (ascending) routed to expert e =
// slot_expert[j] and not taken by a lower slot of e move, with their probability, from e's column to slot j's; the
// rest keep their columns. map [T, E] bool, probs [T, E] f32 (0 where not routed); map2 [T, E'] bool, probs2 [T, E']
// f32 written. A slot asking for more tokens than the rank routes to its expert raises.
void moe_echo_reroute(Tensor& map2, Tensor& probs2, const Tensor& map, const Tensor& probs, const Tensor& slot_expert,
                      const Tensor& slot_tokens, int64_t rank, int64_t slots_per_rank, const Context& ctx);
// The fold back to the home experts: out[t, e] = in[t, column of e] + in[t, column of each slot of e] (slots
// ascending; bool: or). in [T, E'], out [T, E], f32 or bool (one dtype). With one non-zero entry per routed pair (the
// rerouted map, probabilities or their gradients) the fold is exact.
void moe_echo_fold(Tensor& out, const Tensor& in, const Tensor& slot_expert, int64_t slots_per_rank,
                   const Context& ctx);

// ---- MoE expert rows ---------------------------------------------------------------------------
// The routing probability applied after the activation: a[r, :] = act[r, :] * p[r] for r < rows, with rows
// the sum of group_rows ([G] i64; later rows untouched). a, act [M, F] one dtype f32|bf16|f16, contiguous; p [M] f32.
void moe_scale_rows(Tensor& a, const Tensor& act, const Tensor& p, const Tensor& group_rows, const Context& ctx);
// Its backward, fused. With da = dL/da on entry, for r < rows: dp[r] = act[r, :] . da[r, :] (added to dp[r] when
// accumulate), da[r, :] *= p[r] (becomes dL/dact), and a[r, :] = act[r, :] * p[r] is recomputed bit-identically
// (the fc2 weight gradient reads it).
void moe_scale_rows_backward(Tensor& dp, Tensor& da, Tensor& a, const Tensor& act, const Tensor& p,
                             const Tensor& group_rows, bool accumulate, const Context& ctx);
// The shared expert's gate: s[t] = sigmoid(x[t, :] . g); y[t, :] += s[t] * out[t, :].
// y, out [T, H] f32; s [T] f32; x [T, H] f32|bf16|f16; g [H] f32; all contiguous.
void moe_shared_gate_forward(Tensor& y, Tensor& s, const Tensor& x, const Tensor& g, const Tensor& out,
                             const Context& ctx);
// Its backward: dout[t, :] = dy[t, :] * s[t] (written, the dtype of x); with dz[t] = (dy[t] . out[t]) s (1 - s):
// dx[t, :] += dz[t] * g and dg += sum_t dz[t] x[t, :] (in token order per column: deterministic).
void moe_shared_gate_backward(Tensor& dout, Tensor& dx, Tensor& dg, const Tensor& dy, const Tensor& x, const Tensor& g,
                              const Tensor& out, const Tensor& s, const Context& ctx);

// ---- Embedding ---------------------------------------------------------------------------------
// out[n, :] = table[ids[n], :].  out [N, H] f32|bf16|f16, ids [N] i32, table [V, H] f32.
// An id outside [0, V) raises Error naming the id and V.
void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, const Context& ctx);
// dtable[ids[n], :] += dout[n, :].  dtable [V, H] f32, dout [N, H] f32. Deterministic.
void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout, const Context& ctx);
// The vocabulary-parallel embedding (Megatron's VocabParallelEmbedding): this rank's table holds ids
// [vocab_start, vocab_start + Vl). out[n, :] = table[ids[n] - vocab_start, :] for ids in that range, 0 otherwise
// (the sum over the group's ranks is the whole lookup). An id outside [0, vocab_size) raises Error naming it.
// out [N, H] f32, ids [N] i32, table [Vl, H] f32.
void embedding_forward_shard(Tensor& out, const Tensor& ids, const Tensor& table, int64_t vocab_start,
                             int64_t vocab_size, const Context& ctx);
// dtable[ids[n] - vocab_start, :] += dout[n, :] for ids in this rank's range. dtable [Vl, H] f32, dout [N, H] f32.
// Deterministic (token order per element).
void embedding_backward_shard(Tensor& dtable, const Tensor& ids, const Tensor& dout, int64_t vocab_start,
                              const Context& ctx);

// ---- Norms -------------------------------------------------------------------------------------
// RMSNorm: rstd[n] = 1 / sqrt(mean_h x[n,h]^2 + eps); y = x * rstd * w.
// y [N, H] f32|bf16|f16, rstd [N] f32 (saved for backward), x [N, H] f32, w [H] f32.
void rmsnorm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, const Context& ctx);
// dx [N, H] f32 (written, or += when accumulate_dx), dw [H] f32 (+=), dy [N, H] f32|bf16|f16.
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
  int64_t B = 0;   // batch
  int64_t S = 0;   // sequence length (of the queries)
  int64_t G = 0;   // key/value heads (query groups)
  int64_t R = 0;   // query heads per group
  int64_t D = 0;   // head dim (even)
  int64_t Sk = 0;  // keys, when longer than the queries (context parallelism); 0: Sk = S
  int64_t width() const { return G * (R + 2) * D; }
  int64_t q_heads() const { return G * R; }
  int64_t keys() const { return Sk ? Sk : S; }
};

// Rotary table for positions 0..S-1 over the rotary dim Dr = rope.size(1) (Megatron's --rotary-percent:
// Dr = D * percent; even, 2 <= Dr <= D): rope [S, Dr] f32, cos(pos * inv_freq_j) in column j and
// sin(...) in column Dr/2 + j, inv_freq_j = base^(-2j/Dr), j < Dr/2.
void rope_table(Tensor& rope, float base, const Context& ctx);
// Rotates the first Dr channels of every query and key head of qkv in place (rotate-half convention:
// pairs (j, j + Dr/2), j < Dr/2); channels Dr..D-1 and the value heads are untouched. Dr = D rotates whole
// heads. qkv [B, S, G*(R+2)*D] f32|bf16|f16; rope [S', Dr] with S' >= S. rope_backward applies the inverse
// rotation to a gradient in place. An odd Dr or Dr > D raises Error naming Dr and D.
void rope_forward(Tensor& qkv, const Tensor& rope, const QkvDims& dims, const Context& ctx);
void rope_backward(Tensor& dqkv, const Tensor& rope, const QkvDims& dims, const Context& ctx);

// Causal softmax attention with scale 1/sqrt(D); query head h reads key/value head h / R.
//   P = softmax(QK^T / sqrt(D), causal);  out = (P o M * s) V   (o: elementwise; s = 1 / (1 - p))
// The queries are the last S positions of the Sk = dims.keys() keys: query i sits at position Sk - S + i and sees
// keys 0 .. Sk - S + i (Sk = S: ordinary causal self-attention; Sk > S: a chunk of a sequence whose earlier keys were
// gathered from other ranks, context parallelism). q holds the queries in its query slots, kv the keys and values in
// its key and value slots; in the self-attention form both are one qkv tensor.
// M is the dropout keep mask (see Dropout) of element ((b*Hq + h)*Sk + Sk - S + i)*Sk + j, Hq = G*R query heads,
// i the query and j the key; with p = 0 there is no mask and no mask work.
// q [B, S, G*(R+2)*D]; kv [B, Sk, G*(R+2)*D] with unit stride in the last dim and rows of the width apart (a dim-1
// slice of a longer tensor is fine: its batch stride may be larger). out [B, S, G*R*D] (head-major columns),
// lse [B, G*R, S] f32 = log-sum-exp of each scaled score row (of the undropped scores), saved for backward. No
// [S, Sk] tensor is kept: backward recomputes scores and the mask block by block. q, kv, out, dout, dq and dkv share
// one dtype, f32, bf16 or f16; math is f32.
//
// AttentionOptions add Megatron's sliding window (--window-size) and attention sinks (--softmax-type, gpt-oss): with a
// window W >= 0 the query at position p sees keys max(0, p - W) .. p only (W + 1 keys; kernels/common/
// attention_window.h), and key blocks wholly outside every row's window are skipped. With a sink logit s_h (the same
// for all rows of query head h, not scaled by 1/sqrt(D)), each row's softmax runs over [scaled scores, s_h] and the
// sink's column is dropped: P_ij = exp(x_ij - lse_i) with lse_i = log(exp(s_h) + sum_j exp(x_ij)), so the rows sum to
// 1 - P_sink,i. lse includes the sink, so the backward's dS is unchanged; the sink's gradient is
// dL/ds_h = - sum over (b, i) of P_sink,i * D_i, D_i = rowsum(dO_i o out_i).
struct AttentionOptions {
  int64_t window = -1;            // keys p - window .. p; -1: no window (every earlier key)
  bool off_by_one = false;        // a sink logit of 0 for every head (Megatron's off-by-one softmax, no parameter)
  const Tensor* sinks = nullptr;  // [Hq] f32 on the op's device: one learnable sink logit per query head, or null
  bool has_sink() const { return off_by_one || sinks != nullptr; }
};
void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& kv, const QkvDims& dims,
                       const Dropout& dropout, const AttentionOptions& opt, const Context& ctx);
inline void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& kv, const QkvDims& dims,
                              const Dropout& dropout, const Context& ctx) {
  attention_forward(out, lse, q, kv, dims, dropout, AttentionOptions{}, ctx);
}
// dq [B, S, W]: its query slots written; dkv [B, Sk, W] (strided like kv): its key and value slots written; no
// other column of either is touched, so dq and dkv may be one tensor in the self-attention form. dropout must be
// the forward's. With Pd = P o M * s: dV = Pd^T dO, dP = (dO V^T) o M * s, dS = P o (dP - rowsum(dO o out)), dQ, dK
// from dS. dq and dkv must not share memory with q, kv or dout.
// dsinks [Hq] f32 (+=; null: no sink gradient, as off-by-one) with opt.sinks; opt must be the forward's.
void attention_backward(Tensor& dq, Tensor& dkv, Tensor* dsinks, const Tensor& dout, const Tensor& q, const Tensor& kv,
                        const Tensor& out, const Tensor& lse, const QkvDims& dims, const Dropout& dropout,
                        const AttentionOptions& opt, const Context& ctx);
inline void attention_backward(Tensor& dq, Tensor& dkv, const Tensor& dout, const Tensor& q, const Tensor& kv,
                               const Tensor& out, const Tensor& lse, const QkvDims& dims, const Dropout& dropout,
                               const Context& ctx) {
  attention_backward(dq, dkv, nullptr, dout, q, kv, out, lse, dims, dropout, AttentionOptions{}, ctx);
}
// The self-attention form: queries, keys and values all in qkv [B, S, W] (dims.Sk 0 or S).
inline void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const QkvDims& dims, const Dropout& dropout,
                              const Context& ctx) {
  attention_forward(out, lse, qkv, qkv, dims, dropout, ctx);
}
inline void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                               const Tensor& lse, const QkvDims& dims, const Dropout& dropout, const Context& ctx) {
  attention_backward(dqkv, dqkv, dout, qkv, qkv, out, lse, dims, dropout, ctx);
}
inline void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const QkvDims& dims, const Dropout& dropout,
                              const AttentionOptions& opt, const Context& ctx) {
  attention_forward(out, lse, qkv, qkv, dims, dropout, opt, ctx);
}
inline void attention_backward(Tensor& dqkv, Tensor* dsinks, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                               const Tensor& lse, const QkvDims& dims, const Dropout& dropout,
                               const AttentionOptions& opt, const Context& ctx) {
  attention_backward(dqkv, dqkv, dsinks, dout, qkv, qkv, out, lse, dims, dropout, opt, ctx);
}

// ---- Activations -------------------------------------------------------------------------------
// The gated linear unit on Megatron's fused fc1 output: gate_up [N, 2F] = [gate | up]; out [N, F] = act(gate) * up
// with the activation, offset and clamps of GluParams (kernels/common/glu.h; GluParams{} is SwiGLU: silu(gate) * up).
// All tensors share one dtype, f32, bf16 or f16. dgate_up [N, 2F] written.
void glu_forward(Tensor& out, const Tensor& gate_up, const GluParams& p, const Context& ctx);
void glu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up, const GluParams& p, const Context& ctx);
// GeLU (exact, erf form): out = x * Phi(x). out, x, dout, dx [N, F], one dtype, f32, bf16 or f16.
void gelu_forward(Tensor& out, const Tensor& x, const Context& ctx);
void gelu_backward(Tensor& dx, const Tensor& dout, const Tensor& x, const Context& ctx);
// An MLP's activation (MlpActivation, kernels/common/glu.h) on its fc1 output: glu_forward / glu_backward or
// gelu_forward / gelu_backward. Every MLP (dense, routed and shared experts) goes through this pair.
void mlp_activation_forward(Tensor& act, const Tensor& h, const MlpActivation& a, const Context& ctx);
void mlp_activation_backward(Tensor& dh, const Tensor& dact, const Tensor& h, const MlpActivation& a,
                             const Context& ctx);

// ---- Loss --------------------------------------------------------------------------------------
// Softmax cross-entropy on one chunk of logits, fused with its gradient. logits [N, V] f32 (row stride
// may exceed V); labels [N] i32, a negative label means "ignored" (loss 0, zero gradient).
// loss [N] f32 = logsumexp(logits[n]) - logits[n, labels[n]].
// With compute_grad, logits is overwritten by grad_scale * (softmax(logits[n]) - onehot(labels[n])), so
// no probability tensor is kept (callers chunk over tokens and reuse one logits buffer).
void softmax_cross_entropy(Tensor& loss, Tensor& logits, const Tensor& labels, float grad_scale, bool compute_grad,
                           const Context& ctx);
// Vocabulary-parallel softmax cross-entropy (Megatron's VocabParallelCrossEntropy): each rank of a tensor-parallel
// group holds the logits of vocabulary ids [vocab_start, vocab_start + Vl) of every token, so no [N, V] row exists on
// any rank. Three local steps around one all-gather of the per-rank row statistics (the caller's):
//   vocab_parallel_ce_stats   stats [N, 3] f32 = (row max m_r, sum_v exp(z - m_r), z[label] if this rank owns the
//                             label else 0), logits [N, Vl] f32 (row stride may exceed Vl), labels [N] i32 global ids
//                             (negative: ignored)
//   (all_gather of stats over the group: gathered [P, N, 3], rank order)
//   vocab_parallel_ce_merge   lse [N, 2] f32 = (log-sum-exp over all ranks' rows, merged in rank order from each
//                             rank's (m_r, s_r); the label's logit, summed over ranks: exactly one is non-zero)
//   vocab_parallel_ce_finish  loss [N] f32 = lse - z[label] (0 for ignored labels); with compute_grad, logits is
//                             overwritten by grad_scale * (exp(z - lse) - onehot) on this rank's columns.
// A label outside [0, V) raises Error in the merge (V = P * Vl), naming the label.
void vocab_parallel_ce_stats(Tensor& stats, const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                             const Context& ctx);
void vocab_parallel_ce_merge(Tensor& lse, const Tensor& gathered, const Tensor& labels, int64_t vocab_size,
                             const Context& ctx);
void vocab_parallel_ce_finish(Tensor& loss, Tensor& logits, const Tensor& lse, const Tensor& labels,
                              int64_t vocab_start, float grad_scale, bool compute_grad, const Context& ctx);
// The loss totals of a chunk, kept on the device: totals[0] += loss[n] for n in order (one running double sum
// across calls, so chunking does not change the bits) and
// totals[1] += the number of labels >= 0 (the counted tokens). totals [2] f64, loss [N] f32, labels [N] i32.
void loss_totals(Tensor& totals, const Tensor& loss, const Tensor& labels, const Context& ctx);

// ---- Dropout and biases ------------------------------------------------------------------------
// y = dropout(x): y[i] = x[i] * M[i] * s, i the flat index. y, x contiguous, same shape and dtype (f32 or
// bf16); y may alias x. dropout_backward applies the same mask to a gradient: dx = dy * M * s (written;
// dx may alias dy).
void dropout_forward(Tensor& y, const Tensor& x, const Dropout& d, const Context& ctx);
void dropout_backward(Tensor& dx, const Tensor& dy, const Dropout& d, const Context& ctx);
// Megatron's bias-dropout-add: y[n, :] = residual[n, :] + dropout(x[n, :] + bias), mask index n*H + h.
// y, residual [N, H] f32 (y may alias residual); x [N, H] f32|bf16|f16; bias [H] f32, or an undefined
// Tensor for no bias. All contiguous.
void bias_dropout_add(Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& bias, const Dropout& d,
                      const Context& ctx);
// dx [N, H] f32|bf16|f16 = dy * M * s (written); dbias [H] f32 += column sums of that dx, taken in double
// from the unrounded f32 values in an order fixed by the shapes; an undefined dbias skips them.
// dy [N, H] f32. The residual's gradient is dy itself: the caller passes it on.
void bias_dropout_add_backward(Tensor& dx, Tensor& dbias, const Tensor& dy, const Dropout& d, const Context& ctx);

// Linear-layer biases. y, dy [N, W] (or [R, W]) f32|bf16|f16 with a unit last stride; the row stride may be
// larger (views of wider tensors). Biases and their gradients are contiguous f32. Column sums run in
// double over fixed row chunks in an order fixed by the shapes, so they do not depend on threads.
// y[n, :] += bias [W].
void bias_add(Tensor& y, const Tensor& bias, const Context& ctx);
// dbias[w] += sum_n dy[n, w].
void bias_grad(Tensor& dbias, const Tensor& dy, const Context& ctx);
// Grouped versions for MoE experts, rows in contiguous segments as in gemm_grouped (group_rows [G] i64 on
// the op's device): group g owns rows [o_g, o_g + group_rows[g]) of y/dy, o_g the prefix sum; groups may be
// empty. Rows past the sum of group_rows (padding) are neither written nor read. bias, dbias [G, W] f32.
//   bias_add_grouped:   y[r, :] += bias[g(r), :]
//   bias_grad_grouped:  dbias[g, :] += sum_{r in g} dy[r, :]
void bias_add_grouped(Tensor& y, const Tensor& bias, const Tensor& group_rows, const Context& ctx);
void bias_grad_grouped(Tensor& dbias, const Tensor& dy, const Tensor& group_rows, const Context& ctx);
// The fc2 bias of MoE experts weighted by routing probabilities, row_scale [R] f32:
//   bias_add_grouped_scaled:   y[r, :] += row_scale[r] * bias[g(r), :]
//   bias_grad_grouped_scaled:  dbias[g, :] += sum_{r in g} row_scale[r] * dy[r, :]    (+=)
//                              drow_scale[r] = dy[r, :] . bias[g(r), :]               (written, not +=;
//                              padding rows untouched; an undefined drow_scale is skipped)
void bias_add_grouped_scaled(Tensor& y, const Tensor& bias, const Tensor& row_scale, const Tensor& group_rows,
                             const Context& ctx);
void bias_grad_grouped_scaled(Tensor& dbias, Tensor& drow_scale, const Tensor& dy, const Tensor& bias,
                              const Tensor& row_scale, const Tensor& group_rows, const Context& ctx);

// ---- Elementwise -------------------------------------------------------------------------------
// out = a + b (out may alias a or b); all the same shape; f32, bf16 or f16, any mix.
void add(Tensor& out, const Tensor& a, const Tensor& b, const Context& ctx);
// x *= alpha, f32.
void scale(Tensor& x, float alpha, const Context& ctx);
// out [B, A, W] = in [A, B, W] with the leading two dimensions swapped (batch-major [B, S, H] <-> Megatron's
// sequence-major [S, B, H]); one float dtype, contiguous, out must not alias in.
void transpose_01(Tensor& out, const Tensor& in, const Context& ctx);
// The query or key slots of the fused QKV activation as rows of one head (QK-norm):
//   packed [T*G*count, D], row (t*G + g)*count + j  <->  qkv [T, G*(R+2)*D], slot `slot + j` of group g,
// for every token t (qkv may be [B, S, width]). Slots 0..R-1 are the queries, slot R the key. Any float dtypes;
// values convert. Contiguous tensors that do not overlap.
void qkv_slots_gather(Tensor& packed, const Tensor& qkv, const QkvDims& dims, int64_t slot, int64_t count,
                      const Context& ctx);
void qkv_slots_scatter(Tensor& qkv, const Tensor& packed, const QkvDims& dims, int64_t slot, int64_t count,
                       const Context& ctx);
// acc [1] f64 += the sum of squares of a float tensor, in double, in an order fixed by x's shape (the bits do not
// depend on the thread count). acc stays on the device: a caller adds every gradient into it and reads it once (the
// global gradient norm costs one host read per step, not one per parameter). acc may be a slot of a wider tensor.
void sum_squares(Tensor& acc, const Tensor& x, const Context& ctx);
// flag [1] i32 is set to 1 when x holds a NaN or an infinity, and left alone otherwise (one slot per tensor, read
// once).
void flag_nonfinite(Tensor& flag, const Tensor& x, const Context& ctx);
// acc [1] i64 += the number of elements of a float tensor that are zero once multiplied by scale in f32
// (x * scale == 0: x == 0, or an underflow), e.g. the zeros of a gradient after clipping by scale (Megatron's
// count_zeros_fp32 counts after its in-place clipping). Exact and order-free; acc stays on the device (read once).
void count_zeros(Tensor& acc, const Tensor& x, float scale, const Context& ctx);

// ---- Optimizer ---------------------------------------------------------------------------------
struct AdamWParams {
  float lr = 1e-3f;           // learning rate for this step
  float beta1 = 0.9f;         // first-moment decay
  float beta2 = 0.999f;       // second-moment decay
  float eps = 1e-8f;          // denominator term
  float weight_decay = 0.0f;  // decoupled decay (0 for norms and biases)
  int64_t step = 1;           // 1-based step for bias correction
  float grad_scale = 1.0f;    // multiplies the gradient first (gradient clipping, loss scaling)
};
// param [*] f32 (bf16 or f16 main parameters: the f32 update rounded to nearest even), grad [*] f32; exp_avg,
// exp_avg_sq [*] f32 or bf16 (bf16 optimizer states).
// param -= lr*wd*param; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// param -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps).
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWParams& p,
                const Context& ctx);

// Lion (Chen et al. 2023; emerging_optimizers' Lion, Megatron's --muon-scalar-optimizer lion). param, grad, exp_avg
// [*] f32, contiguous, one shape; with g = grad * grad_scale:
// param *= 1 - lr*wd; c = b1*m + (1-b1)*g; m += (1-b2)*(g - m); param -= lr * sign(c).
struct LionParams {
  float lr = 1e-4f;
  float beta1 = 0.95f;        // --lion-beta1 (the sign's interpolation)
  float beta2 = 0.98f;        // --lion-beta2 (the momentum's decay)
  float weight_decay = 0.0f;  // decoupled decay (0 for norms and biases)
  float grad_scale = 1.0f;    // multiplies the gradient first (gradient clipping)
};
void lion_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, const LionParams& p, const Context& ctx);

// Muon (docs/muon-spec.md §3; optim/muon.h decides which matrices and how they are cut and scaled).
// momentum [*] f32 <- beta * momentum + (1 - beta) * grad * grad_scale; u [*] f32 <- the matrix to orthogonalise:
// (1 - beta) * grad * grad_scale + beta * momentum (the new one) with nesterov, else the new momentum. All contiguous,
// one shape; u must not alias the others.
struct MuonMomentumParams {
  float beta = 0.9f;        // --muon-momentum
  bool nesterov = false;    // --muon-nesterov
  float grad_scale = 1.0f;  // the clip scale
};
void muon_momentum(Tensor& u, Tensor& momentum, const Tensor& grad, const MuonMomentumParams& p, const Context& ctx);
// param [*] f32 <- param * (1 - lr * weight_decay) - lr * o, o [*] f32 the scaled orthogonalised update (decoupled
// decay before the step, as emerging_optimizers applies it). Contiguous, one shape.
void muon_update(Tensor& param, const Tensor& o, float lr, float weight_decay, const Context& ctx);

// Newton-Schulz orthogonalisation (emerging_optimizers v0.3.0's newton_schulz), in place on each matrix of x [G, M, N]
// (or x [M, N]) f32, contiguous:
//   X = x (transposed when M > N, so that the Gram A is the smaller side; or as `transpose` forces it),
//   X /= max(||X||_F, eps), then `steps` times  A = X X^T;  B = b A + c A A;  X = a X + B X  with step k's (a, b, c)
//   (common/muon.h), each product one GEMM rounded once into the iterate's dtype. With bf16 (Megatron's
//   --muon-fp32-matmul-prec medium) the normalised X is cast to bf16 and every product reads and writes bf16 with f32
//   accumulation, as PyTorch's addmm on bf16; else all is f32. The result is cast back to f32 into x.
// sum_over_shards (Muon's distributed TP mode, x one shard of matrices split along the dim the Gram contracts): when
// set, it is called on the [G] f64 squared norms and on each step's Gram [G, r, r] and must replace them by their sum
// over the shards. Temporaries (the iterate, A, B: about 2 G r (r + max(M, N)) elements) are allocated per call.
struct NewtonSchulz {
  int steps = 5;                                          // --muon-num-ns-steps
  NsCoefficients coefficients = NsCoefficients::quintic;  // --muon-coefficient-type
  bool bf16 = true;                                       // --muon-fp32-matmul-prec medium
  int transpose = -1;                                     // -1: when M > N; 0 or 1: forced
  float eps = 1e-7f;                                      // the norm's floor (emerging_optimizers v0.3.0)
};
void newton_schulz(Tensor& x, const NewtonSchulz& p, const std::function<void(Tensor&)>& sum_over_shards,
                   const Context& ctx);

// ---- FP8 quantisation (docs/fp8-spec.md §3-4; the arithmetic: common/fp8.h) ---------------------------------
// x [M, K] (f32 or bf16) cut into blocks of block_rows x block_cols (0: the whole dimension; edge blocks partial), each
// block quantised with its scale: q [M, K] (f8e4m3 or f8e5m2) = fp8(fp32(x * scale)), rounded to nearest even,
// saturating to +-max (infinities too; NaN the canonical 0x7F), as Transformer Engine's kernels cast; scale_inv
// [ceil(M / block_rows), ceil(K / block_cols)] f32 = each block's 1 / scale (rounded to f32), which dequantises it.
// A block's scale from its amax = max |x| (NaN skipped):
//   given        `scale` for every block (delayed scaling: the slot's stored scale)
//   current      TE's compute_scale_from_amax: fp8_max / amax (amax 0, inf or NaN: 1; an infinite quotient:
//                inf_scale) -- per-tensor current scaling with one block
//   current_pow2 the same rounded down to a power of two (the blockwise recipe: 1 x 128 activations and gradients,
//                128 x 1 for the wgrad copies, 128 x 128 weights; inf_scale the input dtype's largest finite value)
//   mx           MXFP8's E8M0: scale_inv = 2^ceil(log2(fp32(amax * fp32(1 / fp8_max)))) (1 x 32 rows, 32 x 1 columns)
// amax_out (optional, [1] f32): max |x| over the whole tensor, NaN skipped (delayed scaling's row 0, maxed into: the
// value it holds is kept when larger). Elementwise within blocks: any thread split gives the same bits.
enum class Fp8ScaleRule : uint8_t { given, current, current_pow2, mx };
struct Fp8Quantize {
  int64_t block_rows = 0, block_cols = 0;  // 0: the whole dimension
  Fp8ScaleRule rule = Fp8ScaleRule::current;
  float scale = 1.0f;                  // given
  float inf_scale = 3.4028234664e38f;  // current, current_pow2: the scale of an infinite quotient (FLT_MAX)
};
void fp8_quantize(const Tensor& x, Tensor& q, Tensor& scale_inv, Tensor* amax_out, const Fp8Quantize& p,
                  const Context& ctx);
// x [M, K] (f32 or bf16) <- fp32(q * scale_inv of its block), q and scale_inv as fp8_quantize wrote them.
void fp8_dequantize(const Tensor& q, const Tensor& scale_inv, Tensor& x, int64_t block_rows, int64_t block_cols,
                    const Context& ctx);

}  // namespace moecore::ops
