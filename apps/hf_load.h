// What the commands that read a Hugging Face checkpoint's weights (model-step --hf, convert --from-hf, train
// --load-hf) build when its config.json and its tensors disagree the one way transformers makes them disagree:
// DeepSeek-V3's save_pretrained keeps num_nextn_predict_layers but drops the MTP layers' tensors. Not here: the
// config.json table (hf_config.cpp), the weight names and the import itself (model/hf_weights).
#pragma once
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "moecore/io/hf_checkpoint.h"
#include "moecore/model/config.h"
#include "moecore/model/hf_weights.h"

namespace moecore::apps {

// The MTP layers of a deepseek_v3 or glm4_moe checkpoint are its tensors model.layers.{num_hidden_layers + k}.*. When
// `hf` holds none of them:
//   - --mtp-num-layers not given (`given_mtp` nullopt): `config`'s num_nextn_predict_layers is set to 0, so the model
//     is built without MTP, as transformers loads it; returns false.
//   - --mtp-num-layers N given (command line or --config): N MTP layers are built and initialised fresh (Megatron's
//     init) while the rest is read; returns true (pass it to hf_load_weight_map).
// Either way one notice goes to `out` (nullptr: none) naming `who`, the directory, the config key and why. When `hf`
// holds some MTP tensor, or nothing asks for MTP, nothing changes (false): hf_check_tensors then refuses a checkpoint
// with some but not all of them, naming the first it lacks. Other model types: false, unchanged.
bool hf_mtp_adjust(nlohmann::json& config, const io::HfCheckpointReader& hf, std::optional<int64_t> given_mtp,
                   const std::string& who, std::FILE* out);

// The weight map to check and import for the model `cfg` built from `config`: hf_config_weight_map, or with
// `mtp_fresh` (hf_mtp_adjust's answer) the map less the MTP layers, which hf_import leaves initialised.
model::HfWeightMap hf_load_weight_map(const nlohmann::json& config, const model::ModelConfig& cfg, bool mtp_fresh);

}  // namespace moecore::apps
