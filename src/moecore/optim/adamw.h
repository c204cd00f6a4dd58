// AdamW with fp32 master weights, global-norm gradient clipping and optional bf16 optimizer states.
// Decoupled weight decay applies only to parameters marked weight_decay (2-D weights). Not here: LR
// schedules (lr_at, train/trainer.h) and sharding over data-parallel ranks (optim/distributed_adamw.h).
#pragma once
#include <vector>

#include "moecore/core/param.h"

namespace moecore::optim {

struct AdamWConfig {
  float beta1 = 0.9f;              // --adam-beta1
  float beta2 = 0.999f;            // --adam-beta2
  float eps = 1e-8f;               // --adam-eps
  float weight_decay = 0.01f;      // --weight-decay, decoupled, 2-D weights only
  float clip_grad = 1.0f;          // --clip-grad: max global L2 norm; 0 disables clipping
  DType state_dtype = DType::f32;  // exp_avg / exp_avg_sq dtype: f32, or bf16 to halve optimizer memory
  void validate() const;
};

struct StepStats {
  double grad_norm = 0;  // global L2 norm of all gradients before clipping
  float clip_scale = 1;  // factor applied to the gradients (1 when not clipped)
};

class AdamW {
 public:
  // allocate_state=false: no moments (the distributed optimizer holds them; step() then throws).
  AdamW(std::vector<Param>& params, const AdamWConfig& cfg, bool allocate_state = true);
  const AdamWConfig& config() const { return cfg_; }
  bool has_state() const { return m_.size() == params_.size(); }
  // One update with learning rate lr, clipping by the global norm of these parameters' gradients.
  // Gradients are read, not modified.
  StepStats step(float lr);
  // The same with an externally computed global norm (gradients reduced over several groups, e.g. dense
  // and expert parameters): the clip scale is clip_scale_for(grad_norm, clip_grad). step(lr) calls this.
  StepStats step(float lr, double grad_norm);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  // The two moments' bytes per parameter (before an optimizer exists: the memory plan's).
  static int64_t state_bytes_per_param(const AdamWConfig& c) {
    return 2 * static_cast<int64_t>(dtype_size(c.state_dtype));
  }
  int64_t state_bytes_per_param() const { return state_bytes_per_param(cfg_); }

 private:
  std::vector<Param>& params_;
  AdamWConfig cfg_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

// sqrt(sum over params of sum(grad^2)), accumulated in double in parameter order on the device, in acc ([1] f64
// on the gradients' device, zeroed here), and read back once.
double global_grad_norm(const std::vector<Param>& params, Tensor& acc);
// Megatron/torch clip rule: clip_grad / (grad_norm + 1e-6) when that is below 1, else 1. clip_grad 0
// disables clipping (scale 1); a NaN norm gives 1, an infinite one 0.
float clip_scale_for(double grad_norm, float clip_grad);

}  // namespace moecore::optim
