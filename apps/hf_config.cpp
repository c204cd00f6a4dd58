// The config.json -> Megatron flags table. Semantics are those of transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and
// DeepSeek-V3 configuration and modeling files (and DeepSeek's own configuration_deepseek.py keys). A key absent from
// config.json takes the transformers class default written in its row, or is required when the row has none (size keys:
// a guessed size would be a different model).
#include "apps/hf_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "apps/model_flags.h"
#include "moecore/core/error.h"
#include "moecore/io/input_file.h"
#include "moecore/io/json.h"
#include "moecore/model/config_record.h"
#include "moecore/model/param_specs.h"

namespace moecore::apps {
namespace {

using json = nlohmann::json;
using Flags = std::vector<std::pair<std::string, std::string>>;

enum Model : unsigned {
  kMixtral = 1,
  kQwen2 = 2,
  kQwen3 = 4,
  kDeepSeek = 8,     // deepseek_v3
  kDeepSeekV2 = 16,  // deepseek_v2
  kGlm = 32,         // glm4_moe
  kOlmoe = 64,       // olmoe
  kGptOss = 128,     // gpt_oss
  kQwen = kQwen2 | kQwen3,
  kAll = kMixtral | kQwen,                // the three GQA families with a softmax router
  kGqa = kAll | kGlm | kOlmoe | kGptOss,  // standard attention
  kMla = kDeepSeek | kDeepSeekV2,
  kDeepSeekMoe = kMla | kGlm,  // DeepSeek's MoE keys (n_routed_experts, n_shared_experts, first_k_dense_replace, ...)
  kAny = kGqa | kMla,
};
// In HfFamily order (bit i is family i).
constexpr const char* kModelNames[] = {"mixtral",     "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                       "deepseek_v2", "glm4_moe",  "olmoe",     "gpt_oss"};
constexpr unsigned kModelCount = sizeof(kModelNames) / sizeof(kModelNames[0]);

struct Row;
using Convert = void (*)(const Row& row, const json& v, const json& cfg, Flags& out);
// The key's value for a model (export of a model that has no recorded config.json); a discarded value: omitted.
using Emit = json (*)(const model::ModelConfig& c, unsigned model);

// One config.json key for the model types in `models`: `flag` is the Megatron flag it maps to (or what the
// conversion emits), `def` the transformers default as JSON text (nullptr: required), `emit` the value written for
// a model (nullptr: the key is not written).
struct Row {
  const char* key;
  unsigned models;
  const char* flag;
  Convert convert;
  const char* def;
  Emit emit = nullptr;
};

const json kOmit = json(json::value_t::discarded);

std::string model_of(const json& cfg) {
  const json m = cfg.value("model_type", json());
  return m.is_string() ? m.get<std::string>() : std::string();
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

// The largest value accepted for a size key: far above any released model, low enough that a hostile file cannot
// ask for a 2^62-wide tensor or a 10^12-entry layer list before the model's own checks run.
int64_t size_limit(const char* key) {
  static const std::pair<const char*, int64_t> kLimits[] = {
      {"num_hidden_layers", 1 << 12},
      {"first_k_dense_replace", 1 << 12},
      {"decoder_sparse_step", 1 << 12},
      {"num_nextn_predict_layers", 1 << 6},
      {"hidden_size", 1 << 20},
      {"num_attention_heads", 1 << 16},
      {"num_key_value_heads", 1 << 16},
      {"head_dim", 1 << 16},
      {"qk_nope_head_dim", 1 << 16},
      {"qk_rope_head_dim", 1 << 16},
      {"v_head_dim", 1 << 16},
      {"num_local_experts", 1 << 20},
      {"num_experts", 1 << 20},
      {"n_routed_experts", 1 << 20},
      {"n_shared_experts", 1 << 10},
      {"num_experts_per_tok", 1 << 20},
      {"n_group", 1 << 20},
      {"topk_group", 1 << 20},
  };
  for (const auto& [k, limit] : kLimits)
    if (std::string_view(key) == k) return limit;
  return int64_t{1} << 30;  // ffn widths, vocabulary, LoRA ranks, positions
}

int64_t positive_int(const Row& r, const json& v, const json& cfg) {
  const int64_t limit = size_limit(r.key);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(limit)) ||
      v.get<int64_t>() <= 0 || v.get<int64_t>() > limit)
    refuse(r, v, cfg, "expected a positive integer of at most " + std::to_string(limit));
  return v.get<int64_t>();
}

void to_int(const Row& r, const json& v, const json& cfg, Flags& out) {
  out.emplace_back(r.flag, std::to_string(positive_int(r, v, cfg)));
}

// A finite number in [0, float max] (the model keeps these as float).
double nonnegative_number(const Row& r, const json& v, const json& cfg) {
  if (!v.is_number() || !(v.get<double>() >= 0) || !(v.get<double>() <= 3.4e38))
    refuse(r, v, cfg, "expected a finite non-negative number");
  return v.get<double>();
}

void to_number(const Row& r, const json& v, const json& cfg, Flags& out) {
  out.emplace_back(r.flag, number_text(nonnegative_number(r, v, cfg)));
}

// An integer key read by another row's conversion (its own row checks it): `def` when absent or not an integer.
int64_t int_key(const json& cfg, const char* key, int64_t def) {
  const json v = cfg.value(key, json(def));
  return v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX) ? v.get<int64_t>() : def;
}

// A boolean key read by another row's conversion: `def` when absent or null, an error naming it when not a boolean.
bool bool_key(const json& cfg, const char* key, bool def) {
  const json v = cfg.value(key, json());
  if (v.is_null()) return def;
  if (!v.is_boolean()) MOECORE_FAIL("config.json key '", key, "' = ", v.dump(), ": expected true or false");
  return v.get<bool>();
}

void ignore(const Row&, const json&, const json&, Flags&) {}

// torch_dtype / dtype (transformers 5): the dtype an export writes the weights in; null is transformers' None (not
// given). Checked on import, so a file that an export could not use is refused naming the key, not at the export.
constexpr const char* kHfDtypes[] = {"bfloat16", "float16", "float32"};
void weights_dtype(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v.is_null()) return;
  if (!v.is_string() || std::none_of(std::begin(kHfDtypes), std::end(kHfDtypes), [&](const char* d) { return v == d; }))
    refuse(r, v, cfg, "expected null or one of \"bfloat16\", \"float16\", \"float32\"");
}

// A boolean another row reads (its type is checked even when that row does not read it).
void boolean(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_boolean()) refuse(r, v, cfg, "expected true or false");
}

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
  if (model_of(cfg) == "mixtral" || bool_key(cfg, "use_sliding_window", false)) must_be_null(r, v, cfg, out);
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
  const int64_t layers = int_key(cfg, "num_hidden_layers", 0);
  if (layers <= 0 || layers > size_limit("num_hidden_layers"))
    MOECORE_FAIL("config.json key 'num_hidden_layers' = ", cfg.value("num_hidden_layers", json()).dump(),
                 ": expected a positive integer of at most ", size_limit("num_hidden_layers"));
  std::vector<int> moe(static_cast<size_t>(layers));
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

// ---- DeepSeek-V3 -------------------------------------------------------------------------------------------

constexpr const char kRopeHeadDim[] = "qk_rope_head_dim";
constexpr const char kExpertsPerTok[] = "num_experts_per_tok";

// A key transformers derives from another one: it must agree (or be null).
template <const char* Other>
void same_as_key(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_null() && v != cfg.value(Other, json()))
    refuse(r, v, cfg, std::string("must equal ") + Other + " (" + cfg.value(Other, json()).dump() + ")");
}

void mla_qk_head_dim(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v.is_null()) return;
  const int64_t nope = int_key(cfg, "qk_nope_head_dim", -1), rope = int_key(cfg, "qk_rope_head_dim", -1);
  int64_t sum = 0;
  if (!v.is_number_integer() || __builtin_add_overflow(nope, rope, &sum) || v.get<int64_t>() != sum)
    refuse(r, v, cfg, "must equal qk_nope_head_dim + qk_rope_head_dim");
}

void mla_kv_heads(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_null() && v != cfg.value("num_attention_heads", json()))
    refuse(r, v, cfg, "MLA gives every query head its own key and value: must equal num_attention_heads");
}

void must_be_one(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v != json(1)) refuse(r, v, cfg, std::string("not supported yet: ") + r.flag + " (only 1)");
}

void optional_positive_int(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_null() || v == json(0)) return;
  to_int(r, v, cfg, out);
}

// n_shared_experts shared experts of moe_intermediate_size each are one MLP of their summed width (transformers'
// DeepseekV3MLP(intermediate_size = moe_intermediate_size * n_shared_experts)), ungated.
void deepseek_shared(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_null() || v == json(0)) return;
  const int64_t n = positive_int(r, v, cfg), f = int_key(cfg, "moe_intermediate_size", 0);
  int64_t width = 0;
  if (f <= 0 || __builtin_mul_overflow(n, f, &width) || width > size_limit("moe_intermediate_size"))
    refuse(r, v, cfg,
           "times moe_intermediate_size (" + std::to_string(f) + ") is not a positive width of at most " +
               std::to_string(size_limit("moe_intermediate_size")));
  out.emplace_back(r.flag, std::to_string(width));
}

// Layers [0, first_k_dense_replace) are dense, the rest MoE.
void deepseek_layer_freq(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0) refuse(r, v, cfg, "expected a non-negative integer");
  const int64_t k = v.get<int64_t>(), layers = int_key(cfg, "num_hidden_layers", 0);
  if (k >= layers) refuse(r, v, cfg, "leaves no MoE layer (num_hidden_layers " + std::to_string(layers) + ")");
  if (k > 0) out.emplace_back(r.flag, "[0]*" + std::to_string(k) + "+[1]*" + std::to_string(layers - k));
}

void scoring_func(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v != json("sigmoid")) refuse(r, v, cfg, "not supported yet: only \"sigmoid\" (DeepSeek-V3's router)");
  out.emplace_back("--moe-router-score-function", "sigmoid");
}

void topk_method(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v != json("noaux_tc"))
    refuse(r, v, cfg, "not supported yet: only \"noaux_tc\" (group-limited routing with e_score_correction_bias)");
  out.emplace_back(r.flag, "");
}

// transformers scores each group by the sum of its top-2 biased scores; Megatron by its top-(k / group_topk). The
// import follows transformers (--moe-router-group-score-topk 2): the same routing as Megatron's when k / topk_group
// is 2 (DeepSeek-V3: 8 / 4), and the checkpoint's own routing otherwise.
void deepseek_groups(const Row& r, const json& v, const json& cfg, Flags& out) {
  const int64_t groups = positive_int(r, v, cfg);
  if (groups == 1) return;
  const int64_t topk_group = int_key(cfg, "topk_group", 0);
  if (topk_group <= 0 || topk_group > groups)
    MOECORE_FAIL("config.json key 'topk_group' = ", cfg.value("topk_group", json()).dump(),
                 " must be in [1, n_group = ", groups, "]");
  out.emplace_back(r.flag, std::to_string(groups));
  out.emplace_back("--moe-router-group-topk", std::to_string(topk_group));
  out.emplace_back("--moe-router-group-score-topk", "2");
}

void deepseek_norm_topk(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v == json(false) && int_key(cfg, "num_experts_per_tok", 0) > 1)
    refuse(r, v, cfg, "not supported: Megatron always renormalises sigmoid top-k weights (k > 1)");
}

// DeepSeek's own config: a sequence-wise (seq_aux, default) or batch-wise aux loss of weight aux_loss_alpha.
void deepseek_aux_loss(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_null()) {
    out.emplace_back("--moe-router-load-balancing-type", "none");
    return;
  }
  to_number(r, v, cfg, out);
  out.emplace_back("--moe-router-load-balancing-type", bool_key(cfg, "seq_aux", true) ? "seq_aux_loss" : "aux_loss");
}

void fp8_quantization(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v.is_null()) return;
  if (!v.is_object() || v.value("quant_method", json()) != json("fp8") ||
      v.value("fmt", json("e4m3")) != json("e4m3") ||
      v.value("weight_block_size", json::array({128, 128})) != json::array({128, 128}))
    refuse(r, v, cfg, "not supported: only fp8 e4m3 with 128x128 weight blocks (dequantised on import)");
}

// Plain RoPE, or YaRN (rope_scaling in the hub's files, rope_parameters in transformers 5).
void deepseek_rope(const Row& r, const json& v, const json& cfg, Flags& out) {
  const bool params = std::string(r.key) == "rope_parameters";
  if (v.is_null()) {
    if (params && !cfg.contains("rope_theta"))
      MOECORE_FAIL("config.json lacks 'rope_theta' (or 'rope_parameters'), required for model_type ", model_of(cfg));
    if (!params && (!cfg.contains("rope_parameters") || cfg["rope_parameters"].is_null()))
      out.emplace_back("--rope-type", "rope");
    return;
  }
  if (!v.is_object()) refuse(r, v, cfg, "expected an object");
  if (params && cfg.contains("rope_scaling") && !cfg["rope_scaling"].is_null())
    refuse(r, v, cfg, "give rope_parameters or rope_scaling, not both");
  const json type_v = v.value("rope_type", v.value("type", json("default")));
  if (!type_v.is_string()) refuse(r, v, cfg, "its rope_type (or type) " + type_v.dump() + " is not a string");
  const std::string type = type_v.get<std::string>();
  // A finite positive (or non-negative) number key of the object (the model keeps these as float).
  auto positive = [&](const char* k, bool zero_ok = false) {
    const json& x = v[k];
    if (!x.is_number() || !(x.get<double>() > 0 || (zero_ok && x.get<double>() == 0)) || !(x.get<double>() <= 3.4e38))
      refuse(
          r, v, cfg,
          std::string(k) + " must be a finite " + (zero_ok ? "non-negative" : "positive") + " number, not " + x.dump());
    return x.get<double>();
  };
  if (v.contains("rope_theta")) {
    if (cfg.contains("rope_theta") && cfg["rope_theta"] != v["rope_theta"])
      refuse(r, v, cfg, "its rope_theta differs from the top-level rope_theta " + cfg["rope_theta"].dump());
    if (!cfg.contains("rope_theta")) out.emplace_back("--rotary-base", number_text(positive("rope_theta")));
  }
  if (type == "default") {
    for (const auto& [k, x] : v.items())
      if (k != "rope_type" && k != "type" && k != "rope_theta")
        refuse(r, v, cfg, "not supported yet: key '" + k + "' with plain RoPE");
    out.emplace_back("--rope-type", "rope");
    return;
  }
  if (type != "yarn") refuse(r, v, cfg, "not supported yet: rope type \"" + type + "\" (only default and yarn)");
  static const char* const known[] = {
      "rope_type", "type",      "rope_theta", "factor",         "original_max_position_embeddings",
      "beta_fast", "beta_slow", "mscale",     "mscale_all_dim", "truncate"};
  for (const auto& item : v.items()) {
    const std::string& k = item.key();  // not a structured binding: clang 14 cannot capture those
    if (std::none_of(std::begin(known), std::end(known), [&](const char* n) { return k == n; }))
      refuse(r, v, cfg, "not supported yet: YaRN key '" + k + "'");
  }
  if (!v.contains("factor") || !v.contains("original_max_position_embeddings"))
    refuse(r, v, cfg, "YaRN needs factor and original_max_position_embeddings");
  // transformers scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are given
  // (else by mscale(factor, 1)), Megatron always: a lone one would be read differently.
  const bool ms = v.contains("mscale"), msa = v.contains("mscale_all_dim");
  if (ms != msa) refuse(r, v, cfg, "give both mscale and mscale_all_dim, or neither");
  const json& omax = v["original_max_position_embeddings"];
  if (!omax.is_number_integer() || omax.get<int64_t>() <= 0 ||
      omax.get<int64_t>() > size_limit("original_max_position_embeddings"))
    refuse(r, v, cfg,
           "original_max_position_embeddings must be a positive integer of at most " +
               std::to_string(size_limit("original_max_position_embeddings")));
  out.emplace_back("--rope-type", "yarn");
  out.emplace_back("--rotary-scaling-factor", number_text(positive("factor")));
  out.emplace_back("--yarn-original-max-position-embeddings", std::to_string(omax.get<int64_t>()));
  out.emplace_back("--yarn-beta-fast", number_text(v.contains("beta_fast") ? positive("beta_fast") : 32.0));
  out.emplace_back("--yarn-beta-slow", number_text(v.contains("beta_slow") ? positive("beta_slow") : 1.0));
  if (ms) {
    out.emplace_back("--mscale", number_text(positive("mscale", true)));
    out.emplace_back("--mscale-all-dim", number_text(positive("mscale_all_dim", true)));
  }
  if (v.contains("truncate") && !v["truncate"].is_boolean())
    refuse(r, v, cfg, "truncate must be true or false, not " + v["truncate"].dump());
  if (v.contains("truncate") && v["truncate"] == json(false))
    out.emplace_back("--no-yarn-correction-range-round-to-int", "");
}

// ---- DeepSeek-V2 ---------------------------------------------------------------------------------------------

void v2_scoring_func(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v != json("softmax"))
    refuse(r, v, cfg, "not supported: DeepSeek-V2's router scores by softmax (only \"softmax\")");
}

// transformers' DeepseekV2TopkRouter: softmax over all experts, then greedy top-k, or group_limited_greedy: keep the
// topk_group groups (of n_group) whose best expert scores highest, top-k among their experts (the group score is the
// group max: --moe-router-group-score-topk 1, where Megatron's default would sum the top k / topk_group).
void v2_topk_method(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v == json("greedy")) return;
  if (v != json("group_limited_greedy"))
    refuse(r, v, cfg, "not supported: only \"greedy\" and \"group_limited_greedy\" (DeepSeek-V2's routers)");
  const json g = cfg.value("n_group", json()), tg = cfg.value("topk_group", json());
  if (!g.is_number_integer() || g.get<int64_t>() <= 0)
    MOECORE_FAIL("config.json key 'n_group' = ", g.dump(), ": group_limited_greedy needs a positive integer");
  const int64_t groups = g.get<int64_t>(), experts = int_key(cfg, "n_routed_experts", 0);
  if (!tg.is_number_integer() || tg.get<int64_t>() <= 0 || tg.get<int64_t>() > groups)
    MOECORE_FAIL("config.json key 'topk_group' = ", tg.dump(), " must be in [1, n_group = ", groups, "]");
  if (experts > 0 && experts % groups != 0)
    MOECORE_FAIL("config.json: n_routed_experts (", experts, ") must be divisible by n_group (", groups, ")");
  if (groups == 1) return;
  out.emplace_back("--moe-router-num-groups", std::to_string(groups));
  out.emplace_back("--moe-router-group-topk", std::to_string(tg.get<int64_t>()));
  out.emplace_back("--moe-router-group-score-topk", "1");
}

// Read with topk_method (ignored by greedy routing).
void null_or_positive_int(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_null() && (!v.is_number_integer() || v.get<int64_t>() <= 0))
    refuse(r, v, cfg, "expected a positive integer or null");
}

// transformers' DeepSeek-V2 never renormalises the top-k softmax weights (--moe-router-pre-softmax); DeepSeek's own
// code does with norm_topk_prob true, so that value would be read two ways.
void v2_norm_topk(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v == json(true))
    refuse(r, v, cfg,
           "not supported: transformers' deepseek_v2 ignores it (no renormalisation) while DeepSeek's own code "
           "renormalises; only false");
  if (!v.is_null() && v != json(false)) refuse(r, v, cfg, "expected true or false");
}

// ---- GLM-4.5 ---------------------------------------------------------------------------------------------------

// transformers 5 writes RoPE as rope_parameters {rope_type "default", rope_theta, partial_rotary_factor}; older files
// rope_theta and partial_rotary_factor at the top level. The part of each head that rotates: --rotary-percent
// (transformers' default 0.5 for glm4_moe).
double partial_rotary_factor(const json& cfg) {
  const json top = cfg.value("partial_rotary_factor", json());
  const json inner = cfg.value("rope_parameters", json()).is_object()
                         ? cfg["rope_parameters"].value("partial_rotary_factor", json())
                         : json();
  if (!top.is_null() && !inner.is_null() && top != inner)
    MOECORE_FAIL("config.json key 'partial_rotary_factor' = ", top.dump(), " differs from rope_parameters' ",
                 inner.dump());
  const json v = top.is_null() ? inner : top;
  if (v.is_null()) return 0.5;
  if (!v.is_number() || !(v.get<double>() > 0 && v.get<double>() <= 1))
    MOECORE_FAIL("config.json key 'partial_rotary_factor' = ", v.dump(), ": expected a number in (0, 1]");
  return v.get<double>();
}

void glm_rotary(const Row& r, const json&, const json& cfg, Flags& out) {
  const double f = partial_rotary_factor(cfg);
  const int64_t d = int_key(cfg, "head_dim", 0) > 0
                        ? int_key(cfg, "head_dim", 0)
                        : int_key(cfg, "hidden_size", 0) / std::max<int64_t>(1, int_key(cfg, "num_attention_heads", 1));
  // transformers rotates int(head_dim * factor) channels (an even number): the factor must give whole pairs.
  const double rotated = static_cast<double>(d) * f;
  if (d > 0 && (rotated != static_cast<double>(static_cast<int64_t>(rotated)) || static_cast<int64_t>(rotated) % 2))
    MOECORE_FAIL("config.json: partial_rotary_factor ", number_text(f), " of head_dim ", d,
                 " is not an even number of channels");
  if (f != 1.0) out.emplace_back(r.flag, number_text(f));
}

void glm_rope_parameters(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (v.is_object() && v.contains("partial_rotary_factor")) {
    json plain = v;
    plain.erase("partial_rotary_factor");
    return rope_parameters(r, plain, cfg, out);
  }
  rope_parameters(r, v, cfg, out);
}

void switch_if_true(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (!v.is_boolean()) refuse(r, v, cfg, "expected true or false");
  if (v == json(true)) out.emplace_back(r.flag, "");
}

// ---- GPT-OSS -------------------------------------------------------------------------------------------------

// transformers' GptOssExperts: gate clamped at swiglu_limit, up at +-swiglu_limit, (up + 1) * gate sigmoid(1.702 gate).
void gpt_oss_alpha(const Row& r, const json& v, const json& cfg, Flags&) {
  if (!v.is_number() || static_cast<float>(v.get<double>()) != ops::kQuickGeluAlpha)
    refuse(r, v, cfg, "not supported: only 1.702 (Megatron's quick-GELU, --quick-geglu)");
}

void gpt_oss_limit(const Row& r, const json& v, const json& cfg, Flags& out) {
  if (!v.is_number() || !(v.get<double>() > 0) || !(v.get<double>() <= 3.4e38))
    refuse(r, v, cfg, "expected a finite positive number");
  out.emplace_back(r.flag, number_text(v.get<double>()));
}

// GPT-OSS's MLP is its own GLU (the --quick-geglu flags), whatever hidden_act says; transformers writes "silu".
void gpt_oss_act(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v != json("silu")) refuse(r, v, cfg, "not supported: only \"silu\" (GPT-OSS's MLP is its clamped GLU)");
}

// Sliding-window layers: transformers lets a query see the keys of the last sliding_window positions (itself
// included), Megatron's --window-size (left, 0) left + 1 of them; layer_types names the windowed layers (transformers'
// default alternates, sliding first), which --window-attn-skip-freq lists (1 = windowed).
void gpt_oss_window(const Row& r, const json& v, const json& cfg, Flags& out) {
  const int64_t layers = int_key(cfg, "num_hidden_layers", 0);
  json types = cfg.value("layer_types", json());
  if (types.is_null()) {
    types = json::array();
    for (int64_t i = 0; i < layers; ++i) types.push_back((i + 1) % 2 ? "sliding_attention" : "full_attention");
  }
  if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
    MOECORE_FAIL("config.json key 'layer_types' = ", types.dump().substr(0, 200), ": expected one entry per layer (",
                 layers, ")");
  std::vector<int> windowed;
  for (const json& t : types) {
    if (t != json("sliding_attention") && t != json("full_attention"))
      MOECORE_FAIL("config.json key 'layer_types': entry ", t.dump(),
                   " is not \"sliding_attention\" or \"full_attention\"");
    windowed.push_back(t == json("sliding_attention"));
  }
  if (std::none_of(windowed.begin(), windowed.end(), [](int w) { return w; })) return;
  const int64_t w = positive_int(r, v, cfg);
  out.emplace_back(r.flag, "(" + std::to_string(w - 1) + ",0)");
  if (std::all_of(windowed.begin(), windowed.end(), [](int x) { return x; })) return;
  std::string expr;
  for (size_t i = 0; i < windowed.size();) {
    size_t j = i;
    while (j < windowed.size() && windowed[j] == windowed[i]) ++j;
    expr += (expr.empty() ? "[" : "+[") + std::to_string(windowed[i]) + "]*" + std::to_string(j - i);
    i = j;
  }
  out.emplace_back("--window-attn-skip-freq", expr);
}

// RoPE or YaRN on standard attention: DeepSeek's reader, spelt as Megatron's GPT (--position-embedding-type yarn).
void gpt_oss_rope(const Row& r, const json& v, const json& cfg, Flags& out) {
  Flags f;
  deepseek_rope(r, v, cfg, f);
  for (auto& [flag, value] : f)
    if (flag == "--rope-type")
      out.emplace_back("--position-embedding-type", value);
    else
      out.emplace_back(flag, value);
}

void must_be_true(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v != json(true)) refuse(r, v, cfg, std::string("not supported: ") + r.flag + " (only true)");
}

void mxfp4_quantization(const Row& r, const json& v, const json& cfg, Flags&) {
  if (v.is_null()) return;
  if (!v.is_object() || v.value("quant_method", json()) != json("mxfp4"))
    refuse(r, v, cfg, "not supported: only mxfp4 (the experts' weights, dequantised on import)");
}

// ---- Emitters (model -> config.json) ---------------------------------------------------------------------------

template <int64_t model::ModelConfig::*F>
json emit_int(const model::ModelConfig& c, unsigned) {
  return c.*F;
}
template <float model::ModelConfig::*F>
json emit_float(const model::ModelConfig& c, unsigned) {
  return static_cast<double>(c.*F);
}

json emit_model_type(const model::ModelConfig&, unsigned m) {
  return kModelNames[__builtin_ctz(m)];
}
json emit_architectures(const model::ModelConfig&, unsigned m) {
  static const char* const names[] = {"MixtralForCausalLM",    "Qwen2MoeForCausalLM",   "Qwen3MoeForCausalLM",
                                      "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Glm4MoeForCausalLM",
                                      "OlmoeForCausalLM",      "GptOssForCausalLM"};
  static_assert(sizeof(names) / sizeof(names[0]) == kModelCount);
  return json::array({names[__builtin_ctz(m)]});
}
json emit_kv_heads(const model::ModelConfig& c, unsigned) {
  return c.multi_latent_attention ? c.num_attention_heads : c.query_groups();
}
json emit_head_dim(const model::ModelConfig& c, unsigned) {
  return c.head_dim();
}
json emit_ffn(const model::ModelConfig& c, unsigned) {
  return c.ffn();
}
json emit_moe_ffn(const model::ModelConfig& c, unsigned) {
  return c.moe_ffn();
}
json emit_experts(const model::ModelConfig& c, unsigned) {
  return c.moe.num_experts;
}
json emit_topk(const model::ModelConfig& c, unsigned) {
  return c.moe.router_topk;
}
json emit_shared(const model::ModelConfig& c, unsigned) {
  return c.moe.shared_expert_intermediate_size;
}
json emit_true(const model::ModelConfig&, unsigned) {
  return true;
}
json emit_false(const model::ModelConfig&, unsigned) {
  return false;
}
json emit_silu(const model::ModelConfig&, unsigned) {
  return "silu";
}
json emit_norm_topk(const model::ModelConfig& c, unsigned) {
  return !c.moe.pre_softmax;
}
// Qwen: every layer MoE (step 1), minus mlp_only_layers.
json emit_sparse_step(const model::ModelConfig&, unsigned) {
  return 1;
}
json emit_mlp_only(const model::ModelConfig& c, unsigned) {
  json out = json::array();
  const std::vector<bool> moe = c.moe_layers();
  for (size_t i = 0; i < moe.size(); ++i)
    if (!moe[i]) out.push_back(i);
  return out;
}
json emit_aux_coeff(const model::ModelConfig& c, unsigned) {
  return c.moe.aux_loss_coeff.empty() ? 0.0 : static_cast<double>(c.moe.aux_loss_coeff[0]);
}
json emit_rope_theta(const model::ModelConfig& c, unsigned) {
  return static_cast<double>(c.rotary_base);
}
json emit_tied(const model::ModelConfig& c, unsigned) {
  return !c.untie_embeddings_and_output_weights;
}
json emit_max_positions(const model::ModelConfig& c, unsigned) {
  return c.max_positions();
}
json emit_dtype(const model::ModelConfig& c, unsigned) {
  return c.compute_dtype == DType::bf16 ? "bfloat16" : c.compute_dtype == DType::f16 ? "float16" : "float32";
}
json emit_q_lora(const model::ModelConfig& c, unsigned) {
  return c.q_lora_rank ? json(c.q_lora_rank) : json();
}
json emit_deepseek_shared(const model::ModelConfig& c, unsigned) {
  const int64_t Fs = c.moe.shared_expert_intermediate_size, F = c.moe_ffn();
  if (Fs % F != 0)
    MOECORE_FAIL("config.json for deepseek_v3: the shared expert size (", Fs,
                 ") must be a multiple of --moe-ffn-hidden-size (", F, ") (n_shared_experts)");
  return Fs / F;
}
json emit_first_dense(const model::ModelConfig& c, unsigned) {
  const std::vector<bool> moe = c.moe_layers();
  size_t k = 0;
  while (k < moe.size() && !moe[k]) ++k;
  for (size_t i = k; i < moe.size(); ++i)
    if (!moe[i])
      MOECORE_FAIL("config.json for deepseek_v3: dense layers must come first (first_k_dense_replace); layer ", i,
                   " is dense after an MoE layer");
  return k;
}
json emit_scaling(const model::ModelConfig& c, unsigned) {
  return c.moe.topk_scaling_factor > 0 ? static_cast<double>(c.moe.topk_scaling_factor) : 1.0;
}
json emit_groups(const model::ModelConfig& c, unsigned) {
  return c.moe.num_groups ? c.moe.num_groups : 1;
}
json emit_group_topk(const model::ModelConfig& c, unsigned) {
  return c.moe.group_topk ? c.moe.group_topk : 1;
}
json emit_mtp(const model::ModelConfig& c, unsigned) {
  return c.mtp_num_layers;
}
json emit_deepseek_rope(const model::ModelConfig& c, unsigned) {
  if (!c.yarn) return kOmit;  // rope_theta carries plain RoPE
  const model::YarnConfig& y = c.yarn_config;
  json r = {{"type", "yarn"},
            {"factor", static_cast<double>(y.scaling_factor)},
            {"original_max_position_embeddings", y.original_max_position_embeddings},
            {"beta_fast", static_cast<double>(y.beta_fast)},
            {"beta_slow", static_cast<double>(y.beta_slow)},
            {"mscale", static_cast<double>(y.mscale)},
            {"mscale_all_dim", static_cast<double>(y.mscale_all_dim)}};
  if (!y.correction_range_round_to_int) r["truncate"] = false;
  return r;
}
json emit_deepseek_aux(const model::ModelConfig& c, unsigned) {
  if (c.moe.uses(moe::LoadBalancing::seq_aux_loss) || c.moe.uses(moe::LoadBalancing::aux_loss))
    return emit_aux_coeff(c, 0);
  return kOmit;
}
json emit_partial_rotary(const model::ModelConfig& c, unsigned) {
  return static_cast<double>(c.rotary_percent);
}
json emit_qkv_bias(const model::ModelConfig& c, unsigned) {
  return c.add_qkv_bias;
}
json emit_qk_norm(const model::ModelConfig& c, unsigned) {
  return c.qk_layernorm;
}
json emit_v2_topk_method(const model::ModelConfig& c, unsigned) {
  return c.moe.num_groups > 1 ? "group_limited_greedy" : "greedy";
}
json emit_v2_groups(const model::ModelConfig& c, unsigned) {
  return c.moe.num_groups > 1 ? json(c.moe.num_groups) : kOmit;
}
json emit_v2_group_topk(const model::ModelConfig& c, unsigned) {
  return c.moe.num_groups > 1 ? json(c.moe.group_topk) : kOmit;
}
json emit_clamp(const model::ModelConfig& c, unsigned) {
  return static_cast<double>(c.activation_func_clamp_value);
}
// transformers' sliding_window W: W keys; Megatron's (left, 0): left + 1.
json emit_window(const model::ModelConfig& c, unsigned) {
  return c.window_size >= 0 ? json(c.window_size + 1) : kOmit;
}
json emit_layer_types(const model::ModelConfig& c, unsigned) {
  json out = json::array();
  for (bool w : c.window_layers()) out.push_back(w ? "sliding_attention" : "full_attention");
  return out;
}
json emit_gpt_oss_rope(const model::ModelConfig& c, unsigned) {
  if (!c.yarn) return kOmit;
  json r = emit_deepseek_rope(c, 0);
  r.erase("mscale");  // Megatron's defaults (1, 0): transformers' default concentration
  r.erase("mscale_all_dim");
  return r;
}
json emit_seq_aux(const model::ModelConfig& c, unsigned) {
  return c.moe.uses(moe::LoadBalancing::seq_aux_loss) ? json(true) : kOmit;
}

// The one table. Flags that no key carries (RMSNorm, RoPE, no linear biases, ...) are in kFixed below.
constexpr Row kRows[] = {
    {"model_type", kAny, "", ignore, nullptr, emit_model_type},
    {"num_hidden_layers", kAny, "--num-layers", to_int, nullptr, emit_int<&model::ModelConfig::num_layers>},
    {"hidden_size", kAny, "--hidden-size", to_int, nullptr, emit_int<&model::ModelConfig::hidden_size>},
    {"num_attention_heads", kAny, "--num-attention-heads", to_int, nullptr,
     emit_int<&model::ModelConfig::num_attention_heads>},
    {"num_key_value_heads", kGqa, "--num-query-groups", kv_heads, nullptr, emit_kv_heads},
    {"head_dim", kMixtral | kQwen3 | kGlm, "--kv-channels", optional_int, "null", emit_head_dim},
    {"intermediate_size", kAny, "--ffn-hidden-size", to_int, nullptr, emit_ffn},
    {"moe_intermediate_size", kQwen, "--moe-ffn-hidden-size", to_int, nullptr, emit_moe_ffn},
    {"shared_expert_intermediate_size", kQwen2, "--moe-shared-expert-intermediate-size", shared_expert, nullptr,
     emit_shared},
    {"num_local_experts", kMixtral, "--num-experts", to_int, nullptr, emit_experts},
    {"qkv_bias", kQwen2, "--add-qkv-bias", qkv_bias, "true", emit_true},
    {"layer_types", kQwen, "sliding-window attention", layer_types, "null"},
    {"num_experts", kQwen, "--num-experts", num_experts, "null", emit_experts},
    {"num_local_experts", kQwen3, "--num-experts", num_experts, "null"},  // transformers 5's alias for num_experts
    {"num_experts_per_tok", kAny, "--moe-router-topk", to_int, nullptr, emit_topk},
    {"norm_topk_prob", kQwen, "--moe-router-pre-softmax", norm_topk_prob, "false", emit_norm_topk},
    {"decoder_sparse_step", kQwen, "--moe-layer-freq", moe_layer_freq, "1", emit_sparse_step},
    {"mlp_only_layers", kQwen, "(read with decoder_sparse_step)", ignore, "[]", emit_mlp_only},
    {"router_aux_loss_coef", kAll, "--moe-aux-loss-coeff", to_number, "0.001", emit_aux_coeff},
    // OLMoE (transformers' OlmoeConfig): every layer MoE, experts of intermediate_size, q_norm / k_norm over the whole
    // q and k projections.
    {"num_experts", kOlmoe, "--num-experts", to_int, nullptr, emit_experts},
    {"norm_topk_prob", kOlmoe, "--moe-router-pre-softmax", norm_topk_prob, "false", emit_norm_topk},
    {"router_aux_loss_coef", kOlmoe, "--moe-aux-loss-coeff", to_number, "0.01", emit_aux_coeff},
    {"clip_qkv", kOlmoe, "q/k/v clipping", must_be_null, "null"},
    {"attention_bias", kOlmoe, "q/k/v/o projection biases", must_be_false, "false"},
    {"router_jitter_noise", kMixtral, "router jitter on the experts' input", must_be_zero, "0"},
    {"hidden_act", kAny & ~kGptOss, "--swiglu", hidden_act, "\"silu\"", emit_silu},
    {"rms_norm_eps", kAny, "--norm-epsilon", to_number, nullptr, emit_float<&model::ModelConfig::norm_epsilon>},
    {"rope_theta", kAny, "--rotary-base", rope_theta, "null", emit_rope_theta},
    {"rope_parameters", kAll | kOlmoe, "--rotary-base", rope_parameters, "null"},
    {"rope_scaling", kGqa & ~kGptOss, "RoPE scaling (--rope-type yarn, ...)", must_be_null, "null"},
    // GLM-4.5 / 4.6 (transformers' Glm4MoeConfig): DeepSeek-V3's MoE on standard attention with partial RoPE.
    {"rope_parameters", kGlm, "--rotary-base", glm_rope_parameters, "null"},
    {"partial_rotary_factor", kGlm, "--rotary-percent", glm_rotary, "null", emit_partial_rotary},
    {"attention_bias", kGlm, "--add-qkv-bias", switch_if_true, "false", emit_qkv_bias},
    {"use_qk_norm", kGlm, "--qk-layernorm", switch_if_true, "false", emit_qk_norm},
    {"first_k_dense_replace", kGlm, "--moe-layer-freq", deepseek_layer_freq, "1", emit_first_dense},
    // DeepSeek-V3 (transformers' DeepseekV3Config and the hub's configuration_deepseek.py) and DeepSeek-V2.
    {"rope_parameters", kMla, "--rotary-base, --rope-type", deepseek_rope, "null"},
    {"rope_scaling", kMla, "--rope-type yarn", deepseek_rope, "null", emit_deepseek_rope},
    {"num_key_value_heads", kMla, "(MLA: one key per head)", mla_kv_heads, "null", emit_kv_heads},
    {"q_lora_rank", kMla, "--q-lora-rank", optional_int, "null", emit_q_lora},
    {"kv_lora_rank", kMla, "--kv-lora-rank", to_int, nullptr, emit_int<&model::ModelConfig::kv_lora_rank>},
    {"qk_nope_head_dim", kMla, "--qk-head-dim", to_int, nullptr, emit_int<&model::ModelConfig::qk_head_dim>},
    {"qk_rope_head_dim", kMla, "--qk-pos-emb-head-dim", to_int, nullptr,
     emit_int<&model::ModelConfig::qk_pos_emb_head_dim>},
    {"v_head_dim", kMla, "--v-head-dim", to_int, nullptr, emit_int<&model::ModelConfig::v_head_dim>},
    {"head_dim", kMla, "(transformers 5: qk_rope_head_dim)", same_as_key<kRopeHeadDim>, "null"},
    {"qk_head_dim", kMla, "(qk_nope_head_dim + qk_rope_head_dim)", mla_qk_head_dim, "null"},
    {"moe_intermediate_size", kDeepSeekMoe, "--moe-ffn-hidden-size", to_int, nullptr, emit_moe_ffn},
    {"n_routed_experts", kDeepSeekMoe, "--num-experts", to_int, nullptr, emit_experts},
    {"n_shared_experts", kDeepSeekMoe, "--moe-shared-expert-intermediate-size", deepseek_shared, "null",
     emit_deepseek_shared},
    {"first_k_dense_replace", kMla, "--moe-layer-freq", deepseek_layer_freq, "0", emit_first_dense},
    {"moe_layer_freq", kMla, "(every layer after first_k_dense_replace is MoE)", must_be_one, "1"},
    {"routed_scaling_factor", kDeepSeekMoe, "--moe-router-topk-scaling-factor", to_number, "1.0", emit_scaling},
    {"scoring_func", kDeepSeek, "--moe-router-score-function sigmoid", scoring_func, "\"sigmoid\""},
    {"topk_method", kDeepSeek, "--moe-router-enable-expert-bias", topk_method, "\"noaux_tc\""},
    {"n_group", kDeepSeek | kGlm, "--moe-router-num-groups", deepseek_groups, "1", emit_groups},
    {"topk_group", kDeepSeek | kGlm, "--moe-router-group-topk (read with n_group)", ignore, "1", emit_group_topk},
    {"norm_topk_prob", kDeepSeek | kGlm, "(Megatron renormalises sigmoid top-k weights)", deepseek_norm_topk, "true",
     emit_true},
    {"scoring_func", kDeepSeekV2, "(softmax router scores)", v2_scoring_func, "\"softmax\""},
    {"topk_method", kDeepSeekV2, "--moe-router-num-groups, --moe-router-group-topk", v2_topk_method, "\"greedy\"",
     emit_v2_topk_method},
    {"n_group", kDeepSeekV2, "(read with topk_method)", null_or_positive_int, "null", emit_v2_groups},
    {"topk_group", kDeepSeekV2, "(read with topk_method)", null_or_positive_int, "null", emit_v2_group_topk},
    {"norm_topk_prob", kDeepSeekV2, "--moe-router-pre-softmax (no renormalisation)", v2_norm_topk, "false", emit_false},
    {"mlp_bias", kDeepSeekV2, "MLP biases", must_be_false, "false"},
    {"aux_loss_alpha", kMla, "--moe-aux-loss-coeff", deepseek_aux_loss, "null", emit_deepseek_aux},
    {"seq_aux", kMla, "(read with aux_loss_alpha)", boolean, "true", emit_seq_aux},
    {"num_nextn_predict_layers", kDeepSeek, "--mtp-num-layers", optional_positive_int, "0", emit_mtp},
    {"num_nextn_predict_layers", kGlm, "--mtp-num-layers", optional_positive_int, "1", emit_mtp},
    {"rope_interleave", kDeepSeek, "(the weight layout: interleaved RoPE channels are de-interleaved on import)",
     ignore, "true", emit_false},
    {"attention_bias", kMla, "q/kv/o projection biases", must_be_false, "false"},
    {"pretraining_tp", kMla, "(tensor-parallel pretraining slices; only 1)", must_be_one, "1"},
    {"ep_size", kMla, "", ignore, "1"},
    {"quantization_config", kDeepSeek, "(FP8 weights)", fp8_quantization, "null"},
    {"auto_map", kMla, "", ignore, "null"},
    // GPT-OSS (transformers' GptOssConfig; the hub's files add experts_per_token and initial_context_length).
    {"num_local_experts", kGptOss, "--num-experts", to_int, nullptr, emit_experts},
    {"experts_per_token", kGptOss, "(num_experts_per_tok)", same_as_key<kExpertsPerTok>, "null"},
    {"head_dim", kGptOss, "--kv-channels", optional_int, "null", emit_head_dim},
    {"intermediate_size", kGptOss, "--moe-ffn-hidden-size", to_int, nullptr},
    {"attention_bias", kGptOss, "(--add-bias-linear: biases on q/k/v/o, the router and the experts)", must_be_true,
     "true", emit_true},
    {"hidden_act", kGptOss, "(--quick-geglu)", gpt_oss_act, "\"silu\"", emit_silu},
    {"swiglu_alpha", kGptOss, "(--quick-geglu)", gpt_oss_alpha, "1.702"},
    {"swiglu_limit", kGptOss, "--activation-func-clamp-value", gpt_oss_limit, "7.0", emit_clamp},
    {"sliding_window", kGptOss, "--window-size", gpt_oss_window, "128", emit_window},
    {"layer_types", kGptOss, "--window-attn-skip-freq (read with sliding_window)", ignore, "null", emit_layer_types},
    {"rope_parameters", kGptOss, "--rotary-base, --position-embedding-type", gpt_oss_rope, "null"},
    {"rope_scaling", kGptOss, "--position-embedding-type yarn", gpt_oss_rope, "null", emit_gpt_oss_rope},
    {"router_aux_loss_coef", kGptOss, "--moe-aux-loss-coeff", to_number, "0.9", emit_aux_coeff},
    {"quantization_config", kGptOss, "(MXFP4 experts)", mxfp4_quantization, "null"},
    {"initial_context_length", kGptOss, "", ignore, "null"},
    {"max_position_embeddings", kAny, "--max-position-embeddings", to_int, nullptr, emit_max_positions},
    {"use_sliding_window", kQwen, "sliding-window attention", must_be_false, "false"},
    {"sliding_window", kAll, "sliding-window attention", sliding_window, "null"},
    {"max_window_layers", kQwen, "(sliding-window layers; read only with use_sliding_window)", ignore, "null"},
    {"attention_bias", kQwen3, "q/k/v/o projection biases", must_be_false, "false"},
    {"vocab_size", kAny, "--vocab-size", to_int, nullptr, emit_int<&model::ModelConfig::vocab_size>},
    {"tie_word_embeddings", kAny, "--untie-embeddings-and-output-weights", switch_if_false, "false", emit_tied},
    {"attention_dropout", kAny, "--attention-dropout", to_number, "0.0",
     emit_float<&model::ModelConfig::attention_dropout>},
    {"initializer_range", kAny, "--init-method-std", to_number, "0.02",
     emit_float<&model::ModelConfig::init_method_std>},
    // Harmless: token ids (the tokenizer's business), inference and bookkeeping keys.
    {"output_router_logits", kAny, "(HF adds the aux loss only with it; see router_aux_loss_coef)", ignore, "false"},
    {"bos_token_id", kAny, "", ignore, "null"},
    {"eos_token_id", kAny, "", ignore, "null"},
    {"pad_token_id", kAny, "", ignore, "null"},
    {"torch_dtype", kAny, "", weights_dtype, "null", emit_dtype},
    {"dtype", kAny, "", weights_dtype, "null"},
    {"use_cache", kAny, "", ignore, "true"},
    {"transformers_version", kAny, "", ignore, "null"},
    {"architectures", kAny, "", ignore, "null", emit_architectures},
    {"_name_or_path", kAny, "", ignore, "null"},
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
    {kGptOss, "--normalization", "RMSNorm"},
    {kGptOss, "--hidden-dropout", "0"},
    {kGptOss, "--moe-router-load-balancing-type", "aux_loss"},
    {kGptOss, "--quick-geglu", ""},  // (up + 1) * gate sigmoid(1.702 gate), clamped
    {kGptOss, "--glu-linear-offset", "1"},
    {kGptOss, "--softmax-type", "learnable"},  // the per-head sinks
    {kOlmoe, "--normalization", "RMSNorm"},
    {kOlmoe, "--position-embedding-type", "rope"},
    {kOlmoe, "--disable-bias-linear", ""},
    {kOlmoe, "--hidden-dropout", "0"},
    {kOlmoe, "--moe-router-load-balancing-type", "aux_loss"},
    {kOlmoe, "--qk-layernorm", ""},
    {kOlmoe, "--qk-layernorm-over-heads", ""},  // RMSNorm over each token's whole q and k projections
    {kMla | kGlm, "--normalization", "RMSNorm"},
    {kMla | kGlm, "--position-embedding-type", "rope"},
    {kMla | kGlm, "--disable-bias-linear", ""},
    {kMla | kGlm, "--hidden-dropout", "0"},
    {kMla, "--multi-latent-attention", ""},
    {kMla, "--qk-layernorm", ""},                   // with MLA: the q_a / kv_a latent RMSNorms
    {kDeepSeekV2, "--moe-router-pre-softmax", ""},  // softmax over all experts, top-k, no renormalisation
    // GLM-4.5: DeepSeek-V3's router (sigmoid, e_score_correction_bias) without its noaux_tc / scoring_func keys, and
    // no aux-loss key (pass --moe-router-load-balancing-type and --moe-aux-loss-coeff to train with one).
    {kGlm, "--moe-router-score-function", "sigmoid"},
    {kGlm, "--moe-router-enable-expert-bias", ""},
    {kGlm, "--moe-router-load-balancing-type", "none"},
    {kQwen3, "--qk-layernorm", ""},  // RMSNorm over each q and k head before RoPE
};

std::string supported_models() {
  std::string s;
  for (const char* m : kModelNames) s += (s.empty() ? "" : ", ") + std::string(m);
  return s;
}

unsigned model_bit(const json& cfg) {
  if (!cfg.is_object()) MOECORE_FAIL("config.json: the top level must be an object");
  if (!cfg.contains("model_type") || !cfg["model_type"].is_string())
    MOECORE_FAIL("config.json has no string 'model_type' (supported: ", supported_models(), ")");
  const std::string m = model_of(cfg);
  for (unsigned i = 0; i < kModelCount; ++i)
    if (m == kModelNames[i]) return 1u << i;
  MOECORE_FAIL("config.json model_type '", m, "' is not supported (supported: ", supported_models(), ")");
}

// Values of a config.json that contradict each other, refused by their keys (not by the Megatron flags they become):
// the query heads over the key/value heads, the hidden size over the heads when head_dim is not given (standard
// attention), the routed experts per token over the experts.
void check_consistent(const json& cfg, int64_t experts) {
  const int64_t heads = int_key(cfg, "num_attention_heads", 0), kv = int_key(cfg, "num_key_value_heads", 0);
  if (heads > 0 && kv > 0 && heads % kv != 0)
    MOECORE_FAIL("config.json: num_attention_heads (", heads, ") must be divisible by num_key_value_heads (", kv,
                 "): each key/value head serves a whole group of query heads");
  const int64_t hidden = int_key(cfg, "hidden_size", 0);
  const bool head_dim = !cfg.value("head_dim", json()).is_null(), mla = cfg.contains("kv_lora_rank");
  if (!head_dim && !mla && heads > 0 && hidden % heads != 0)
    MOECORE_FAIL("config.json: hidden_size (", hidden, ") must be divisible by num_attention_heads (", heads,
                 ") when head_dim is not given (the head size is their quotient)");
  const int64_t topk = int_key(cfg, "num_experts_per_tok", 0);
  if (experts > 0 && topk > experts) {
    const char* key = cfg.contains("num_local_experts")  ? "num_local_experts"
                      : cfg.contains("n_routed_experts") ? "n_routed_experts"
                                                         : "num_experts";
    MOECORE_FAIL("config.json: num_experts_per_tok (", topk, ") exceeds ", key, " (", experts,
                 "): each token is routed to that many distinct experts");
  }
}

}  // namespace

Flags hf_config_flags(const json& cfg) {
  const unsigned bit = model_bit(cfg);
  const std::string m = model_of(cfg);
  for (const auto& item : cfg.items()) {
    const std::string& key = item.key();  // not a structured binding: clang 14 cannot capture those
    const json& v = item.value();
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
  // The weight map and the parameter list name every expert of every layer: bound their count (the rows bound
  // each factor, so the product cannot overflow). Real models stay far below (DeepSeek-V3: 62 x 256).
  constexpr int64_t kMaxExpertMlps = int64_t{1} << 16;
  const int64_t layers = int_key(cfg, "num_hidden_layers", 0) + int_key(cfg, "num_nextn_predict_layers", 0);
  const int64_t experts = std::max(
      {int_key(cfg, "num_local_experts", 0), int_key(cfg, "num_experts", 0), int_key(cfg, "n_routed_experts", 0)});
  if (layers * experts > kMaxExpertMlps)
    MOECORE_FAIL("config.json: num_hidden_layers (plus num_nextn_predict_layers) ", layers, " x ", experts,
                 " experts = ", layers * experts, " expert MLPs exceeds the ", kMaxExpertMlps,
                 " this reader accepts; hint: the file is corrupt or not a released MoE model");
  check_consistent(cfg, experts);
  return out;
}

std::string hf_config_path(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  fs::path p(path);
  std::error_code ec;  // a path the filesystem refuses (too long, no permission) is "not there", not an exception
  if (fs::is_directory(p, ec)) {
    p /= "config.json";
    io::require_regular_file(p.string(), flag + " " + path + ": config.json");
    if (!fs::is_regular_file(p, ec)) MOECORE_FAIL(flag, " ", path, ": the directory holds no config.json");
  } else {
    io::require_regular_file(path, flag);  // a FIFO would block the read
    if (!fs::is_regular_file(p, ec)) MOECORE_FAIL(flag, " ", path, ": no such file or directory");
  }
  return p.string();
}

json hf_config_parse(const std::string& text, const std::string& where) {
  return io::parse_json(text, where);
}

json hf_config_load(const std::string& path, const std::string& flag) {
  const std::string p = hf_config_path(path, flag);
  std::ifstream f(p);
  if (!f) MOECORE_FAIL(flag, " ", p, ": cannot open");
  return hf_config_parse(std::string(std::istreambuf_iterator<char>(f), {}), flag + " " + p);
}

void add_hf_config_flag(Args& a) {
  a.option("--hf-config", "",
           "a Hugging Face config.json (or a model directory holding one) of model_type mixtral, qwen2_moe, "
           "qwen3_moe, deepseek_v3, deepseek_v2, glm4_moe, olmoe or gpt_oss; its model flags fill those not given "
           "(moecore only)");
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

void hf_config_apply(Args& a, const std::string& flag) {
  const std::string path = a.str("--hf-config");
  if (!path.empty()) hf_config_fill(a, hf_config_load(path, flag), flag + " " + path);
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

std::optional<std::string> hf_config_dtype(const json& config) {
  for (const char* key : {"dtype", "torch_dtype"}) {  // transformers 5's name first
    const json v = config.is_object() ? config.value(key, json()) : json();
    if (v.is_null()) continue;
    if (!v.is_string()) MOECORE_FAIL("config.json key '", key, "' = ", v.dump(), ": expected a dtype name or null");
    return v.get<std::string>();
  }
  return std::nullopt;
}

model::HfWeightMap hf_config_weight_map(const json& config, const model::ModelConfig& cfg) {
  const model::HfFamily family = model::hf_family_parse(model_of(config));
  const json interleave = config.value("rope_interleave", json(true));
  if (!interleave.is_boolean())
    MOECORE_FAIL("config.json key 'rope_interleave' = ", interleave.dump(), ": expected true or false");
  return model::hf_weight_map(cfg, family, interleave.get<bool>());
}

namespace {
// A config.json must stand for the model `c`: read back, it gives the same parameters (names and shapes) and the
// same function (model/config_record.h: positions, RoPE/YaRN, norm epsilon, routing, ...). Error naming what differs.
void check_config_gives(const json& config, const model::ModelConfig& c, const std::string& where) {
  const model::ModelConfig b = hf_model_config(config, where, {{"--seq-length", "1"}});
  std::string diff;
  const auto pa = model::parameter_specs(c), pb = model::parameter_specs(b);
  for (size_t i = 0; i < std::max(pa.size(), pb.size()) && diff.empty(); ++i)
    if (i >= pa.size() || i >= pb.size() || pa[i].name != pb[i].name || !(pa[i].shape == pb[i].shape))
      diff = "\n  the parameter list (at " + (i < pa.size() ? pa[i].name : pb[i].name) + ")";
  for (const std::string& d : model::model_differences(c, b, "the model", "read back")) diff += "\n  " + d;
  if (!diff.empty())
    MOECORE_FAIL(where, " cannot hold the model: read back, it differs in", diff,
                 "\n(pass --hf-config with a config.json of the model's own family and settings)");
}
}  // namespace

json hf_config_for_model(const model::ModelConfig& c, model::HfFamily family) {
  (void)model::hf_weight_map(c, family);  // refuses, by name, what the family's modeling code lacks (LayerNorm, ...)
  const unsigned bit = 1u << static_cast<unsigned>(family);
  json out = json::object();
  for (const Row& r : kRows) {
    if (!(r.models & bit) || !r.emit) continue;
    json v = r.emit(c, bit);
    if (!v.is_discarded()) out[r.key] = std::move(v);
  }
  check_config_gives(out, c, std::string("the config.json written for a ") + model::hf_family_name(family) + " model");
  return out;
}

json hf_config_update(const json& original, const model::ModelConfig& c, const std::string& where) {
  const model::HfFamily family = hf_config_weight_map(original, c).family;
  const unsigned bit = 1u << static_cast<unsigned>(family);
  const json written = hf_config_for_model(c, family);
  json out = original;
  auto is_flag_row = [&](const Row& r) { return (r.models & bit) && std::string(r.flag).rfind("--", 0) == 0; };
  for (const Row& r : kRows) {  // the keys that stand for a Megatron flag, where the trained model differs
    if (!is_flag_row(r) || !r.emit || !written.contains(r.key)) continue;
    const json &was = original.contains(r.key) ? original[r.key] : json(), &now = written[r.key];
    const bool same = was == now || (was.is_number() && now.is_number() &&
                                     static_cast<float>(was.get<double>()) == static_cast<float>(now.get<double>()));
    if (same) continue;
    out[r.key] = now;
    for (const Row& other : kRows)  // another spelling of the same flag the table only reads (rope_parameters)
      if (is_flag_row(other) && !other.emit && std::string(other.flag) == r.flag) out.erase(other.key);
  }
  check_config_gives(out, c, where + " updated for the trained model");
  return out;
}

}  // namespace moecore::apps
