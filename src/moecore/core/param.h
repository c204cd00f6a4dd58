// A trainable parameter: a named f32 master tensor with its gradient and the copy GEMMs read.
// Lives in core so that model/ (which creates parameters) and optim/ (which updates them) share it
// without depending on each other.
#pragma once
#include <string>

#include "moecore/core/tensor.h"

namespace moecore {

struct Param {
  std::string name;   // Megatron name, e.g. "decoder.layers.0.mlp.linear_fc1.weight"
  Tensor value;       // f32 master weights
  Tensor grad;        // f32 gradient, accumulated by backward
  Tensor compute;     // the copy GEMMs read: value itself in f32 compute, a bf16 copy otherwise
  bool weight_decay;  // 2-D weights decay; norm weights and biases do not (Megatron's default)
};

}  // namespace moecore
