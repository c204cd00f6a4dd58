// Configure a model from a Hugging Face config.json (`--hf-config FILE_OR_DIR`): its keys are translated into
// Megatron flags by one table (hf_config.cpp), and those flags then take the ordinary flag path, filling only
// flags the command line (or --config) left unset. Supported model_type: mixtral, qwen2_moe, qwen3_moe. Keys that
// change the math and cannot be honoured, and keys the table does not know, are refused by name; this file does
// not read weights (that is `convert --from-hf`).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/args.h"
#include "moecore/model/config.h"

namespace moecore::apps {

// The Megatron flags a config.json stands for, in table order: {"--num-layers", "32"}; a switch has the value "".
// Throws Error naming the key and value for anything refused, or the model_type.
std::vector<std::pair<std::string, std::string>> hf_config_flags(const nlohmann::json& config);

// `path` is a config.json or a directory holding one; throws Error naming the path when neither.
nlohmann::json hf_config_load(const std::string& path);

// The model of an HF config.json (file or directory) with Megatron flags `flags` ({"--seq-length", "16"}, switches
// with "") taking precedence, as `moecore train --hf-config PATH <flags>` would build it.
model::ModelConfig hf_model_config(const std::string& path,
                                   const std::vector<std::pair<std::string, std::string>>& flags);

// Declares --hf-config on a command.
void add_hf_config_flag(Args& args);
// After Args::parse: with --hf-config given, fills every flag still unset from the translated config.
void hf_config_apply(Args& args);

}  // namespace moecore::apps
