// CUDA elementwise ops (add, scale, SwiGLU, exact GeLU), the reductions of elementwise.cpp (sum_squares,
// flag_nonfinite, count_zeros), the layout copies (transpose_01, qkv slot gather / scatter), rotary embeddings and the
// AdamW step. Same formulas as the CPU kernels, f32 math, bf16 and f16 stored round-to-nearest-even; expf / erfcf are
// CUDA's (within 2 ulp) where the CPU uses its own polynomials (~1 ulp), so results agree within f32 tolerances.
// Deterministic: sum_squares reduces fixed 8192-element chunks in double in a fixed tree, then adds the chunk sums
// in chunk order on one thread (the CPU's chunking); flag_nonfinite only ever stores 1; count_zeros adds integers.
#include <cmath>

#include "moecore/kernels/common/adamw.h"
#include "moecore/kernels/common/glu.h"
#include "moecore/kernels/common/lion.h"
#include "moecore/kernels/common/muon.h"
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {
namespace {

template <class TO, class TA, class TB>
__global__ void add_kernel(TO* out, const TA* a, const TB* b, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) st(out[i], ld(a[i]) + ld(b[i]));
}

__global__ void scale_kernel(float* x, float alpha, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) x[i] *= alpha;
}

constexpr int64_t kSumChunk = 8192;

template <class T>
__global__ void sum_squares_chunks_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double shared[32];
  const int64_t c0 = int64_t{blockIdx.x} * kSumChunk, c1 = c0 + kSumChunk < n ? c0 + kSumChunk : n;
  double s = 0.0;
  for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
    const double v = ld(x[i]);
    s += v * v;
  }
  s = block_reduce(s, shared, Sum{});
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_chunks_kernel(double* acc, const double* partial, int64_t chunks) {
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  acc[0] += total;
}

__global__ void flag_nonfinite_f32_kernel(int32_t* flag, const float* x, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) if ((__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u) flag[0] = 1;
}
__global__ void flag_nonfinite_bf16_kernel(int32_t* flag, const bf16* x, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) if ((x[i].bits & 0x7f80u) == 0x7f80u) flag[0] = 1;
}
__global__ void flag_nonfinite_f16_kernel(int32_t* flag, const f16* x, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) if ((x[i].bits & 0x7c00u) == 0x7c00u) flag[0] = 1;
}

// Integer counts: the order of the atomic adds does not change the sum.
template <class T>
__global__ void count_zeros_kernel(unsigned long long* acc, const T* x, float scale, int64_t n) {
  __shared__ unsigned long long shared[32];
  unsigned long long zeros = 0;
  MOECORE_GRID_STRIDE(i, n) zeros += ld(x[i]) * scale == 0.0f ? 1 : 0;
  zeros = block_reduce(zeros, shared, Sum{});
  if (threadIdx.x == 0 && zeros > 0) atomicAdd(acc, zeros);
}

__device__ __forceinline__ float sigmoid(float g) {
  return 1.0f / (1.0f + expf(-g));
}

// The GLU's arithmetic is kernels/common/glu.h's, with this backend's sigmoid.
struct DeviceSigmoid {
  __device__ __forceinline__ float operator()(float g) const { return sigmoid(g); }
};

template <class T>
__global__ void glu_forward_kernel(T* out, const T* gate_up, int64_t rows, int64_t F, const GluParams p) {
  MOECORE_GRID_STRIDE(i, rows * F) {
    const int64_t r = i / F, j = i % F;
    st(out[i], glu::forward(ld(gate_up[r * 2 * F + j]), ld(gate_up[r * 2 * F + F + j]), p, DeviceSigmoid{}));
  }
}

template <class T>
__global__ void glu_backward_kernel(T* dgate_up, const T* dout, const T* gate_up, int64_t rows, int64_t F,
                                    const GluParams p) {
  MOECORE_GRID_STRIDE(i, rows * F) {
    const int64_t r = i / F, j = i % F;
    const glu::Grad g =
        glu::backward(ld(gate_up[r * 2 * F + j]), ld(gate_up[r * 2 * F + F + j]), ld(dout[i]), p, DeviceSigmoid{});
    st(dgate_up[r * 2 * F + j], g.dg);
    st(dgate_up[r * 2 * F + F + j], g.du);
  }
}

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

template <class T>
__global__ void gelu_forward_kernel(T* out, const T* x, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) {
    const float v = ld(x[i]);
    st(out[i], 0.5f * v * erfcf(-v * kInvSqrt2));
  }
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x).
template <class T>
__global__ void gelu_backward_kernel(T* dx, const T* dout, const T* x, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) {
    const float v = ld(x[i]);
    const float cdf = 0.5f * erfcf(-v * kInvSqrt2);
    const float pdf = kInvSqrt2Pi * expf(-0.5f * v * v);
    st(dx[i], ld(dout[i]) * (cdf + v * pdf));
  }
}

// out [B, A, W] = in [A, B, W], elements moved as raw 2- or 4-byte words.
template <class E>
__global__ void transpose_01_kernel(E* out, const E* in, int64_t A, int64_t B, int64_t W) {
  MOECORE_GRID_STRIDE(i, A * B * W) {
    const int64_t w = i % W, ba = i / W, a = ba % A, b = ba / A;
    out[i] = in[(a * B + b) * W + w];
  }
}

// packed row (t*G + g)*count + j  <->  qkv slot `slot + j` of group g of token t (Gather: qkv -> packed).
template <bool Gather, class TP, class TQ>
__global__ void qkv_slots_kernel(TP* packed, TQ* qkv, int64_t rows, int64_t count, int64_t slots, int64_t slot,
                                 int64_t D) {
  MOECORE_GRID_STRIDE(i, rows * D) {
    const int64_t r = i / D, d = i % D, j = r % count, tg = r / count;
    const int64_t q = (tg * slots + slot + j) * D + d;
    if constexpr (Gather)
      st(packed[i], ld(qkv[q]));
    else
      st(qkv[q], ld(packed[i]));
  }
}

// Angles in double, as the CPU: at positions in the thousands an f32 angle is already off by ~1e-4 rad.
__global__ void rope_table_kernel(float* t, int64_t S, int64_t Dr, double base) {
  const int64_t half = Dr / 2;
  MOECORE_GRID_STRIDE(i, S * half) {
    const int64_t s = i / half, j = i % half;
    const double inv_freq = pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(Dr));
    const double angle = static_cast<double>(s) * inv_freq;
    t[s * Dr + j] = static_cast<float>(cos(angle));
    t[s * Dr + half + j] = static_cast<float>(sin(angle));
  }
}

// Rotates pair (j, j + Dr/2) of the R query slots and the key slot of every group, by +angle or -angle (inverse).
template <class T>
__global__ void rope_kernel(T* qkv, const float* rope, int64_t B, int64_t S, int64_t G, int64_t R, int64_t D,
                            int64_t Dr, float sign) {
  const int64_t half = Dr / 2, slots = R + 1;  // the R query slots and the key slot; not the value
  MOECORE_GRID_STRIDE(i, B * S * G * slots * half) {
    const int64_t j = i % half, slot = (i / half) % slots, g = (i / (half * slots)) % G, bs = i / (half * slots * G);
    const int64_t s = bs % S;
    T* x = qkv + (bs * G * (R + 2) + g * (R + 2) + slot) * D;
    const float c = rope[s * Dr + j], sn = sign * rope[s * Dr + half + j];
    const float x1 = ld(x[j]), x2 = ld(x[j + half]);
    st(x[j], x1 * c - x2 * sn);
    st(x[j + half], x2 * c + x1 * sn);
  }
}

using AdamWConsts = adamw::Consts;  // the CPU's (kernels/common/adamw.h), computed in double on the host

template <class TP, class TM, class TV>
__global__ void adamw_kernel(TP* param, const float* grad, TM* exp_avg, TV* exp_avg_sq, AdamWConsts k, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) {
    const float g = adamw::scaled_grad(grad[i], k);
    const float m = adamw::first_moment(ld(exp_avg[i]), g, k);
    const float v = adamw::second_moment(ld(exp_avg_sq[i]), g, k);
    st(exp_avg[i], m);
    st(exp_avg_sq[i], v);
    st(param[i], adamw::param(ld(param[i]), m, v, k));
  }
}

__global__ void lion_kernel(float* param, const float* grad, float* exp_avg, lion::Consts k, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) {
    const float g = grad[i] * k.grad_scale;
    const float d = lion::direction(exp_avg[i], g, k);
    exp_avg[i] = lion::momentum(exp_avg[i], g, k);
    param[i] = lion::param(param[i], d, k);
  }
}

__global__ void muon_momentum_kernel(float* u, float* momentum, const float* grad, muon::MomentumConsts k, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) {
    const float g = muon::scaled_grad(grad[i], k);
    const float m = muon::momentum(momentum[i], g, k);
    momentum[i] = m;
    u[i] = muon::to_orthogonalise(m, g, k);
  }
}

__global__ void muon_update_kernel(float* param, const float* o, float decay, float lr, int64_t n) {
  MOECORE_GRID_STRIDE(i, n) param[i] = muon::update(param[i], o[i], decay, lr);
}

}  // namespace

void add(Tensor& out, const Tensor& a, const Tensor& b, const Context& ctx) {
  const Launch l("add", ctx, {{"out", &out}, {"a", &a}, {"b", &b}});
  const int64_t n = out.numel();
  if (n == 0) return;
  with_float_type(out.dtype(), [&](auto to) {
    with_float_type(a.dtype(), [&](auto ta) {
      with_float_type(b.dtype(), [&](auto tb) {
        using TO = decltype(to);
        using TA = decltype(ta);
        using TB = decltype(tb);
        add_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<TO>(out), Launch::ptr<const TA>(a),
                                                             Launch::ptr<const TB>(b), n);
      });
    });
  });
  l.launched("add_kernel");
}

void scale(Tensor& x, float alpha, const Context& ctx) {
  const Launch l("scale", ctx, {{"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<float>(x), alpha, n);
  l.launched("scale_kernel");
}

void sum_squares(Tensor& acc, const Tensor& x, const Context& ctx) {
  const Launch l("sum_squares", ctx, {{"acc", &acc}, {"x", &x}});
  const int64_t n = x.numel(), chunks = (n + kSumChunk - 1) / kSumChunk;
  if (n == 0) return;  // adds 0.0: acc keeps its bits
  MOECORE_CHECK(chunks <= 0x7fffffff, "sum_squares (cuda): ", x.str(), " has too many chunks");
  WorkspaceCarver w;
  w.reserve<double>(chunks);
  w.allocate(l);
  double* partial = w.take<double>(chunks);
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    sum_squares_chunks_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, l.stream()>>>(partial,
                                                                                          Launch::ptr<const T>(x), n);
  });
  l.launched("sum_squares_chunks_kernel");
  sum_chunks_kernel<<<1, 1, 0, l.stream()>>>(Launch::ptr<double>(acc), partial, chunks);
  l.launched("sum_chunks_kernel");
}

void flag_nonfinite(Tensor& flag, const Tensor& x, const Context& ctx) {
  const Launch l("flag_nonfinite", ctx, {{"flag", &flag}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  if (x.dtype() == DType::bf16)
    flag_nonfinite_bf16_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<int32_t>(flag),
                                                                         Launch::ptr<const bf16>(x), n);
  else if (x.dtype() == DType::f16)
    flag_nonfinite_f16_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<int32_t>(flag),
                                                                        Launch::ptr<const f16>(x), n);
  else
    flag_nonfinite_f32_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<int32_t>(flag),
                                                                        Launch::ptr<const float>(x), n);
  l.launched("flag_nonfinite_kernel");
}

void count_zeros(Tensor& acc, const Tensor& x, float scale, const Context& ctx) {
  const Launch l("count_zeros", ctx, {{"acc", &acc}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t));
  auto* out = reinterpret_cast<unsigned long long*>(Launch::ptr<int64_t>(acc));
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    count_zeros_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(out, Launch::ptr<const T>(x), scale, n);
  });
  l.launched("count_zeros_kernel");
}

void glu_forward(Tensor& out, const Tensor& gate_up, const GluParams& p, const Context& ctx) {
  const Launch l("glu_forward", ctx, {{"out", &out}, {"gate_up", &gate_up}});
  const int64_t F = out.size(-1), rows = F ? out.numel() / F : 0;
  if (rows * F == 0) return;
  with_float_type(out.dtype(), [&](auto t) {
    using T = decltype(t);
    glu_forward_kernel<<<grid_for(rows * F), kThreads, 0, l.stream()>>>(Launch::ptr<T>(out),
                                                                        Launch::ptr<const T>(gate_up), rows, F, p);
  });
  l.launched("glu_forward_kernel");
}

void glu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up, const GluParams& p, const Context& ctx) {
  const Launch l("glu_backward", ctx, {{"dgate_up", &dgate_up}, {"dout", &dout}, {"gate_up", &gate_up}});
  const int64_t F = dout.size(-1), rows = F ? dout.numel() / F : 0;
  if (rows * F == 0) return;
  with_float_type(dout.dtype(), [&](auto t) {
    using T = decltype(t);
    glu_backward_kernel<<<grid_for(rows * F), kThreads, 0, l.stream()>>>(
        Launch::ptr<T>(dgate_up), Launch::ptr<const T>(dout), Launch::ptr<const T>(gate_up), rows, F, p);
  });
  l.launched("glu_backward_kernel");
}

void gelu_forward(Tensor& out, const Tensor& x, const Context& ctx) {
  const Launch l("gelu_forward", ctx, {{"out", &out}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    gelu_forward_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<T>(out), Launch::ptr<const T>(x), n);
  });
  l.launched("gelu_forward_kernel");
}

void gelu_backward(Tensor& dx, const Tensor& dout, const Tensor& x, const Context& ctx) {
  const Launch l("gelu_backward", ctx, {{"dx", &dx}, {"dout", &dout}, {"x", &x}});
  const int64_t n = x.numel();
  if (n == 0) return;
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    gelu_backward_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<T>(dx), Launch::ptr<const T>(dout),
                                                                   Launch::ptr<const T>(x), n);
  });
  l.launched("gelu_backward_kernel");
}

void transpose_01(Tensor& out, const Tensor& in, const Context& ctx) {
  const Launch l("transpose_01", ctx, {{"out", &out}, {"in", &in}});
  const int64_t A = in.size(0), B = in.size(1), W = in.size(2), n = A * B * W;
  if (n == 0) return;
  if (dtype_size(in.dtype()) == 2)
    transpose_01_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<uint16_t>(out),
                                                                  Launch::ptr<const uint16_t>(in), A, B, W);
  else
    transpose_01_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<uint32_t>(out),
                                                                  Launch::ptr<const uint32_t>(in), A, B, W);
  l.launched("transpose_01_kernel");
}

void qkv_slots_gather(Tensor& packed, const Tensor& qkv, const QkvDims& d, int64_t slot, int64_t count,
                      const Context& ctx) {
  const Launch l("qkv_slots_gather", ctx, {{"packed", &packed}, {"qkv", &qkv}});
  const int64_t rows = packed.size(0), n = rows * d.D;
  if (n == 0) return;
  with_float_type(packed.dtype(), [&](auto tp) {
    with_float_type(qkv.dtype(), [&](auto tq) {
      using TP = decltype(tp);
      using TQ = decltype(tq);
      qkv_slots_kernel<true><<<grid_for(n), kThreads, 0, l.stream()>>>(
          Launch::ptr<TP>(packed), Launch::ptr<const TQ>(qkv), rows, count, d.R + 2, slot, d.D);
    });
  });
  l.launched("qkv_slots_kernel (gather)");
}

void qkv_slots_scatter(Tensor& qkv, const Tensor& packed, const QkvDims& d, int64_t slot, int64_t count,
                       const Context& ctx) {
  const Launch l("qkv_slots_scatter", ctx, {{"qkv", &qkv}, {"packed", &packed}});
  const int64_t rows = packed.size(0), n = rows * d.D;
  if (n == 0) return;
  with_float_type(packed.dtype(), [&](auto tp) {
    with_float_type(qkv.dtype(), [&](auto tq) {
      using TP = decltype(tp);
      using TQ = decltype(tq);
      qkv_slots_kernel<false><<<grid_for(n), kThreads, 0, l.stream()>>>(
          Launch::ptr<const TP>(packed), Launch::ptr<TQ>(qkv), rows, count, d.R + 2, slot, d.D);
    });
  });
  l.launched("qkv_slots_kernel (scatter)");
}

void rope_table(Tensor& rope, float base, const Context& ctx) {
  const Launch l("rope_table", ctx, {{"rope", &rope}});
  const int64_t S = rope.size(0), Dr = rope.size(1);
  if (S == 0) return;
  rope_table_kernel<<<grid_for(S * Dr / 2), kThreads, 0, l.stream()>>>(Launch::ptr<float>(rope), S, Dr,
                                                                       static_cast<double>(base));
  l.launched("rope_table_kernel");
}

namespace {
void rope_apply(const char* op, const char* name, Tensor& qkv, const Tensor& rope, const QkvDims& d, const Context& ctx,
                bool inverse) {
  const Launch l(op, ctx, {{name, &qkv}, {"rope", &rope}});
  const int64_t Dr = rope.size(1), n = d.B * d.S * d.G * (d.R + 1) * (Dr / 2);
  if (n == 0) return;
  with_float_type(qkv.dtype(), [&](auto t) {
    using T = decltype(t);
    rope_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<T>(qkv), Launch::ptr<const float>(rope), d.B, d.S,
                                                          d.G, d.R, d.D, Dr, inverse ? -1.0f : 1.0f);
  });
  l.launched("rope_kernel");
}
}  // namespace

void rope_forward(Tensor& qkv, const Tensor& rope, const QkvDims& dims, const Context& ctx) {
  rope_apply("rope_forward", "qkv", qkv, rope, dims, ctx, false);
}

void rope_backward(Tensor& dqkv, const Tensor& rope, const QkvDims& dims, const Context& ctx) {
  rope_apply("rope_backward", "dqkv", dqkv, rope, dims, ctx, true);
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWParams& p,
                const Context& ctx) {
  const Launch l("adamw_step", ctx,
                 {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  const int64_t n = param.numel();
  if (n == 0) return;
  const AdamWConsts k(p);
  with_float_type(param.dtype(), [&](auto tp) {
    with_float_type(exp_avg.dtype(), [&](auto tm) {
      with_float_type(exp_avg_sq.dtype(), [&](auto tv) {
        using TP = decltype(tp);
        using TM = decltype(tm);
        using TV = decltype(tv);
        adamw_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<TP>(param), Launch::ptr<const float>(grad),
                                                               Launch::ptr<TM>(exp_avg), Launch::ptr<TV>(exp_avg_sq), k,
                                                               n);
      });
    });
  });
  l.launched("adamw_kernel");
}

void lion_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, const LionParams& p, const Context& ctx) {
  const Launch l("lion_step", ctx, {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}});
  const int64_t n = param.numel();
  if (n == 0) return;
  lion_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<float>(param), Launch::ptr<const float>(grad),
                                                        Launch::ptr<float>(exp_avg), lion::Consts(p), n);
  l.launched("lion_kernel");
}

void muon_momentum(Tensor& u, Tensor& momentum, const Tensor& grad, const MuonMomentumParams& p, const Context& ctx) {
  const Launch l("muon_momentum", ctx, {{"u", &u}, {"momentum", &momentum}, {"grad", &grad}});
  const int64_t n = grad.numel();
  if (n == 0) return;
  const muon::MomentumConsts k{p.beta, 1.0f - p.beta, p.grad_scale, p.nesterov};
  muon_momentum_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<float>(u), Launch::ptr<float>(momentum),
                                                                 Launch::ptr<const float>(grad), k, n);
  l.launched("muon_momentum_kernel");
}

void muon_update(Tensor& param, const Tensor& o, float lr, float weight_decay, const Context& ctx) {
  const Launch l("muon_update", ctx, {{"param", &param}, {"o", &o}});
  const int64_t n = param.numel();
  if (n == 0) return;
  const float decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);  // as the CPU computes it
  muon_update_kernel<<<grid_for(n), kThreads, 0, l.stream()>>>(Launch::ptr<float>(param), Launch::ptr<const float>(o),
                                                               decay, lr, n);
  l.launched("muon_update_kernel");
}

}  // namespace moecore::ops::cuda
