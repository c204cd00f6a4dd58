// Lion (Chen et al. 2023), as emerging_optimizers' Lion that Megatron builds for --muon-scalar-optimizer lion: one f32
// momentum per parameter; a step takes the gradients times the clip scale g, decays the weight-decayed parameters
// (p *= 1 - lr * wd, decoupled), steps p -= lr * sign(beta1 m + (1 - beta1) g) and moves m += (1 - beta2) (g - m)
// (ops::lion_step). Learning rate, weight decay and clipping are the run's (AdamWConfig's weight_decay and clip_grad).
#pragma once
#include <vector>

#include "moecore/core/param.h"
#include "moecore/optim/adamw.h"

namespace moecore::optim {

struct LionConfig {
  float beta1 = 0.95f;  // --lion-beta1
  float beta2 = 0.98f;  // --lion-beta2
  void validate() const;
};

class Lion {
 public:
  Lion(std::vector<Param>& params, const LionConfig& cfg, const AdamWConfig& run);
  // One update with learning rate lr and the global gradient norm (the clip scale: clip_scale_for(norm, clip_grad)).
  StepStats step(float lr, double grad_norm);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  std::vector<Tensor>& exp_avg() { return m_; }
  const std::vector<Tensor>& exp_avg() const { return m_; }
  static int64_t state_bytes_per_param() { return 4; }  // (the f32 momentum)

 private:
  std::vector<Param>& params_;
  LionConfig cfg_;
  AdamWConfig run_;
  std::vector<Tensor> m_;
  int64_t step_ = 0;
};

}  // namespace moecore::optim
