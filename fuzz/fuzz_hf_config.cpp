// libFuzzer harness: a Hugging Face config.json through the import path of `moecore convert --from-hf`: parse
// (apps::hf_config_parse), translate to Megatron flags and build the ModelConfig (apps::hf_model_config with
// --seq-length 1), then the HF weight map (apps::hf_config_weight_map) and the parameter list it implies.
// moecore::Error is the expected outcome of bad input; anything else is a finding to fix in the reader.
// Seeds (fuzz/seeds/hf_config/): small config.json files written by hand, one per model_type.
#include <cstdint>
#include <string>

#include "apps/hf_config.h"
#include "moecore/model/param_specs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json config = moecore::apps::hf_config_parse(text, "config.json");
    const moecore::model::ModelConfig cfg =
        moecore::apps::hf_model_config(config, "--from-hf fuzz", {{"--seq-length", "1"}});
    (void)moecore::apps::hf_config_weight_map(config, cfg);
    (void)moecore::model::parameter_specs(cfg);
  } catch (const moecore::Error&) {
  }
  return 0;
}
