// Shared expert (spec §8): a dense SwiGLU/GeLU MLP over every token, optionally scaled per token by
// s = sigmoid(x . g). GEMMs go through ops; the gate's per-token dot products and scalings are local CPU
// loops (ops.h has no row-scaling op), fused so that each touches [T, H] once.
// Gradient contract: weight and gate gradients accumulate (+=); dx accumulates too (the input fans out to the
// router, the routed experts and this MLP). Not here: routed experts (experts.cpp).
#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/moe/experts.h"

namespace moecore::moe {
namespace {

constexpr int64_t kParallelWork = 1 << 15;

inline float sigmoid(float z) {
  return 1.0f / (1.0f + std::exp(-z));
}

// s[t] = sigmoid(x[t] . g); y[t] += s[t] * out[t].
template <class T>
void gate_forward_kernel(float* y, float* s, const T* x, const float* g, const float* out, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static) if (N * H > kParallelWork)
  for (int64_t t = 0; t < N; ++t) {
    const T* xt = x + t * H;
    float z = 0.0f;
#pragma omp simd reduction(+ : z)
    for (int64_t j = 0; j < H; ++j) z += to_float(xt[j]) * g[j];
    const float st_ = sigmoid(z);
    s[t] = st_;
    float* yt = y + t * H;
    const float* ot = out + t * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) yt[j] += st_ * ot[j];
  }
}

// Per token: dout_c[t] = dy[t] * s; dz[t] = (dy[t] . out[t]) * s (1 - s); dx[t] += dz[t] * g.
template <class T>
void gate_backward_rows(T* dout_c, float* dz, float* dx, const float* dy, const float* out, const float* s,
                        const float* g, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static) if (N * H > kParallelWork)
  for (int64_t t = 0; t < N; ++t) {
    const float* dyt = dy + t * H;
    const float* ot = out + t * H;
    const float st_ = s[t];
    float ds = 0.0f;
#pragma omp simd reduction(+ : ds)
    for (int64_t j = 0; j < H; ++j) ds += dyt[j] * ot[j];
    const float dzt = ds * st_ * (1.0f - st_);
    dz[t] = dzt;
    T* dct = dout_c + t * H;
    float* dxt = dx + t * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      from_float(dct[j], dyt[j] * st_);
      dxt[j] += dzt * g[j];
    }
  }
}

// dg[j] += sum_t dz[t] * x[t, j], in token order per column block (deterministic for any thread count).
template <class T>
void gate_weight_grad(float* dg, const float* dz, const T* x, int64_t N, int64_t H) {
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (N * H > kParallelWork)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * kBlock, j1 = std::min(H, j0 + kBlock);
    float acc[kBlock] = {};
    for (int64_t t = 0; t < N; ++t) {
      const T* xt = x + t * H;
      const float d = dz[t];
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += d * to_float(xt[j]);
    }
    for (int64_t j = j0; j < j1; ++j) dg[j] += acc[j - j0];
  }
}

// Per-token gate gradient scratch of the calling thread (grow-only, so no allocation after the first step).
float* dz_scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

void act_forward(Tensor& act, const Tensor& h, bool swiglu, const ops::Context& ctx) {
  if (swiglu)
    ops::swiglu_forward(act, h, ctx);
  else
    ops::gelu_forward(act, h, ctx);
}

void act_backward(Tensor& dh, const Tensor& dact, const Tensor& h, bool swiglu, const ops::Context& ctx) {
  if (swiglu)
    ops::swiglu_backward(dh, dact, h, ctx);
  else
    ops::gelu_backward(dh, dact, h, ctx);
}

void check_shared(const char* op, const Tensor& x, const SharedExpertWeights& w, const SharedExpertCache& c,
                  bool swiglu) {
  const bool gate = w.gate.defined();
  const bool ok_x = x.defined() && x.dim() == 2 && x.is_contiguous() && x.device() == Device::cpu;
  const int64_t T = ok_x ? x.size(0) : -1, H = ok_x ? x.size(1) : -1;
  const int64_t Fs = w.fc2.defined() && w.fc2.dim() == 2 ? w.fc2.size(1) : -1, F1 = swiglu ? 2 * Fs : Fs;
  const DType dt = x.defined() ? x.dtype() : DType::f32;
  bool ok = ok_x && w.fc1.defined() && w.fc1.shape() == Shape{F1, H} && w.fc1.dtype() == dt &&
            w.fc2.shape() == Shape{H, Fs} && w.fc2.dtype() == dt && c.h.defined() && c.h.shape() == Shape{T, F1} &&
            c.act.defined() && c.act.shape() == Shape{T, Fs};
  if (gate)
    ok = ok && w.gate.shape() == Shape{1, H} && w.gate.dtype() == DType::f32 && c.out.defined() &&
         c.out.shape() == Shape{T, H} && c.gate_s.defined() && c.gate_s.shape() == Shape{T};
  if (!ok)
    MOECORE_FAIL(op, ": inconsistent shared-expert tensors (swiglu ", swiglu, ", gate ", gate, "): x ", x.str(),
                 ", fc1 ", w.fc1.str(), ", fc2 ", w.fc2.str(), ", gate ", gate ? w.gate.str() : "none", ", cache h ",
                 c.h.str(), ", act ", c.act.str(), "; allocate the cache with shared_expert_cache_alloc");
}

}  // namespace

SharedExpertCache shared_expert_cache_alloc(int64_t T, int64_t H, int64_t Fs, bool swiglu, bool gate, DType compute) {
  const int64_t F1 = swiglu ? 2 * Fs : Fs;
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  SharedExpertCache c;
  c.h = Tensor::empty({T, F1}, compute, act);
  c.act = Tensor::empty({T, Fs}, compute, act);
  if (gate) {
    c.out = Tensor::empty({T, H}, DType::f32, act);
    c.gate_s = Tensor::empty({T}, DType::f32, act);
  }
  c.dact = Tensor::empty({T, Fs}, compute, work);
  c.dh = Tensor::empty({T, F1}, compute, work);
  if (gate || compute != DType::f32) c.dout_c = Tensor::empty({T, H}, compute, work);
  return c;
}

void shared_expert_forward(Tensor& y, const Tensor& x, const SharedExpertWeights& w, SharedExpertCache& cache,
                           bool swiglu, const ops::Context& ctx) {
  check_shared("shared_expert_forward", x, w, cache, swiglu);
  if (!(y.shape() == x.shape()) || y.dtype() != DType::f32 || !y.is_contiguous())
    MOECORE_FAIL("shared_expert_forward: y must be a contiguous ", x.shape().str(), " f32 tensor, got ", y.str());
  ops::gemm(cache.h, x, false, w.fc1, true, 1.0f, 0.0f, ctx);
  act_forward(cache.act, cache.h, swiglu, ctx);
  if (!w.gate.defined()) {
    ops::gemm(y, cache.act, false, w.fc2, true, 1.0f, 1.0f, ctx);
    return;
  }
  ops::gemm(cache.out, cache.act, false, w.fc2, true, 1.0f, 0.0f, ctx);
  const int64_t T = x.size(0), H = x.size(1);
  if (x.dtype() == DType::bf16)
    gate_forward_kernel(y.data<float>(), cache.gate_s.data<float>(), x.data<bf16>(), w.gate.data<float>(),
                        cache.out.data<float>(), T, H);
  else
    gate_forward_kernel(y.data<float>(), cache.gate_s.data<float>(), x.data<float>(), w.gate.data<float>(),
                        cache.out.data<float>(), T, H);
}

void shared_expert_backward(Tensor& dx, SharedExpertGrads& g, const Tensor& dy, const Tensor& x,
                            const SharedExpertWeights& w, SharedExpertCache& cache, bool swiglu,
                            const ops::Context& ctx) {
  check_shared("shared_expert_backward", x, w, cache, swiglu);
  const int64_t T = x.size(0), H = x.size(1);
  if (!(dy.shape() == x.shape()) || dy.dtype() != DType::f32 || !dy.is_contiguous() || !(dx.shape() == x.shape()) ||
      dx.dtype() != DType::f32 || !dx.is_contiguous())
    MOECORE_FAIL("shared_expert_backward: dy and dx must be contiguous ", x.shape().str(), " f32, got dy ", dy.str(),
                 ", dx ", dx.str());
  const Tensor* dout = &dy;
  if (w.gate.defined()) {
    if (!g.gate.defined() || !(g.gate.shape() == Shape{1, H}) || g.gate.dtype() != DType::f32)
      MOECORE_FAIL("shared_expert_backward: the gate gradient must be [1, ", H, "] f32, got ",
                   g.gate.defined() ? g.gate.str() : "undefined");
    float* dz = dz_scratch(T);
    if (x.dtype() == DType::bf16) {
      gate_backward_rows(cache.dout_c.data<bf16>(), dz, dx.data<float>(), dy.data<float>(), cache.out.data<float>(),
                         cache.gate_s.data<float>(), w.gate.data<float>(), T, H);
      gate_weight_grad(g.gate.data<float>(), dz, x.data<bf16>(), T, H);
    } else {
      gate_backward_rows(cache.dout_c.data<float>(), dz, dx.data<float>(), dy.data<float>(), cache.out.data<float>(),
                         cache.gate_s.data<float>(), w.gate.data<float>(), T, H);
      gate_weight_grad(g.gate.data<float>(), dz, x.data<float>(), T, H);
    }
    dout = &cache.dout_c;
  } else if (x.dtype() != DType::f32) {
    cache.dout_c.copy_from(dy);
    dout = &cache.dout_c;
  }
  ops::gemm(cache.dact, *dout, false, w.fc2, false, 1.0f, 0.0f, ctx);
  ops::gemm(g.fc2, *dout, true, cache.act, false, 1.0f, 1.0f, ctx);
  act_backward(cache.dh, cache.dact, cache.h, swiglu, ctx);
  ops::gemm(g.fc1, cache.dh, true, x, false, 1.0f, 1.0f, ctx);
  ops::gemm(dx, cache.dh, false, w.fc1, false, 1.0f, 1.0f, ctx);
}

}  // namespace moecore::moe
