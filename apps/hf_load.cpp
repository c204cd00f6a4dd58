#include "apps/hf_load.h"

#include <charconv>

#include "apps/hf_config.h"

namespace moecore::apps {
namespace {

// An integer key for this decision only: `def` when absent, nullopt when not an integer (the config table then
// refuses it by name).
std::optional<int64_t> int_key(const nlohmann::json& config, const char* key, int64_t def) {
  if (!config.contains(key)) return def;
  const nlohmann::json& v = config[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0) return std::nullopt;
  return v.get<int64_t>();
}

// The checkpoint layer a tensor belongs to (model.layers.N.*), or -1.
int64_t tensor_layer(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (!name.starts_with(prefix)) return -1;
  int64_t n = -1;
  const char* first = name.data() + prefix.size();
  const auto [end, ec] = std::from_chars(first, name.data() + name.size(), n);
  return ec == std::errc() && end != first && *end == '.' ? n : -1;
}

}  // namespace

bool hf_mtp_adjust(nlohmann::json& config, const io::HfCheckpointReader& hf, std::optional<int64_t> given_mtp,
                   const std::string& who, std::FILE* out) {
  if (!config.is_object() || !config.contains("model_type") || !config["model_type"].is_string()) return false;
  const std::string model = config["model_type"].get<std::string>();
  if (model != "deepseek_v3" && model != "glm4_moe") return false;  // the families with MTP layers
  const std::optional<int64_t> layers = int_key(config, "num_hidden_layers", -1),
                               nextn = int_key(config, "num_nextn_predict_layers", model == "glm4_moe" ? 1 : 0);
  if (!layers || *layers < 0 || !nextn) return false;
  for (const io::HfTensorInfo& t : hf.tensors())
    if (tensor_layer(t.name) >= *layers) return false;  // MTP tensors are there: read them (all, or refused)
  const int64_t depth = given_mtp.value_or(*nextn);
  if (depth == 0) return false;
  const std::string where = "model.layers." + std::to_string(*layers) +
                            (depth > 1 ? "-" + std::to_string(*layers + depth - 1) : std::string()) + ".*";
  if (!given_mtp) {
    config["num_nextn_predict_layers"] = 0;
    if (out)
      std::fprintf(out,
                   "%s: %s: config.json has num_nextn_predict_layers %lld but the checkpoint holds none of those MTP "
                   "layers (%s; transformers' save_pretrained drops them): loading it with MTP off. hint: "
                   "--mtp-num-layers N builds N freshly initialised MTP layers on it\n",
                   who.c_str(), hf.dir().c_str(), static_cast<long long>(*nextn), where.c_str());
    return false;
  }
  if (out)
    std::fprintf(out,
                 "%s: %s: the checkpoint holds no MTP layers (%s; config.json has num_nextn_predict_layers %lld, "
                 "and transformers' save_pretrained drops them): --mtp-num-layers %lld, so %lld MTP layer%s "
                 "initialised fresh (Megatron's init) and the rest read from the checkpoint\n",
                 who.c_str(), hf.dir().c_str(), where.c_str(), static_cast<long long>(*nextn),
                 static_cast<long long>(depth), static_cast<long long>(depth), depth == 1 ? " is" : "s are");
  return true;
}

model::HfWeightMap hf_load_weight_map(const nlohmann::json& config, const model::ModelConfig& cfg, bool mtp_fresh) {
  if (!mtp_fresh) return hf_config_weight_map(config, cfg);
  const model::HfWeightMap full = hf_config_weight_map(config, cfg);  // checks config's family and rope_interleave
  const nlohmann::json interleave = config.value("rope_interleave", nlohmann::json(true));
  return model::hf_weight_map_without_mtp(cfg, full.family, interleave.get<bool>());
}

}  // namespace moecore::apps
