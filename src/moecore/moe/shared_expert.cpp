// Shared expert (docs/megatron-moe-spec.md §8): a dense SwiGLU/GeLU MLP over every token, optionally scaled per token
// by s = sigmoid(x . g). GEMMs go through ops, the gate through ops::moe_shared_gate_forward/_backward (fused so
// that each touches [T, H] once).
// Gradient contract: weight and gate gradients accumulate (+=); dx accumulates too (the input fans out to the
// router, the routed experts and this MLP). Not here: routed experts (experts.cpp).
#include "moecore/moe/experts.h"

namespace moecore::moe {
namespace {

void check_shared(const char* op, const Tensor& x, const SharedExpertWeights& w, const SharedExpertCache& c, bool glu) {
  const bool gate = w.gate.defined();
  const bool ok_x = x.defined() && x.dim() == 2 && x.is_contiguous();
  const int64_t T = ok_x ? x.size(0) : -1, H = ok_x ? x.size(1) : -1;
  const int64_t Fs = w.fc2.defined() && w.fc2.dim() == 2 ? w.fc2.size(1) : -1, F1 = glu ? 2 * Fs : Fs;
  const DType dt = x.defined() ? x.dtype() : DType::f32;
  bool ok = ok_x && w.fc1.defined() && w.fc1.shape() == Shape{F1, H} && w.fc1.dtype() == dt &&
            w.fc2.shape() == Shape{H, Fs} && w.fc2.dtype() == dt && c.h.defined() && c.h.shape() == Shape{T, F1} &&
            c.act.defined() && c.act.shape() == Shape{T, Fs};
  if (gate)
    ok = ok && w.gate.shape() == Shape{1, H} && w.gate.dtype() == DType::f32 && c.out.defined() &&
         c.out.shape() == Shape{T, H} && c.gate_s.defined() && c.gate_s.shape() == Shape{T};
  if (!ok)
    MOECORE_FAIL(op, ": inconsistent shared-expert tensors (glu ", glu, ", gate ", gate, "): x ", x.str(), ", fc1 ",
                 w.fc1.str(), ", fc2 ", w.fc2.str(), ", gate ", gate ? w.gate.str() : "none", ", cache h ", c.h.str(),
                 ", act ", c.act.str(), "; allocate the cache with shared_expert_cache_alloc");
}

}  // namespace

SharedExpertCache shared_expert_cache_alloc(int64_t T, int64_t H, int64_t Fs, bool glu, bool gate, DType compute,
                                            Device device) {
  const int64_t F1 = glu ? 2 * Fs : Fs;
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  SharedExpertCache c;
  c.h = Tensor::empty({T, F1}, compute, act, device);
  c.act = Tensor::empty({T, Fs}, compute, act, device);
  if (gate) {
    c.out = Tensor::empty({T, H}, DType::f32, act, device);
    c.gate_s = Tensor::empty({T}, DType::f32, act, device);
  }
  c.dact = Tensor::empty({T, Fs}, compute, work, device);
  c.dh = Tensor::empty({T, F1}, compute, work, device);
  if (gate || compute != DType::f32) c.dout_c = Tensor::empty({T, H}, compute, work, device);
  return c;
}

void shared_expert_forward(Tensor& y, const Tensor& x, const SharedExpertWeights& w, SharedExpertCache& cache,
                           const SharedExpertDims& d, const ops::Context& ctx) {
  check_shared("shared_expert_forward", x, w, cache, d.act.glu);
  if (!(y.shape() == x.shape()) || y.dtype() != DType::f32 || !y.is_contiguous())
    MOECORE_FAIL("shared_expert_forward: y must be a contiguous ", x.shape().str(), " f32 tensor, got ", y.str());
  shared_expert_refill(x, w, cache, d, ctx);
  const nn::Linear fc2 = d.linear("mlp.shared_experts.linear_fc2");
  if (!w.gate.defined()) {
    nn::linear_fprop(y, cache.act, w.fc2, 1.0f, 1.0f, fc2, ctx);
    return;
  }
  nn::linear_fprop(cache.out, cache.act, w.fc2, 1.0f, 0.0f, fc2, ctx);
  Tensor gate = w.gate.view({x.size(1)});
  ops::moe_shared_gate_forward(y, cache.gate_s, x, gate, cache.out, ctx);
}

void shared_expert_refill(const Tensor& x, const SharedExpertWeights& w, SharedExpertCache& cache,
                          const SharedExpertDims& d, const ops::Context& ctx) {
  nn::linear_fprop(cache.h, x, w.fc1, 1.0f, 0.0f, d.linear("mlp.shared_experts.linear_fc1"), ctx);
  ops::mlp_activation_forward(cache.act, cache.h, d.act, ctx);
}

void shared_expert_backward(Tensor& dx, SharedExpertGrads& g, const Tensor& dy, const Tensor& x,
                            const SharedExpertWeights& w, SharedExpertCache& cache, const SharedExpertDims& d,
                            const ops::Context& ctx) {
  check_shared("shared_expert_backward", x, w, cache, d.act.glu);
  const int64_t H = x.size(1);
  if (!(dy.shape() == x.shape()) || dy.dtype() != DType::f32 || !dy.is_contiguous() || !(dx.shape() == x.shape()) ||
      dx.dtype() != DType::f32 || !dx.is_contiguous())
    MOECORE_FAIL("shared_expert_backward: dy and dx must be contiguous ", x.shape().str(), " f32, got dy ", dy.str(),
                 ", dx ", dx.str());
  const Tensor* dout = &dy;
  if (w.gate.defined()) {
    if (!g.gate.defined() || !(g.gate.shape() == Shape{1, H}) || g.gate.dtype() != DType::f32)
      MOECORE_FAIL("shared_expert_backward: the gate gradient must be [1, ", H, "] f32, got ",
                   g.gate.defined() ? g.gate.str() : "undefined");
    Tensor gate = w.gate.view({H}), dgate = g.gate.view({H});
    ops::moe_shared_gate_backward(cache.dout_c, dx, dgate, dy, x, gate, cache.out, cache.gate_s, ctx);
    dout = &cache.dout_c;
  } else if (x.dtype() != DType::f32) {
    cache.dout_c.copy_from(dy);
    dout = &cache.dout_c;
  }
  const nn::Linear fc1 = d.linear("mlp.shared_experts.linear_fc1"), fc2 = d.linear("mlp.shared_experts.linear_fc2");
  nn::linear_dgrad(cache.dact, *dout, w.fc2, 1.0f, 0.0f, fc2, ctx);
  nn::linear_wgrad(g.fc2, *dout, cache.act, 1.0f, 1.0f, fc2, ctx);
  ops::mlp_activation_backward(cache.dh, cache.dact, cache.h, d.act, ctx);
  nn::linear_wgrad(g.fc1, cache.dh, x, 1.0f, 1.0f, fc1, ctx);
  nn::linear_dgrad(dx, cache.dh, w.fc1, 1.0f, 1.0f, fc1, ctx);
}

}  // namespace moecore::moe
