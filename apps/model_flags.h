// Megatron's model flags, shared by every subcommand that builds a model.
#pragma once
#include "apps/args.h"
#include "moecore/model/config.h"

namespace moecore::apps {
void add_model_flags(Args& args, const model::ModelConfig& defaults);
// Validated. With --vocab-size 0 the vocabulary is tokenizer_vocab (already padded by the caller).
model::ModelConfig model_config_from(const Args& args, int64_t tokenizer_vocab = 0);
// The MoE flags alone (also used by `moecore moe-layer`); swiglu is the experts' activation.
void add_moe_flags(Args& args);
moe::MoeConfig moe_config_from(const Args& args, bool swiglu);
}  // namespace moecore::apps
