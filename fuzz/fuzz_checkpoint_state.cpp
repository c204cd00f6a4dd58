// libFuzzer harness for the state.json reader of training checkpoints (train::train_state_parse, the model
// fingerprint check train::check_checkpoint_model and the model record's, train::check_checkpoint_function): any input
// is either a validated state or an Error; anything else (another exception, a crash, a sanitizer report, a slow input,
// a big allocation) is a finding. Seeds: fuzz/seeds/checkpoint_state/ (state.json files as save_training_checkpoint
// writes them for the model below: 2 layers, hidden 32, 4 experts, MoE in layer 1).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "moecore/core/error.h"
#include "moecore/model/config.h"
#include "moecore/train/checkpointing.h"

namespace {
moecore::model::ModelConfig fuzz_model() {
  moecore::model::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.moe.num_experts = 4;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = 24;
  c.moe_layer_freq = "[0,1]";
  return c;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::model::ModelConfig cfg = fuzz_model();
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const moecore::train::TrainStateJson s = moecore::train::train_state_parse(text, "fuzz/iter_0000004");
    if (s.iteration < 0 || s.consumed_samples < 0 || s.expert_model_parallel_size < 1) __builtin_trap();
  } catch (const moecore::Error&) {
  }
  try {
    moecore::train::check_checkpoint_model(text, cfg, "fuzz/iter_0000004");
  } catch (const moecore::Error&) {
  }
  try {  // the model record (state.json "model_config") against the model, as a resume compares them
    moecore::train::check_checkpoint_function(text, cfg, "fuzz/iter_0000004", /*finetune=*/false);
  } catch (const moecore::Error&) {
  }
  return 0;
}
