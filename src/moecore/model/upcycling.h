// Upcycling a dense GPT into an MoE GPT (Megatron's --moe-use-upcycling, docs/megatron-moe-spec.md §10): every shared
// parameter is copied; each MoE layer's experts are built from the dense MLP, either as full copies (granularity 1) or
// as 1/g slices of it (granular upcycling, --moe-upcycling-granularity g, dense ffn = g * moe ffn).
#pragma once
#include "moecore/model/gpt.h"

namespace moecore::model {

// Fills `moe` from `dense`. The router keeps moe's own initial weights with rows tied in blocks of g
// (expert e uses row e / g), and expert weights are scaled by a^(1/3) (GLU) or a^(1/2), where
// a = E*g/K with pre-softmax routing and a = g otherwise. Throws Error naming the mismatching sizes.
void upcycle_dense_to_moe(const GptModel& dense, GptModel& moe);

}  // namespace moecore::model
