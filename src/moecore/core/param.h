// A trainable parameter: a named f32 master tensor with its gradient and the copy GEMMs read.
// Lives in core so that model/ (which creates parameters) and optim/ (which updates them) share it
// without depending on each other.
#pragma once
#include <string>

#include "moecore/core/shard.h"
#include "moecore/core/tensor.h"

namespace moecore {

struct Param {
  std::string name;   // Megatron name, e.g. "decoder.layers.0.mlp.linear_fc1.weight"
  Tensor value;       // f32 master weights
  Tensor grad;        // f32 gradient, accumulated by backward
  Tensor compute;     // the copy GEMMs read: value itself in f32 compute, a bf16 copy otherwise
  bool weight_decay;  // 2-D weights decay; norm weights and biases do not (Megatron's default)
  // Routed-expert weight sharded over the expert-parallel group along dim 0: this rank holds experts
  // [ep_rank * n, (ep_rank + 1) * n) of the global [E, ...] tensor, n = value.size(0). Its gradient is
  // reduced over the expert-data-parallel group, every other parameter's over the data-parallel group.
  bool expert_parallel = false;
  // Tensor-parallel split (core/shard.h): value, grad and compute hold this rank's shard of the global tensor. For an
  // expert_parallel parameter it is the expert-tensor-parallel split of this rank's [n, ...] experts, over the ETP
  // group (the expert weights never split over TP).
  TensorShard tp;
  // Replicated over the tensor-parallel group but fed by a different part of the data on each of its ranks (norms and
  // row-parallel biases under sequence parallelism, QK-norm weights under TP): the gradient is summed over the group
  // (Megatron's finalize_model_grads) before the data-parallel reduction.
  bool tp_grad_sum = false;
  // Under pipeline parallelism, the last stage's copy of a first-stage parameter (the word embeddings, when the output
  // layer is tied to them or MTP embeds with them): its gradient is summed with the first stage's, and the norm
  // counts it there only.
  bool pipeline_copy = false;
};

}  // namespace moecore
