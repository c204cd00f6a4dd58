// The config.json -> Megatron flags table. Semantics are those of transformers' Mixtral, Qwen2-MoE and Qwen3-MoE
// configuration and modeling files. A key absent from config.json takes the transformers class default written in
// its row, or is required when the row has none (size keys: a guessed size would be a different model).
#include "apps/hf_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "apps/model_flags.h"
#include "moecore/core/error.h"

namespace moecore::apps {
namespace {

using json = nlohmann::json;
using Flags = std::vector<std::pair<std::string, std::string>>;

enum Model : unsigned { kMixtral = 1, kQwen2 = 2, kQwen3 = 4, kQwen = kQwen2 | kQwen3, kAll = 7 };
constexpr const char* kModelNames[] = {"mixtral", "qwen2_moe", "qwen3_moe"};

struct Row;
using Convert = void (*)(const Row& row, const json& v, const json& cfg, Flags& out);

// One config.json key for the model types in `models`: `flag` is the Megatron flag it maps to (or what the
// conversion emits), `def` the transformers default as JSON text (nullptr: required).
struct Row {
  const char* key;
  unsigned models;
  const char* flag;
  Convert convert;
  const char* def;
};

std::string model_of(const json& cfg) {
  return cfg.value("model_type", std::string());
}

[[noreturn]] void refuse(const Row& r, const json& v, const json& cfg, const std::string& why) {
  MOECORE_FAIL("config.json key '", r.key, "' = ", v.dump(), " (model_type ", model_of(cfg), "): ", why);
}

std::string number_text(double x) {
  if (std::nearbyint(x) == x && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, res.ptr);
}

int64_t positive_int(const Row& r, const json& v, const json& cfg) {
  if (!v.is_number_integer() || v.get<int64_t>() <= 0) refuse(r, v, cfg, "expected a positive integer");
  return v.get<int64_t>();
}

void to_int(const Row& r, const json& v, const json& cfg, Flags& out) {
  out.emplace_back(r.flag, std::to_string(positive_int(r, v, cfg)));
}

void to_number(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (!v.is_number() || v.get<double>() < 0) refuse(r, v, cfg, "expected a non-negative number");
  out.emplace_back(r.flag, number_text(v.get<double>()));
}

void ignore(const Row&, const json&, const json&, Flags&) {}

void switch_if_false(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (!v.is_boolean()) refuse(r, v, cfg, "expected true or false");
  if (!v.get<bool>()) out.emplace_back(r.flag, "");
}

void must_be_null(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_null()) refuse(r, v, cfg, std::string("not supported yet: ") + r.flag + " (only null)");
}

void must_be_false(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v != json(false)) refuse(r, v, cfg, std::string("not supported yet: ") + r.flag + " (only false)");
}

void must_be_zero(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_number() || v.get<double>() != 0.0)
    refuse(r, v, cfg, std::string("not supported yet: ") + r.flag + " (only 0)");
}

// transformers: num_key_value_heads None means one key/value head per query head (plain MHA).
void kv_heads(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_null()) return;
  out.emplace_back("--group-query-attention", "");
  out.emplace_back(r.flag, std::to_string(positive_int(r, v, cfg)));
}

void optional_int(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (!v.is_null()) to_int(r, v, cfg, out);
}

void hidden_act(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v != json("silu")) refuse(r, v, cfg, "not supported: only \"silu\" (the gated SiLU MLP, --swiglu)");
  out.emplace_back(r.flag, "");
}

// Mixtral applies a sliding window whenever sliding_window is set; Qwen only with use_sliding_window.
void sliding_window(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (model_of(cfg) == "mixtral" || cfg.value("use_sliding_window", false)) must_be_null(r, v, cfg, out);
}

// HF renormalises the top-k softmax weights with norm_topk_prob true (Megatron's default: softmax after top-k);
// false keeps the softmax over all experts (Megatron's --moe-router-pre-softmax).
void norm_topk_prob(const Row& r, const json& v, const json& cfg, Flags& out) {
  switch_if_false(r, v, cfg, out);
}

// Qwen: layer i is MoE when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (so step 2 makes
// layers 1, 3, ... MoE, unlike Megatron's integer --moe-layer-freq 2). All-MoE keeps Megatron's default 1.
void moe_layer_freq(const Row& r, const json& v, const json& cfg, Flags& out) {
  const int64_t step = positive_int(r, v, cfg);
  const json only = cfg.value("mlp_only_layers", json::array());
  if (!only.is_array()) MOECORE_FAIL("config.json key 'mlp_only_layers' = ", only.dump(), ": expected a list");
  const int64_t layers = cfg.value("num_hidden_layers", int64_t{0});
  std::vector<int> moe(static_cast<size_t>(std::max<int64_t>(layers, 0)));
  for (int64_t i = 0; i < layers; ++i) moe[i] = (i + 1) % step == 0;
  for (const json& e : only) {
    if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= layers)
      MOECORE_FAIL("config.json key 'mlp_only_layers' entry ", e.dump(), " is not a layer index in [0, ", layers, ")");
    moe[e.get<int64_t>()] = 0;
  }
  if (std::all_of(moe.begin(), moe.end(), [](int m) { return m == 1; })) return;
  std::string expr;
  for (size_t i = 0; i < moe.size();) {
    size_t j = i;
    while (j < moe.size() && moe[j] == moe[i]) ++j;
    expr += (expr.empty() ? "[" : "+[") + std::to_string(moe[i]) + "]*" + std::to_string(j - i);
    i = j;
  }
  out.emplace_back(r.flag, expr);
}

// Qwen: num_experts (transformers 5 may write num_local_experts for Qwen3-MoE); exactly one must be given.
void num_experts(const Row& r, const json& v, const json& cfg, Flags& out) {
  const bool a = cfg.contains("num_experts") && !cfg["num_experts"].is_null();
  const bool b = cfg.contains("num_local_experts") && !cfg["num_local_experts"].is_null();
  if (!a && !b) MOECORE_FAIL("config.json lacks 'num_experts', required for model_type ", model_of(cfg));
  if (a && b && cfg["num_experts"] != cfg["num_local_experts"])
    refuse(r, v, cfg, "differs from num_local_experts " + cfg["num_local_experts"].dump());
  if (!v.is_null() && (std::string(r.key) == "num_experts" || !a)) to_int(r, v, cfg, out);
}

// Qwen2-MoE's q/k/v projections carry a bias unless qkv_bias is false (transformers 5).
void qkv_bias(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v != json(true)) refuse(r, v, cfg, "not supported yet: Qwen2-MoE without q/k/v biases (only true)");
  out.emplace_back(r.flag, "");
}

// transformers 5 lists each layer's attention kind; only full attention is supported.
void layer_types(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v.is_null()) return;
  if (!v.is_array()) refuse(r, v, cfg, "expected a list");
  for (const json& t : v)
    if (t != json("full_attention"))
      refuse(r, v, cfg, "not supported yet: layer type " + t.dump() + " (only \"full_attention\")");
}

// transformers 5 writes {"rope_type": "default", "rope_theta": ...} as rope_parameters; older files rope_theta.
void rope_theta(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_null()) {
    if (!cfg.contains("rope_parameters") || cfg["rope_parameters"].is_null())
      MOECORE_FAIL("config.json lacks 'rope_theta' (or 'rope_parameters'), required for model_type ", model_of(cfg));
    return;
  }
  to_number(r, v, cfg, out);
}

void rope_parameters(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_null()) return;
  if (!v.is_object()) refuse(r, v, cfg, "expected an object");
  for (const auto& [k, x] : v.items()) {
    if (k == "rope_type") {
      if (x != json("default"))
        refuse(r, v, cfg, "not supported yet: rope_type " + x.dump() + " (only \"default\", plain RoPE)");
    } else if (k != "rope_theta") {
      refuse(r, v, cfg, "not supported yet: key '" + k + "' (only rope_type \"default\" and rope_theta)");
    }
  }
  if (!v.contains("rope_theta")) refuse(r, v, cfg, "it has no rope_theta");
  if (cfg.contains("rope_theta") && !cfg["rope_theta"].is_null() && cfg["rope_theta"] != v["rope_theta"])
    refuse(r, v, cfg, "its rope_theta differs from the top-level rope_theta " + cfg["rope_theta"].dump());
  if (!cfg.contains("rope_theta") || cfg["rope_theta"].is_null()) to_number(r, v["rope_theta"], cfg, out);
}

void shared_expert(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v == json(0)) return;
  to_int(r, v, cfg, out);
  out.emplace_back("--moe-shared-expert-gate", "");  // Qwen2-MoE: sigmoid(Linear(H, 1)) * shared_expert(x)
}

// The one table. Flags that no key carries (RMSNorm, RoPE, no linear biases, ...) are in kFixed below.
constexpr Row kRows[] = {
    {"model_type", kAll, "", ignore, nullptr},
    {"num_hidden_layers", kAll, "--num-layers", to_int, nullptr},
    {"hidden_size", kAll, "--hidden-size", to_int, nullptr},
    {"num_attention_heads", kAll, "--num-attention-heads", to_int, nullptr},
    {"num_key_value_heads", kAll, "--num-query-groups", kv_heads, nullptr},
    {"head_dim", kMixtral | kQwen3, "--kv-channels", optional_int, "null"},
    {"intermediate_size", kAll, "--ffn-hidden-size", to_int, nullptr},
    {"moe_intermediate_size", kQwen, "--moe-ffn-hidden-size", to_int, nullptr},
    {"shared_expert_intermediate_size", kQwen2, "--moe-shared-expert-intermediate-size", shared_expert, nullptr},
    {"num_local_experts", kMixtral, "--num-experts", to_int, nullptr},
    {"qkv_bias", kQwen2, "--add-qkv-bias", qkv_bias, "true"},
    {"layer_types", kQwen, "sliding-window attention", layer_types, "null"},
    {"num_experts", kQwen, "--num-experts", num_experts, "null"},
    {"num_local_experts", kQwen3, "--num-experts", num_experts, "null"},  // transformers 5's alias for num_experts
    {"num_experts_per_tok", kAll, "--moe-router-topk", to_int, nullptr},
    {"norm_topk_prob", kQwen, "--moe-router-pre-softmax", norm_topk_prob, "false"},
    {"decoder_sparse_step", kQwen, "--moe-layer-freq", moe_layer_freq, "1"},
    {"mlp_only_layers", kQwen, "(read with decoder_sparse_step)", ignore, "[]"},
    {"router_aux_loss_coef", kAll, "--moe-aux-loss-coeff", to_number, "0.001"},
    {"router_jitter_noise", kMixtral, "router jitter on the experts' input", must_be_zero, "0"},
    {"hidden_act", kAll, "--swiglu", hidden_act, "\"silu\""},
    {"rms_norm_eps", kAll, "--norm-epsilon", to_number, nullptr},
    {"rope_theta", kAll, "--rotary-base", rope_theta, "null"},
    {"rope_parameters", kAll, "--rotary-base", rope_parameters, "null"},
    {"rope_scaling", kAll, "RoPE scaling (--rope-type yarn, ...)", must_be_null, "null"},
    {"max_position_embeddings", kAll, "--max-position-embeddings", to_int, nullptr},
    {"use_sliding_window", kQwen, "sliding-window attention", must_be_false, "false"},
    {"sliding_window", kAll, "sliding-window attention", sliding_window, "null"},
    {"max_window_layers", kQwen, "(sliding-window layers; read only with use_sliding_window)", ignore, "null"},
    {"attention_bias", kQwen3, "q/k/v/o projection biases", must_be_false, "false"},
    {"vocab_size", kAll, "--vocab-size", to_int, nullptr},
    {"tie_word_embeddings", kAll, "--untie-embeddings-and-output-weights", switch_if_false, "false"},
    {"attention_dropout", kAll, "--attention-dropout", to_number, "0.0"},
    {"initializer_range", kAll, "--init-method-std", to_number, "0.02"},
    // Harmless: token ids (the tokenizer's business), inference and bookkeeping keys.
    {"output_router_logits", kAll, "(HF adds the aux loss only with it; see router_aux_loss_coef)", ignore, "false"},
    {"bos_token_id", kAll, "", ignore, "null"},
    {"eos_token_id", kAll, "", ignore, "null"},
    {"pad_token_id", kAll, "", ignore, "null"},
    {"torch_dtype", kAll, "", ignore, "null"},
    {"dtype", kAll, "", ignore, "null"},
    {"use_cache", kAll, "", ignore, "true"},
    {"transformers_version", kAll, "", ignore, "null"},
    {"architectures", kAll, "", ignore, "null"},
    {"_name_or_path", kAll, "", ignore, "null"},
};

struct Fixed {
  unsigned models;
  const char* flag;
  const char* value;
};

constexpr Fixed kFixed[] = {
    {kAll, "--normalization", "RMSNorm"},
    {kAll, "--position-embedding-type", "rope"},
    {kAll, "--disable-bias-linear", ""},
    {kAll, "--hidden-dropout", "0"},  // no residual/embedding dropout in these models
    {kAll, "--moe-router-load-balancing-type", "aux_loss"},
    {kQwen3, "--qk-layernorm", ""},  // RMSNorm over each q and k head before RoPE
};

unsigned model_bit(const json& cfg) {
  if (!cfg.is_object()) MOECORE_FAIL("config.json: the top level must be an object");
  if (!cfg.contains("model_type") || !cfg["model_type"].is_string())
    MOECORE_FAIL("config.json has no string 'model_type' (supported: mixtral, qwen2_moe, qwen3_moe)");
  const std::string m = model_of(cfg);
  for (unsigned i = 0; i < 3; ++i)
    if (m == kModelNames[i]) return 1u << i;
  if (m.rfind("deepseek", 0) == 0)
    MOECORE_FAIL("config.json model_type '", m,
                 "' is not supported yet: multi-latent attention (MLA) is not supported yet (supported: mixtral, "
                 "qwen2_moe, qwen3_moe)");
  MOECORE_FAIL("config.json model_type '", m, "' is not supported (supported: mixtral, qwen2_moe, qwen3_moe)");
}

}  // namespace

Flags hf_config_flags(const json& cfg) {
  const unsigned bit = model_bit(cfg);
  const std::string m = model_of(cfg);
  for (const auto& [key, v] : cfg.items()) {
    const bool known =
        std::any_of(std::begin(kRows), std::end(kRows), [&](const Row& r) { return (r.models & bit) && key == r.key; });
    if (!known) MOECORE_FAIL("unknown config.json key '", key, "' for model_type ", m, " (value ", v.dump(), ")");
  }
  Flags out;
  for (const Fixed& f : kFixed)
    if (f.models & bit) out.emplace_back(f.flag, f.value);
  for (const Row& r : kRows) {
    if (!(r.models & bit)) continue;
    if (cfg.contains(r.key)) {
      r.convert(r, cfg[r.key], cfg, out);
    } else {
      if (!r.def) MOECORE_FAIL("config.json lacks '", r.key, "' (required for model_type ", m, ")");
      r.convert(r, json::parse(r.def), cfg, out);
    }
  }
  return out;
}

std::string hf_config_path(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  if (fs::is_directory(p)) {
    p /= "config.json";
    if (!fs::is_regular_file(p)) MOECORE_FAIL("--hf-config ", path, ": the directory holds no config.json");
  } else if (!fs::is_regular_file(p)) {
    MOECORE_FAIL("--hf-config ", path, ": no such file or directory");
  }
  return p.string();
}

json hf_config_parse(const std::string& text, const std::string& where) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    MOECORE_FAIL(where, ": not valid JSON: ", e.what());
  }
}

json hf_config_load(const std::string& path) {
  const std::string p = hf_config_path(path);
  std::ifstream f(p);
  if (!f) MOECORE_FAIL("--hf-config ", p, ": cannot open");
  return hf_config_parse(std::string(std::istreambuf_iterator<char>(f), {}), "--hf-config " + p);
}

void add_hf_config_flag(Args& a) {
  a.option("--hf-config", "",
           "a Hugging Face config.json (or a model directory holding one) of model_type mixtral, qwen2_moe or "
           "qwen3_moe; its model flags fill those not given (moecore only)");
}

void hf_config_fill(Args& a, const json& cfg, const std::string& where) {
  Flags flags;
  try {
    flags = hf_config_flags(cfg);
  } catch (const Error& e) {
    MOECORE_FAIL(where, ": ", e.what());
  }
  for (const auto& [flag, value] : flags) a.fill_unset(flag, value, " in " + where);
}

void hf_config_apply(Args& a) {
  const std::string path = a.str("--hf-config");
  if (!path.empty()) hf_config_fill(a, hf_config_load(path), "--hf-config " + path);
}

model::ModelConfig hf_model_config(const json& config, const std::string& where,
                                   const std::vector<std::pair<std::string, std::string>>& flags) {
  Args a("hf");
  const model::ModelConfig defaults;
  add_model_flags(a, defaults);
  std::vector<std::string> words = {"hf"};
  for (const auto& [flag, value] : flags) {
    words.push_back(flag);
    if (!value.empty()) words.push_back(value);
  }
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  a.parse(static_cast<int>(argv.size()), argv.data());
  hf_config_fill(a, config, where);
  return model_config_from(a, /*tokenizer_vocab=*/0);
}

}  // namespace moecore::apps
