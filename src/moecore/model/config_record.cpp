#include "moecore/model/config_record.h"

#include <algorithm>
#include <functional>
#include <type_traits>

#include "moecore/core/error.h"

namespace moecore::model {
namespace {

using nlohmann::json;

// One recorded field: its value in a config, how a recorded value sets it, and whether it changes the model's
// function for a given config (e.g. the YaRN settings only with --rope-type yarn).
struct Field {
  const char* key;
  std::function<json(const ModelConfig&)> get;
  std::function<void(ModelConfig&, const json&)> set;
  bool (*matters)(const ModelConfig&) = nullptr;  // null: always
};

template <class T>
T value_of(const json& v, const char* key) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) MOECORE_FAIL("key \"", key, "\" is ", v.dump(), ", not true or false");
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) MOECORE_FAIL("key \"", key, "\" is ", v.dump(), ", not an integer");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) MOECORE_FAIL("key \"", key, "\" is ", v.dump(), ", not a number");
  } else {
    if (!v.is_string()) MOECORE_FAIL("key \"", key, "\" is ", v.dump(), ", not a string");
  }
  return v.get<T>();
}

// A field read and written through `ref` (a lambda returning a reference to it).
template <class Ref>
Field plain(const char* key, Ref ref, bool (*matters)(const ModelConfig&) = nullptr) {
  using T = std::decay_t<decltype(ref(std::declval<ModelConfig&>()))>;
  return {key, [ref](const ModelConfig& c) { return json(ref(const_cast<ModelConfig&>(c))); },
          [ref, key](ModelConfig& c, const json& v) { ref(c) = value_of<T>(v, key); }, matters};
}

// An enum field recorded by name (names[i] is the enumerator with value i).
template <class Ref>
Field named(const char* key, Ref ref, std::vector<const char*> names) {
  using E = std::decay_t<decltype(ref(std::declval<ModelConfig&>()))>;
  return {key,
          [ref, names](const ModelConfig& c) {
            return json(names.at(static_cast<size_t>(ref(const_cast<ModelConfig&>(c)))));
          },
          [ref, names, key](ModelConfig& c, const json& v) {
            const std::string s = value_of<std::string>(v, key);
            for (size_t i = 0; i < names.size(); ++i)
              if (s == names[i]) {
                ref(c) = static_cast<E>(i);
                return;
              }
            MOECORE_FAIL("key \"", key, "\" is \"", s, "\", not a known value");
          },
          nullptr};
}

// A field recorded by its effective value (the config's 0 = "the default rule" resolved) and set as given.
Field effective(const char* key, int64_t (*get)(const ModelConfig&), int64_t& (*ref)(ModelConfig&),
                bool (*matters)(const ModelConfig&) = nullptr) {
  return {key, [get](const ModelConfig& c) { return json(get(c)); },
          [ref, key](ModelConfig& c, const json& v) { ref(c) = value_of<int64_t>(v, key); }, matters};
}

// A field recorded by a computed value (get) and set back by `set`.
template <class Get, class Set>
Field computed(const char* key, Get get, Set set, bool (*matters)(const ModelConfig&) = nullptr) {
  return {key, [get](const ModelConfig& c) { return json(get(c)); }, set, matters};
}

bool learned_positions(const ModelConfig& c) {
  return c.position_embedding_type == PositionEmbedding::learned_absolute;
}
bool rope(const ModelConfig& c) {
  return c.rope() || c.multi_latent_attention;
}
bool yarn(const ModelConfig& c) {
  return c.yarn;
}
bool mla(const ModelConfig& c) {
  return c.multi_latent_attention;
}
bool moe(const ModelConfig& c) {
  return c.moe.enabled();
}
bool windowed(const ModelConfig& c) {
  return c.window_size >= 0;
}

// The decoder's shape and layers.
std::vector<Field> decoder_fields() {
  return {
      plain(
          "num_layers", [](ModelConfig & c) -> auto& { return c.num_layers; }),
      plain(
          "hidden_size", [](ModelConfig & c) -> auto& { return c.hidden_size; }),
      plain(
          "num_attention_heads", [](ModelConfig & c) -> auto& { return c.num_attention_heads; }),
      effective(
          "num_query_groups", [](const ModelConfig& c) { return c.query_groups(); },
          [](ModelConfig& c) -> int64_t& { return c.num_query_groups; }),
      effective(
          "kv_channels", [](const ModelConfig& c) { return c.head_dim(); },
          [](ModelConfig& c) -> int64_t& { return c.kv_channels; }),
      effective(
          "ffn_hidden_size", [](const ModelConfig& c) { return c.ffn(); },
          [](ModelConfig& c) -> int64_t& { return c.ffn_hidden_size; }),
      plain(
          "padded_vocab_size", [](ModelConfig & c) -> auto& { return c.vocab_size; }),
      plain(
          "swiglu", [](ModelConfig & c) -> auto& { return c.swiglu; }),
      plain(
          "quick_geglu", [](ModelConfig & c) -> auto& { return c.quick_geglu; }),
      plain(
          "glu_linear_offset", [](ModelConfig & c) -> auto& { return c.glu_linear_offset; }),
      plain(
          "activation_func_clamp_value", [](ModelConfig & c) -> auto& { return c.activation_func_clamp_value; }),
      plain(
          "untie_embeddings_and_output_weights",
          [](ModelConfig & c) -> auto& { return c.untie_embeddings_and_output_weights; }),
      named("normalization", [](ModelConfig & c) -> auto& { return c.normalization; }, {"RMSNorm", "LayerNorm"}),
      plain(
          "norm_epsilon", [](ModelConfig & c) -> auto& { return c.norm_epsilon; }),
      plain(
          "add_bias_linear", [](ModelConfig & c) -> auto& { return c.add_bias_linear; }),
      plain(
          "add_qkv_bias", [](ModelConfig & c) -> auto& { return c.add_qkv_bias; }),
      plain(
          "qk_layernorm", [](ModelConfig & c) -> auto& { return c.qk_layernorm; }),
      plain(
          "qk_layernorm_over_heads", [](ModelConfig & c) -> auto& { return c.qk_layernorm_over_heads; }),
  };
}

// Positions (learned, RoPE, YaRN), MLA and MTP.
std::vector<Field> attention_fields() {
  return {
      named("position_embedding_type", [](ModelConfig & c) -> auto& { return c.position_embedding_type; },
            {"learned_absolute", "rope", "none"}),
      // Recorded whatever the position embedding (an HF export writes it); the function of a learned table only.
      effective(
          "max_position_embeddings", [](const ModelConfig& c) { return c.max_positions(); },
          [](ModelConfig& c) -> int64_t& { return c.max_position_embeddings; }, learned_positions),
      plain(
          "rotary_base", [](ModelConfig & c) -> auto& { return c.rotary_base; }, rope),
      plain(
          "rotary_percent", [](ModelConfig & c) -> auto& { return c.rotary_percent; }, rope),
      plain(
          "rope_type_yarn", [](ModelConfig & c) -> auto& { return c.yarn; }, rope),
      plain(
          "rotary_scaling_factor", [](ModelConfig & c) -> auto& { return c.yarn_config.scaling_factor; }, yarn),
      plain(
          "mscale", [](ModelConfig & c) -> auto& { return c.yarn_config.mscale; }, yarn),
      plain(
          "mscale_all_dim", [](ModelConfig & c) -> auto& { return c.yarn_config.mscale_all_dim; }, yarn),
      plain(
          "yarn_original_max_position_embeddings",
          [](ModelConfig & c) -> auto& { return c.yarn_config.original_max_position_embeddings; }, yarn),
      plain(
          "yarn_beta_fast", [](ModelConfig & c) -> auto& { return c.yarn_config.beta_fast; }, yarn),
      plain(
          "yarn_beta_slow", [](ModelConfig & c) -> auto& { return c.yarn_config.beta_slow; }, yarn),
      plain(
          "yarn_correction_range_round_to_int",
          [](ModelConfig & c) -> auto& { return c.yarn_config.correction_range_round_to_int; }, yarn),
      plain(
          "multi_latent_attention", [](ModelConfig & c) -> auto& { return c.multi_latent_attention; }),
      plain(
          "q_lora_rank", [](ModelConfig & c) -> auto& { return c.q_lora_rank; }, mla),
      plain(
          "kv_lora_rank", [](ModelConfig & c) -> auto& { return c.kv_lora_rank; }, mla),
      plain(
          "qk_head_dim", [](ModelConfig & c) -> auto& { return c.qk_head_dim; }, mla),
      plain(
          "qk_pos_emb_head_dim", [](ModelConfig & c) -> auto& { return c.qk_pos_emb_head_dim; }, mla),
      plain(
          "v_head_dim", [](ModelConfig & c) -> auto& { return c.v_head_dim; }, mla),
      plain(
          "mtp_num_layers", [](ModelConfig & c) -> auto& { return c.mtp_num_layers; }),
      named("softmax_type", [](ModelConfig & c) -> auto& { return c.softmax_type; },
            {"vanilla", "off-by-one", "learnable"}),
      plain(
          "window_size", [](ModelConfig & c) -> auto& { return c.window_size; }),
      plain(
          "window_attn_skip_freq", [](ModelConfig & c) -> auto& { return c.window_attn_skip_freq; }, windowed),
  };
}

std::vector<Field> moe_fields() {
  return {
      plain(
          "num_experts", [](ModelConfig & c) -> auto& { return c.moe.num_experts; }),
      effective(
          "moe_ffn_hidden_size", [](const ModelConfig& c) { return c.moe_ffn(); },
          [](ModelConfig& c) -> int64_t& { return c.moe.ffn_hidden_size; }),
      plain(
          "moe_layer_freq", [](ModelConfig & c) -> auto& { return c.moe_layer_freq; }, moe),
      plain(
          "moe_router_topk", [](ModelConfig & c) -> auto& { return c.moe.router_topk; }, moe),
      named("moe_router_score_function", [](ModelConfig & c) -> auto& { return c.moe.score_function; },
            {"softmax", "sigmoid", "sqrtsoftplus"}),
      plain(
          "moe_router_pre_softmax", [](ModelConfig & c) -> auto& { return c.moe.pre_softmax; }, moe),
      // Megatron's None (0) scales by 1.
      computed(
          "moe_router_topk_scaling_factor",
          [](const ModelConfig& c) { return c.moe.topk_scaling_factor > 0 ? c.moe.topk_scaling_factor : 1.0f; },
          [](ModelConfig& c, const json& v) {
            c.moe.topk_scaling_factor = value_of<float>(v, "moe_router_topk_scaling_factor");
          },
          moe),
      plain(
          "moe_router_num_groups", [](ModelConfig & c) -> auto& { return c.moe.num_groups; }, moe),
      plain(
          "moe_router_group_topk", [](ModelConfig & c) -> auto& { return c.moe.group_topk; }, moe),
      computed(  // 0: Megatron's rule, K / group_topk
          "moe_router_group_score_topk",
          [](const ModelConfig& c) { return c.moe.num_groups > 0 ? c.moe.group_score_k() : int64_t{0}; },
          [](ModelConfig& c, const json& v) {
            c.moe.group_score_topk = value_of<int64_t>(v, "moe_router_group_score_topk");
          },
          moe),
      plain(
          "moe_router_enable_expert_bias", [](ModelConfig & c) -> auto& { return c.moe.enable_expert_bias; }, moe),
      plain(
          "moe_shared_expert_intermediate_size",
          [](ModelConfig & c) -> auto& { return c.moe.shared_expert_intermediate_size; }, moe),
      plain(
          "moe_shared_expert_gate", [](ModelConfig & c) -> auto& { return c.moe.shared_expert_gate; }, moe),
  };
}

const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> t = decoder_fields();
    for (auto part : {attention_fields(), moe_fields()}) t.insert(t.end(), part.begin(), part.end());
    return t;
  }();
  return table;
}

// The value two models compare by: the MoE layer pattern by the layers it makes MoE, not by its spelling (an
// expression that does not parse compares by its text).
json compared(const Field& f, const ModelConfig& c) {
  if (std::string(f.key) == "moe_layer_freq") {
    try {
      json layers = json::array();
      for (bool b : c.moe_layers()) layers.push_back(b);
      return layers;
    } catch (const Error&) {
    }
  }
  return f.get(c);
}

}  // namespace

json model_record(const ModelConfig& c) {
  json r = json::object();
  for (const Field& f : fields()) r[f.key] = f.get(c);
  return r;
}

ModelConfig model_from_record(const json& record, const std::string& where, const ModelConfig& base) {
  if (!record.is_object()) MOECORE_FAIL(where, ": the model record is not an object");
  ModelConfig c = base;
  for (const auto& [key, value] : record.items()) {
    const Field* f = nullptr;
    for (const Field& g : fields())
      if (key == g.key) f = &g;
    if (!f) MOECORE_FAIL(where, ": the model record has an unknown key \"", key.substr(0, 64), "\"");
    try {
      f->set(c, value);
    } catch (const Error& e) {
      throw Error(where + ": the model record's " + e.what());
    }
  }
  c.moe.swiglu = c.swiglu;  // the experts' activation is the model's
  c.moe.glu = c.glu_params();
  // The sequence length is the run's, not the model's: within the recorded positions.
  if (c.max_position_embeddings > 0) c.seq_length = std::min(c.seq_length, c.max_position_embeddings);
  return c;
}

std::vector<std::string> model_differences(const ModelConfig& a, const ModelConfig& b, const std::string& a_name,
                                           const std::string& b_name) {
  std::vector<std::string> out;
  for (const Field& f : fields()) {
    if (f.matters && !f.matters(a) && !f.matters(b)) continue;
    // Layer patterns are read against the number of layers (a difference of its own, reported by its field).
    if (std::string(f.key) == "moe_layer_freq" && a.num_layers != b.num_layers) continue;
    const json va = compared(f, a), vb = compared(f, b);
    if (va != vb)
      out.push_back(std::string(f.key) + " " + f.get(a).dump() + " (" + a_name + ") vs " + f.get(b).dump() + " (" +
                    b_name + ")");
  }
  return out;
}

}  // namespace moecore::model
