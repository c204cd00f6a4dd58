#include "moecore/optim/lion.h"

#include "moecore/kernels/ops.h"

namespace moecore::optim {

void LionConfig::validate() const {
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    MOECORE_FAIL("optimizer: --lion-beta1 (", beta1, ") and --lion-beta2 (", beta2, ") must lie in [0, 1)");
}

Lion::Lion(std::vector<Param>& params, const LionConfig& cfg, const AdamWConfig& run)
    : params_(params), cfg_(cfg), run_(run) {
  cfg_.validate();
  run_.validate();
  for (const Param& p : params_)
    m_.push_back(Tensor::zeros(p.value.shape(), DType::f32, MemCategory::optimizer_state, p.value.device()));
}

StepStats Lion::step(float lr, double grad_norm) {
  StepStats st;
  st.grad_norm = grad_norm;
  st.clip_scale = clip_scale_for(grad_norm, run_.clip_grad);
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    ops::LionParams p;
    p.lr = lr;
    p.beta1 = cfg_.beta1;
    p.beta2 = cfg_.beta2;
    p.weight_decay = params_[i].weight_decay ? run_.weight_decay : 0.0f;
    p.grad_scale = st.clip_scale;
    ops::lion_step(params_[i].value, params_[i].grad, m_[i], p, ops::Context{params_[i].value.device()});
  }
  return st;
}

}  // namespace moecore::optim
