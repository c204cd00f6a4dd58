#include "moecore/optim/adamw.h"

#include <cmath>

#include "moecore/kernels/ops.h"

namespace moecore::optim {

void AdamWConfig::validate() const {
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    MOECORE_FAIL("optimizer: adam_beta1 (", beta1, ") and adam_beta2 (", beta2, ") must lie in [0, 1)");
  if (!(eps > 0)) MOECORE_FAIL("optimizer: adam_eps (", eps, ") must be positive");
  if (weight_decay < 0 || clip_grad < 0)
    MOECORE_FAIL("optimizer: weight_decay (", weight_decay, ") and clip_grad (", clip_grad, ") must not be negative");
  if (state_dtype != DType::f32 && state_dtype != DType::bf16)
    MOECORE_FAIL("optimizer: state dtype ", dtype_name(state_dtype), " is not supported (use f32 or bf16)");
}

AdamW::AdamW(std::vector<Param>& params, const AdamWConfig& cfg, bool allocate_state) : params_(params), cfg_(cfg) {
  cfg_.validate();
  if (!allocate_state) return;
  for (const auto& p : params_) {
    m_.push_back(Tensor::zeros(p.value.shape(), cfg_.state_dtype, MemCategory::optimizer_state, p.value.device()));
    v_.push_back(Tensor::zeros(p.value.shape(), cfg_.state_dtype, MemCategory::optimizer_state, p.value.device()));
  }
}

double global_grad_norm(const std::vector<Param>& params, Tensor& acc) {
  acc.zero_();
  for (const auto& p : params) ops::sum_squares(acc, p.grad, ops::Context{p.grad.device()});
  double s = 0;
  acc.copy_to_host(&s, 1);
  return std::sqrt(s);
}

float clip_scale_for(double grad_norm, float clip_grad) {
  if (!(clip_grad > 0)) return 1.0f;
  const double scale = clip_grad / (grad_norm + 1e-6);
  return scale < 1.0 ? static_cast<float>(scale) : 1.0f;
}

StepStats AdamW::step(float lr) {
  // A [1] accumulator per call: this convenience form serves tests and benches; the trainer computes the norm over
  // its groups with buffers allocated once and calls step(lr, grad_norm).
  Tensor acc = Tensor::zeros({1}, DType::f64, MemCategory::workspace,
                             params_.empty() ? Device::cpu : params_.front().grad.device());
  return step(lr, global_grad_norm(params_, acc));
}

StepStats AdamW::step(float lr, double grad_norm) {
  if (m_.size() != params_.size())
    MOECORE_FAIL("optimizer: this AdamW holds no state (built for the distributed optimizer, which steps instead)");
  StepStats st;
  st.grad_norm = grad_norm;
  st.clip_scale = clip_scale_for(grad_norm, cfg_.clip_grad);
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    ops::AdamWParams p;
    p.lr = lr;
    p.beta1 = cfg_.beta1;
    p.beta2 = cfg_.beta2;
    p.eps = cfg_.eps;
    p.weight_decay = params_[i].weight_decay ? cfg_.weight_decay : 0.0f;
    p.step = step_;
    p.grad_scale = st.clip_scale;
    ops::adamw_step(params_[i].value, params_[i].grad, m_[i], v_[i], p, ops::Context{params_[i].value.device()});
  }
  return st;
}

}  // namespace moecore::optim
