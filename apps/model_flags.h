// Megatron's model and MoE flags, shared by every subcommand that builds a model: one table (model_flags.cpp) of
// flag, Megatron default, help and the rule reading it into the ModelConfig.
#pragma once
#include "apps/args.h"
#include "moecore/model/config.h"

namespace moecore::apps {
// Declares every model and MoE flag; the flags Megatron requires default to `defaults`' values.
void add_model_flags(Args& args, const model::ModelConfig& defaults);
// Whether the command line (or --config) gave any model flag.
bool model_flags_given(const Args& args);
// Validated. With --vocab-size unset the vocabulary is tokenizer_vocab (already padded by the caller);
// tokenizer_ids: the ids the tokenizer produces, the least --vocab-size may be (-1: tokenizer_vocab itself).
model::ModelConfig model_config_from(const Args& args, int64_t tokenizer_vocab = 0, int64_t tokenizer_ids = -1);
}  // namespace moecore::apps
