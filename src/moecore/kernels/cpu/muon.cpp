// Muon's ops (ops.h): the momentum and the update, elementwise on the arithmetic of kernels/common/muon.h (the CUDA
// kernels in cuda/elementwise.cu run the same), and the Newton-Schulz orthogonalisation, composed of ops (batched
// GEMMs, squared norms, scaling, casts) so that it runs on whichever device x is. Not here: which matrices Muon sees,
// their scales, tensor parallelism (optim/muon.h).
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "moecore/kernels/common/muon.h"
#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {

void muon_momentum(Tensor& u, Tensor& momentum, const Tensor& grad, const MuonMomentumParams& p, const Context& ctx) {
  const cpu::Checker c("muon_momentum", ctx, {{"u", &u}, {"momentum", &momentum}, {"grad", &grad}},
                       cpu::Backends::cpu_and_cuda);
  for (const char* name : {"u", "momentum", "grad"}) {
    c.dtype(name, DType::f32);
    c.same_shape(name, "grad");
    c.contiguous(name);
  }
  if (u.same_data(momentum) || u.same_data(grad)) c.fail("u must not alias momentum or grad");
  if (!(p.beta >= 0.0f && p.beta < 1.0f)) c.fail("beta must lie in [0, 1), got ", p.beta);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::muon_momentum(u, momentum, grad, p, ctx);
  const muon::MomentumConsts k{p.beta, 1.0f - p.beta, p.grad_scale, p.nesterov};
  float* uo = u.data<float>();
  float* m = momentum.data<float>();
  const float* g = grad.data<float>();
  const int64_t n = grad.numel();
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const float gs = muon::scaled_grad(g[i], k);
    m[i] = muon::momentum(m[i], gs, k);
    uo[i] = muon::to_orthogonalise(m[i], gs, k);
  }
}

void muon_update(Tensor& param, const Tensor& o, float lr, float weight_decay, const Context& ctx) {
  const cpu::Checker c("muon_update", ctx, {{"param", &param}, {"o", &o}}, cpu::Backends::cpu_and_cuda);
  for (const char* name : {"param", "o"}) {
    c.dtype(name, DType::f32);
    c.same_shape(name, "param");
    c.contiguous(name);
  }
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::muon_update(param, o, lr, weight_decay, ctx);
  const float decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  float* w = param.data<float>();
  const float* x = o.data<float>();
  const int64_t n = param.numel();
#pragma omp parallel for simd schedule(static) if (n > cpu::kParallelWork)
  for (int64_t i = 0; i < n; ++i) w[i] = muon::update(w[i], x[i], decay, lr);
}

void newton_schulz(Tensor& x, const NewtonSchulz& p, const std::function<void(Tensor&)>& sum_over_shards,
                   const Context& ctx) {
  {
    const cpu::Checker c("newton_schulz", ctx, {{"x", &x}}, cpu::Backends::cpu_and_cuda);
    c.dtype("x", DType::f32);
    c.contiguous("x");
    if (x.dim() != 2 && x.dim() != 3) c.fail("x must be 2-D or 3-D (a batch of matrices), got ", x.shape().str());
    if (p.steps < 1) c.fail("steps must be >= 1, got ", p.steps);
    if (p.transpose < -1 || p.transpose > 1) c.fail("transpose must be -1 (by shape), 0 or 1, got ", p.transpose);
    if (!(p.eps > 0.0f)) c.fail("eps must be positive, got ", p.eps);
  }
  if (x.numel() == 0) return;
  Tensor x3 = x.dim() == 3 ? x : x.view({1, x.size(0), x.size(1)});
  const int64_t G = x3.size(0), M = x3.size(1), N = x3.size(2);
  // Transposed, the iterate is x^T: its Gram is x^T x and B X is (X^T B^T)^T, so x is never moved.
  const bool tr = p.transpose < 0 ? M > N : p.transpose == 1;
  const int64_t r = tr ? N : M;
  const Device dev = x.device();

  Tensor sq = Tensor::zeros({G}, DType::f64, MemCategory::workspace, dev);
  for (int64_t g = 0; g < G; ++g) {
    Tensor slot = sq.slice(0, g, g + 1);
    sum_squares(slot, x3.select(0, g), ctx);
  }
  if (sum_over_shards) sum_over_shards(sq);
  std::vector<double> norms(static_cast<size_t>(G));
  sq.copy_to_host(norms.data(), G);
  for (int64_t g = 0; g < G; ++g) {
    Tensor xg = x3.select(0, g);
    scale(xg, static_cast<float>(1.0 / std::max(std::sqrt(norms[static_cast<size_t>(g)]), double{p.eps})), ctx);
  }

  const DType t = p.bf16 ? DType::bf16 : DType::f32;
  Tensor X = Tensor::empty({G, M, N}, t, MemCategory::workspace, dev);
  Tensor Xn = Tensor::empty({G, M, N}, t, MemCategory::workspace, dev);
  Tensor A = Tensor::empty({G, r, r}, t, MemCategory::workspace, dev);
  Tensor B = Tensor::empty({G, r, r}, t, MemCategory::workspace, dev);
  X.copy_from(x3);
  for (int k = 0; k < p.steps; ++k) {
    const muon::NsStep s = muon::ns_step(p.coefficients, k);
    gemm_batched(A, X, tr, X, !tr, 1.0f, 0.0f, ctx);  // X X^T
    if (sum_over_shards) sum_over_shards(A);
    B.copy_from(A);
    gemm_batched(B, A, false, A, false, s.c, s.b, ctx);  // b A + c A A
    Xn.copy_from(X);
    if (tr)
      gemm_batched(Xn, X, false, B, true, 1.0f, s.a, ctx);  // (a X + B X)^T = a x + x B^T
    else
      gemm_batched(Xn, B, false, X, false, 1.0f, s.a, ctx);  // a X + B X
    std::swap(X, Xn);
  }
  x3.copy_from(X);
}

}  // namespace moecore::ops
