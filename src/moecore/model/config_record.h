// The model's configuration as a checkpoint records it (state.json "model_config"): every ModelConfig field that
// decides what the model computes from its weights, keyed by Megatron's argument name (num_layers,
// moe_router_topk, rotary_base, ...). Training-only settings are not part of it (dropout, initialisation,
// recompute, loss coefficients, capacity and dropping, router and compute precision, the sequence length of a RoPE
// model): they may change between a run and its resume. One table (config_record.cpp) serves the record, its
// reading back and the comparison of two models; a resume compares the run's model with the checkpoint's, an HF
// export writes the checkpoint's.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/model/config.h"

namespace moecore::model {

nlohmann::json model_record(const ModelConfig& c);
// A ModelConfig of the recorded model: `base` (e.g. the config it was imported from, for the training-only settings)
// with every recorded field set. Throws Error naming `where` and the key for an unknown key or a value of the wrong
// type.
ModelConfig model_from_record(const nlohmann::json& record, const std::string& where, const ModelConfig& base);
// What differs between two models' functions, one entry per field: "--moe-router-topk 2 (checkpoint) vs 3 (this
// run)" with `a_name` / `b_name` in the parentheses; empty when the two compute the same function.
std::vector<std::string> model_differences(const ModelConfig& a, const ModelConfig& b, const std::string& a_name,
                                           const std::string& b_name);

}  // namespace moecore::model
