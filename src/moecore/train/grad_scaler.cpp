#include "moecore/train/grad_scaler.h"

#include <algorithm>
#include <cmath>

#include "moecore/core/error.h"

namespace moecore::train {

void GradScalerConfig::validate() const {
  if (kind == Kind::none) return;
  const char* flag = kind == Kind::constant ? "--loss-scale" : "--initial-loss-scale";
  if (!(std::isfinite(scale) && scale > 0)) MOECORE_FAIL(flag, " (", scale, ") must be a positive finite number");
  if (kind == Kind::constant) return;
  if (!(std::isfinite(min_scale) && min_scale > 0))
    MOECORE_FAIL("--min-loss-scale (", min_scale, ") must be a positive finite number");
  if (min_scale > scale)
    MOECORE_FAIL("--min-loss-scale (", min_scale, ") must not exceed --initial-loss-scale (", scale, ")");
  if (window <= 0) MOECORE_FAIL("--loss-scale-window (", window, ") must be a positive number of steps");
  if (hysteresis <= 0) MOECORE_FAIL("--hysteresis (", hysteresis, ") must be a positive number of steps");
}

GradScaler::GradScaler(const GradScalerConfig& cfg) : cfg_(cfg) {
  cfg_.validate();
  s_.scale = active() ? cfg_.scale : 1.0f;
  s_.hysteresis_tracker = cfg_.hysteresis;
}

void GradScaler::update(bool found_inf) {
  if (!dynamic()) return;
  if (found_inf) {
    s_.growth_tracker = 0;
    s_.hysteresis_tracker -= 1;
    if (s_.hysteresis_tracker <= 0) s_.scale = std::max(s_.scale * 0.5f, cfg_.min_scale);
    return;
  }
  s_.growth_tracker += 1;
  if (s_.growth_tracker == cfg_.window) {
    s_.growth_tracker = 0;
    s_.hysteresis_tracker = cfg_.hysteresis;
    s_.scale = s_.scale * 2.0f;
  }
}

void GradScaler::load(const GradScalerState& s, const char* where) {
  if (!(std::isfinite(s.scale) && s.scale > 0) || s.growth_tracker < 0)
    MOECORE_FAIL(where, ": grad_scaler {scale ", s.scale, ", growth_tracker ", s.growth_tracker,
                 "} is not a dynamic loss scaler's state (the scale positive and finite, the growth tracker >= 0)");
  s_ = s;
}

}  // namespace moecore::train
