// The model's rotary table: plain RoPE (ops::rope_table), or YaRN (Megatron's YarnRotaryEmbedding, as
// transformers' _compute_yarn_parameters): frequencies blended between interpolated (1 / factor) and original by a
// linear ramp over the correction range of beta_fast / beta_slow rotations, and cos/sin scaled by
// mscale(factor, mscale) / mscale(factor, mscale_all_dim).
#pragma once
#include <vector>

#include "moecore/core/tensor.h"
#include "moecore/model/config.h"

namespace moecore::model {

// inv_freq[j], j < dim / 2, of YaRN over `dim` rotary channels with base `base`.
std::vector<double> yarn_inv_freq(int64_t dim, double base, const YarnConfig& y);
double yarn_mscale(double scaling_factor, double mscale);  // 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)

// rope [S, Dr] f32 on the CPU: cos in columns [0, Dr/2), sin in [Dr/2, Dr) (ops::rope_table's layout).
void fill_rope_table(Tensor& rope, const ModelConfig& cfg);

}  // namespace moecore::model
