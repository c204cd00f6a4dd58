// Configure a model from a Hugging Face config.json (`--hf-config FILE_OR_DIR`): its keys are translated into
// Megatron flags by one table (hf_config.cpp), and those flags then take the ordinary flag path, filling only
// flags the command line (or --config) left unset. Supported model_type: mixtral, qwen2_moe, qwen3_moe,
// deepseek_v3. Keys that
// change the math and cannot be honoured, and keys the table does not know, are refused by name; this file does
// not read weights (that is `convert --from-hf`).
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/args.h"
#include "moecore/model/config.h"
#include "moecore/model/hf_weights.h"

namespace moecore::apps {

// The Megatron flags a config.json stands for, in table order: {"--num-layers", "32"}; a switch has the value "".
// Throws Error naming the key and value for anything refused, or the model_type: a value of the wrong JSON type,
// a non-finite or out-of-float-range number, a size beyond its bound (num_hidden_layers 4096, hidden_size 2^20,
// ..., layers x experts 2^16), so nothing is sized from a hostile file.
std::vector<std::pair<std::string, std::string>> hf_config_flags(const nlohmann::json& config);

// `path` is a config.json or a directory holding one; throws Error naming `flag` (the flag the user typed:
// --hf-config, --load-hf, --from-hf, --hf) and the path when neither, or when it is not a regular file (a FIFO).
std::string hf_config_path(const std::string& path, const std::string& flag);  // the config.json file itself
nlohmann::json hf_config_load(const std::string& path, const std::string& flag);
nlohmann::json hf_config_parse(const std::string& text, const std::string& where);  // `where` names it in errors

// The model of an HF config.json with Megatron flags `flags` ({"--seq-length", "16"}, switches with "") taking
// precedence, as `moecore train --hf-config PATH <flags>` would build it. `where` names the config in errors.
model::ModelConfig hf_model_config(const nlohmann::json& config, const std::string& where,
                                   const std::vector<std::pair<std::string, std::string>>& flags = {});
// The weights' dtype the config names ("bfloat16"): its "dtype" (transformers 5), else "torch_dtype"; nullopt when
// neither is given (absent or null). Throws naming the key when the value is not a string.
std::optional<std::string> hf_config_dtype(const nlohmann::json& config);
// The HF <-> moecore weight map of a model built from `config` (its model_type and, for deepseek_v3,
// rope_interleave).
model::HfWeightMap hf_config_weight_map(const nlohmann::json& config, const model::ModelConfig& cfg);
// The config.json of a model, from the same table (each row's emitter), for an export without a recorded
// config.json. Throws naming what does not survive the trip (read back, the file must give the same parameters,
// positions, RoPE/YaRN, norm epsilon and routing) when the family cannot hold the model.
nlohmann::json hf_config_for_model(const model::ModelConfig& cfg, model::HfFamily family);
// `original` (the config.json the model came from) with each key that stands for a Megatron flag set to `cfg`'s value
// where that differs (another spelling of the same flag the table only reads, e.g. rope_parameters, removed); every
// other key kept. The export of a model trained from an HF config with flags that change its math
// (--moe-router-topk, --rotary-base, ...). Throws, naming `where` and each difference, when the result does not read
// back as `cfg`.
nlohmann::json hf_config_update(const nlohmann::json& original, const model::ModelConfig& cfg,
                                const std::string& where);
// Fills every flag of `args` still unset from the config's translation.
void hf_config_fill(Args& args, const nlohmann::json& config, const std::string& where);

// Declares --hf-config on a command.
void add_hf_config_flag(Args& args);
// After Args::parse: with --hf-config given, fills every flag still unset from the translated config. Errors name
// `flag`, the flag the user typed (train: --load-hf when it set --hf-config).
void hf_config_apply(Args& args, const std::string& flag);

}  // namespace moecore::apps
