#include "moecore/train/checkpointing.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "moecore/io/checkpoint.h"

namespace moecore::train {
namespace {

using nlohmann::json;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";

json model_fingerprint(const model::ModelConfig& c) {
  return {{"num_layers", c.num_layers},       {"hidden_size", c.hidden_size},
          {"num_attention_heads", c.num_attention_heads}, {"num_query_groups", c.query_groups()},
          {"kv_channels", c.head_dim()},     {"ffn_hidden_size", c.ffn()},
          {"vocab_size", c.vocab_size},      {"num_experts", c.moe.num_experts},
          {"moe_ffn_hidden_size", c.moe.enabled() ? c.moe_ffn() : 0},
          {"moe_layer_freq", c.moe_layer_freq}, {"swiglu", c.swiglu},
          {"normalization", c.normalization == model::Normalization::layernorm ? "LayerNorm" : "RMSNorm"},
          {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights}};
}

std::string bias_name(int64_t layer) { return "router_state." + std::to_string(layer) + ".expert_bias"; }

const Tensor& need(const io::SafetensorsFile& f, const std::string& file, const std::string& name, const Tensor& like) {
  auto it = f.tensors.find(name);
  if (it == f.tensors.end()) MOECORE_FAIL("checkpoint: ", file, " has no tensor '", name, "'");
  if (!(it->second.shape() == like.shape()))
    MOECORE_FAIL("checkpoint: ", file, " tensor '", name, "' has shape ", it->second.shape().str(),
                 " but the model expects ", like.shape().str());
  return it->second;
}

}  // namespace

uint64_t parameter_hash(const model::GptModel& gpt) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& p : gpt.params()) {
    const auto* b = static_cast<const unsigned char*>(p.value.raw());
    for (int64_t i = 0; i < p.value.nbytes(); ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  }
  return h;
}

void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const optim::AdamW& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last) {
  io::CheckpointWriteRequest req;
  req.iteration = progress.iteration;
  auto& model = req.files[kModelFile];
  auto& optim = req.files[kOptimizerFile];
  const auto& params = gpt.params();
  for (size_t i = 0; i < params.size(); ++i) {
    model[params[i].name] = params[i].value;
    optim["exp_avg." + params[i].name] = opt.exp_avg()[i];
    optim["exp_avg_sq." + params[i].name] = opt.exp_avg_sq()[i];
  }
  json calls = json::array();
  for (int64_t l = 0; l < gpt.config().num_layers; ++l) {
    const moe::RouterState* st = gpt.router_state(l);
    calls.push_back(st ? st->calls : 0);
    if (st && st->expert_bias.defined()) model[bias_name(l)] = st->expert_bias;
  }
  const json state = {{"format", "moecore-train-state"},
                      {"version", 1},
                      {"iteration", progress.iteration},
                      {"consumed_samples", progress.consumed_samples},
                      {"optimizer_steps", opt.steps_taken()},
                      {"seed", seed},
                      {"router_calls", calls},
                      {"model", model_fingerprint(gpt.config())}};
  req.state_json = state.dump(1);
  io::checkpoint_save(root, req, keep_last);
}

TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt,
                                       uint64_t seed) {
  const io::LoadedCheckpoint ck = io::checkpoint_load(dir);
  json state;
  try {
    state = json::parse(ck.state_json);
  } catch (const json::exception& e) {
    MOECORE_FAIL("checkpoint: ", ck.dir, "/state.json is not valid JSON: ", e.what());
  }
  if (state.value("format", "") != "moecore-train-state" || state.value("version", 0) != 1)
    MOECORE_FAIL("checkpoint: ", ck.dir, "/state.json is not a moecore training state (format/version)");
  const json want = model_fingerprint(gpt.config());
  for (const auto& [k, v] : want.items()) {
    if (!state["model"].contains(k) || state["model"][k] != v)
      MOECORE_FAIL("checkpoint: ", ck.dir, " was saved with ", k, " = ",
                   state["model"].contains(k) ? state["model"][k].dump() : std::string("(absent)"),
                   " but the model has ", k, " = ", v.dump());
  }
  if (state.value("seed", uint64_t{0}) != seed)
    std::fprintf(stderr, "checkpoint: warning: %s was saved with --seed %llu, resuming with --seed %llu\n",
                 ck.dir.c_str(), static_cast<unsigned long long>(state.value("seed", uint64_t{0})),
                 static_cast<unsigned long long>(seed));
  for (const char* f : {kModelFile, kOptimizerFile})
    if (!ck.files.count(f)) MOECORE_FAIL("checkpoint: ", ck.dir, " has no ", f);
  const io::SafetensorsFile& model = ck.files.at(kModelFile);
  const io::SafetensorsFile& optim = ck.files.at(kOptimizerFile);
  auto& params = gpt.params();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].value.copy_from(need(model, kModelFile, params[i].name, params[i].value));
    opt.exp_avg()[i].copy_from(need(optim, kOptimizerFile, "exp_avg." + params[i].name, opt.exp_avg()[i]));
    opt.exp_avg_sq()[i].copy_from(need(optim, kOptimizerFile, "exp_avg_sq." + params[i].name, opt.exp_avg_sq()[i]));
  }
  const json& calls = state["router_calls"];
  for (int64_t l = 0; l < gpt.config().num_layers; ++l) {
    moe::RouterState* st = gpt.router_state(l);
    if (!st) continue;
    st->calls = calls.at(static_cast<size_t>(l)).get<int64_t>();
    if (st->expert_bias.defined()) st->expert_bias.copy_from(need(model, kModelFile, bias_name(l), st->expert_bias));
  }
  gpt.refresh_compute_weights();
  gpt.zero_grad();
  opt.set_steps_taken(state.at("optimizer_steps").get<int64_t>());
  return {state.at("iteration").get<int64_t>(), state.at("consumed_samples").get<int64_t>()};
}

}  // namespace moecore::train
