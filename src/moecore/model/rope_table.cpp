#include "moecore/model/rope_table.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "moecore/kernels/ops.h"

namespace moecore::model {

double yarn_mscale(double scaling_factor, double mscale) {
  return scaling_factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scaling_factor) + 1.0;
}

std::vector<double> yarn_inv_freq(int64_t dim, double base, const YarnConfig& y) {
  // The channel pair index whose wavelength makes `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) *
           std::log(static_cast<double>(y.original_max_position_embeddings) / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(base));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.correction_range_round_to_int) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // no division by zero in the ramp
  std::vector<double> inv(static_cast<size_t>(dim / 2));
  for (int64_t j = 0; j < dim / 2; ++j) {
    const double extra = 1.0 / std::pow(base, static_cast<double>(2 * j) / static_cast<double>(dim));
    const double inter = extra / y.scaling_factor;
    const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
    const double mask = 1.0 - ramp;  // 1: keep the original frequency (fast-rotating channels)
    inv[static_cast<size_t>(j)] = inter * (1.0 - mask) + extra * mask;
  }
  return inv;
}

void fill_rope_table(Tensor& rope, const ModelConfig& cfg) {
  if (!cfg.yarn) {
    ops::rope_table(rope, cfg.rotary_base, {});
    return;
  }
  const int64_t S = rope.size(0), dr = rope.size(1), half = dr / 2;
  const std::vector<double> inv = yarn_inv_freq(dr, cfg.rotary_base, cfg.yarn_config);
  const double scale = yarn_mscale(cfg.yarn_config.scaling_factor, cfg.yarn_config.mscale) /
                       yarn_mscale(cfg.yarn_config.scaling_factor, cfg.yarn_config.mscale_all_dim);
  float* t = rope.data<float>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = 0; j < half; ++j) {
      const double a = static_cast<double>(s) * inv[static_cast<size_t>(j)];
      t[s * dr + j] = static_cast<float>(std::cos(a) * scale);
      t[s * dr + half + j] = static_cast<float>(std::sin(a) * scale);
    }
}

}  // namespace moecore::model
