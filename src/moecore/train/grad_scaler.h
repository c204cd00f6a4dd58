// Megatron's loss scaling (core/optimizer/grad_scaler.py), for fp16 training: the step takes the loss gradient times
// the scale, so that gradients too small for fp16 survive the backward pass in it; the reduced gradients are
// multiplied by the inverse before the update, and a step whose gradients overflowed (an Inf or NaN anywhere) is
// skipped -- no update, and the LR schedule does not advance (Megatron's update_successful). The constant scaler
// (--loss-scale) keeps its scale; the dynamic one (--fp16 without --loss-scale) multiplies it by 0.5 (not below the
// minimum) once `hysteresis` overflowing steps have been seen since the last growth, and by 2 after `window` steps in
// a row without one. The step's caller decides what overflowed (every rank alike); this is the arithmetic and the
// state.
#pragma once
#include <cstdint>

namespace moecore::train {

struct GradScalerConfig {
  enum class Kind : uint8_t { none, constant, dynamic };
  Kind kind = Kind::none;
  float scale = 1;         // constant: --loss-scale; dynamic: --initial-loss-scale (Megatron's 2^32)
  float min_scale = 1;     // --min-loss-scale
  int64_t window = 1000;   // --loss-scale-window: steps without an overflow before the scale doubles
  int64_t hysteresis = 2;  // --hysteresis: overflowing steps before the scale halves
  void validate() const;   // Megatron's assertions, as Errors naming the flags
};

// The dynamic scaler's state, Megatron's state_dict keys (state.json "grad_scaler").
struct GradScalerState {
  float scale = 1;
  int64_t growth_tracker = 0;
  int64_t hysteresis_tracker = 0;
};

class GradScaler {
 public:
  explicit GradScaler(const GradScalerConfig& cfg);
  bool active() const { return cfg_.kind != GradScalerConfig::Kind::none; }
  bool dynamic() const { return cfg_.kind == GradScalerConfig::Kind::dynamic; }
  float scale() const { return s_.scale; }  // 1 when inactive
  float min_scale() const { return cfg_.min_scale; }
  // After a step: found_inf when its gradients overflowed on any rank.
  void update(bool found_inf);
  GradScalerState state() const { return s_; }
  // A saved dynamic state, as Megatron loads it (Error naming `where` when the scale is not positive and finite or
  // the growth tracker is negative; the hysteresis tracker counts down below 0 in a run of overflows).
  void load(const GradScalerState& s, const char* where);

 private:
  GradScalerConfig cfg_;
  GradScalerState s_;
};

}  // namespace moecore::train
