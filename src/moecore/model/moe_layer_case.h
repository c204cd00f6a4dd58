// One MoE layer run as a self-contained case, for comparing moecore with other implementations
// (`moecore moe-layer`, docs/moe-layer-golden.md): a Megatron-style JSON config plus named input tensors in,
// the output, routing decisions, losses and every gradient out. Tokens are in Megatron's order, t = s * B + b.
#pragma once
#include <map>
#include <string>

#include "moecore/moe/moe_layer.h"

namespace moecore::model {

struct MoeLayerCase {
  moe::MoeConfig cfg;
  int64_t H = 0, F = 0, Fs = 0, B = 1;
  DType compute = DType::f32;
  float aux_grad_scale = 1.0f;
  bool add_bias_linear = false;  // router, fc1 and fc2 biases (Megatron's add_bias_linear; false by default here)
};

// Parses layer.json (keys as in docs/moe-layer-golden.md); unknown keys are rejected by name, and every key is
// checked for its JSON type and range (sizes in [1, 2^24], finite numbers) with an Error naming the key.
MoeLayerCase moe_layer_case_parse(const std::string& json_text);
// Runs forward and backward on `device`; returns out.*, routing.*, loss.* and grad.* tensors (host copies, f32 /
// bool / i64 / f64). The inputs are host tensors, moved to the device. Every input tensor must be present with the
// shape the case declares (input.hidden: [T, H], T a positive multiple of B); Errors name the tensor and both shapes.
std::map<std::string, Tensor> moe_layer_case_run(const MoeLayerCase& c, const std::map<std::string, Tensor>& in,
                                                 Device device = Device::cpu);

}  // namespace moecore::model
