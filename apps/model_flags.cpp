// The model flags: one table (kModelFlags) holds every model and MoE flag a command that builds a model accepts,
// with Megatron's default, its help text and the rule that reads it into the ModelConfig. It drives the
// declaration (--help, --list-flags, --config) and the parsing and validation (Megatron's flags that are accepted
// without effect or refused are in megatron_flags.cpp's table);
// --hf-config's table (hf_config.cpp) maps config.json keys to these flags by name.
#include "apps/model_flags.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/model/layer_pattern.h"

namespace moecore::apps {
namespace {

using model::ModelConfig;

enum class Kind : uint8_t { value, list, flag };  // list: VALUE...
using Apply = void (*)(const Args& a, const char* flag, ModelConfig& c);

struct ModelFlag {
  const char* name;
  Kind kind;
  const char* def;  // value: Megatron's default ("" = Megatron's None: unset)
  const char* help;
  Apply apply;  // reads the flag (and flags it depends on) into the config; nullptr: read elsewhere or nothing
  int64_t ModelConfig::*required = nullptr;  // Megatron requires the flag: the command's default is this field's
};

// ---- Readers --------------------------------------------------------------------------------------------------
template <int64_t ModelConfig::*F>
void i64(const Args& a, const char* f, ModelConfig& c) {
  c.*F = a.i64(f);
}
// Megatron's None is 0 here; a given value must be positive.
template <int64_t ModelConfig::*F>
void positive_or_unset(const Args& a, const char* f, ModelConfig& c) {
  c.*F = a.i64_or(f, 0);
  if (a.given(f) && c.*F <= 0)
    MOECORE_FAIL(f, " (", a.str(f), ") must be positive (leave it unset for Megatron's None, its default)");
}
template <float ModelConfig::*F>
void f32(const Args& a, const char* f, ModelConfig& c) {
  c.*F = static_cast<float>(a.f64(f));
}
template <bool ModelConfig::*F>
void on(const Args& a, const char* f, ModelConfig& c) {
  c.*F = a.on(f);
}
template <float ModelConfig::*F>
void probability(const Args& a, const char* f, ModelConfig& c) {
  const double p = a.f64(f);
  if (!(p >= 0.0 && p < 1.0)) MOECORE_FAIL(f, " (", a.str(f), ") must be in [0, 1)");
  c.*F = static_cast<float>(p);
}
template <int64_t moe::MoeConfig::*F>
void moe_i64_or_unset(const Args& a, const char* f, ModelConfig& c) {
  c.moe.*F = a.i64_or(f, 0);
}
template <float moe::MoeConfig::*F>
void moe_f32_or_unset(const Args& a, const char* f, ModelConfig& c) {
  c.moe.*F = static_cast<float>(a.f64_or(f, 0.0));
}
template <bool moe::MoeConfig::*F>
void moe_on(const Args& a, const char* f, ModelConfig& c) {
  c.moe.*F = a.on(f);
}

void softmax_type(const Args& a, const char* f, ModelConfig& c) {
  const std::string v = a.str(f);
  for (model::SoftmaxType t :
       {model::SoftmaxType::vanilla, model::SoftmaxType::off_by_one, model::SoftmaxType::learnable})
    if (v == model::softmax_type_name(t)) {
      c.softmax_type = t;
      return;
    }
  MOECORE_FAIL(f, " (", v, ") must be vanilla, off-by-one or learnable");
}

// Megatron's tuple_type: "(left, right)", also "[left, right]" or "left,right".
void window_size(const Args& a, const char* f, ModelConfig& c) {
  const std::string v = a.str(f);
  if (v.empty()) return;
  std::string s;
  for (char ch : v)
    if (ch != '(' && ch != ')' && ch != '[' && ch != ']' && ch != ' ') s.push_back(ch);
  const size_t comma = s.find(',');
  int64_t left = 0, right = 0;
  size_t used_left = 0, used_right = 0;
  try {
    if (comma == std::string::npos) throw std::invalid_argument("no comma");
    left = std::stoll(s.substr(0, comma), &used_left);
    right = std::stoll(s.substr(comma + 1), &used_right);
  } catch (const std::exception&) {
    MOECORE_FAIL(f, " (", v, ") must be a pair '(left, right)' of integers, e.g. '(128, 0)'");
  }
  if (used_left != comma || used_right != s.size() - comma - 1)
    MOECORE_FAIL(f, " (", v, ") must be a pair '(left, right)' of integers, e.g. '(128, 0)'");
  if (left < -1) MOECORE_FAIL(f, " (", v, "): left (", left, ") must be -1 (infinite) or >= 0");
  if (right != 0 && right != -1)
    MOECORE_FAIL(f, " (", v, "): right (", right, ") must be 0: attention is causal, no query sees later keys");
  c.window_size = left;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == ',' || ch == ' ') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (ch != '[' && ch != ']' && ch != '\'' && ch != '"') {
      cur.push_back(ch);
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

void exclusive(const Args& a, const char* x, const char* y) {
  if (a.on(x) && a.on(y)) MOECORE_FAIL("flags ", x, " and ", y, " exclude each other");
}

// ---- Readers with their own rules ------------------------------------------------------------------------------
// Megatron reads --num-query-groups only with --group-query-attention; otherwise every head has its own k/v.
void query_groups(const Args& a, const char* f, ModelConfig& c) {
  const bool gqa = a.on("--group-query-attention");
  c.num_query_groups = gqa ? a.i64(f) : 0;
  if (gqa && c.num_query_groups <= 0)
    MOECORE_FAIL(f, " (", c.num_query_groups, ") must be positive with --group-query-attention");
  if (!gqa && a.given(f) && a.i64(f) != 1)
    std::fprintf(stderr,
                 "warning: %s %lld is ignored without --group-query-attention (as in Megatron): every attention "
                 "head has its own key/value head\n",
                 f, static_cast<long long>(a.i64(f)));
}

void position_embedding(const Args& a, const char* f, ModelConfig& c) {
  // Megatron's validate_args: the old switch sets the type to rope.
  const std::string pos = a.on("--use-rotary-position-embeddings") ? "rope" : a.str(f);
  if (pos == "learned_absolute")
    c.position_embedding_type = model::PositionEmbedding::learned_absolute;
  else if (pos == "rope")
    c.position_embedding_type = model::PositionEmbedding::rope;
  else if (pos == "none")
    c.position_embedding_type = model::PositionEmbedding::none;
  else if (pos == "yarn" && !a.on("--multi-latent-attention"))  // RoPE with YaRN's frequencies and concentration
    c.position_embedding_type = model::PositionEmbedding::rope, c.yarn = true;
  else if (pos == "yarn")
    MOECORE_FAIL(f, " yarn is for standard attention; MLA takes --position-embedding-type rope and --rope-type yarn");
  else if (pos == "mrope" || pos == "relative")
    MOECORE_FAIL(f, " ", pos, " is not supported yet (learned_absolute, rope, yarn or none)");
  else
    MOECORE_FAIL(f, " '", pos, "' is not one of learned_absolute, rope, yarn, none");
  if (a.on("--no-position-embedding") && !c.rope())
    MOECORE_FAIL(
        "--no-position-embedding needs --position-embedding-type rope (as in Megatron); for no position "
        "embedding at all use --position-embedding-type none");
}

// --quick-geglu: a gated MLP (fc1 [2F, H]) with quick-GELU; Megatron asserts it is not given with --swiglu.
void quick_geglu(const Args& a, const char* f, ModelConfig& c) {
  exclusive(a, "--swiglu", f);
  c.quick_geglu = a.on(f);
  if (c.quick_geglu) c.swiglu = c.moe.swiglu = true;
  c.moe.glu = c.glu_params();
}

// The GLU's offset and clamp (Megatron's None clamp: 0); the experts' GLU is the model's.
template <float ModelConfig::*F>
void glu(const Args& a, const char* f, ModelConfig& c) {
  c.*F = static_cast<float>(a.f64_or(f, 0.0));
  if (!std::isfinite(c.*F)) MOECORE_FAIL(f, " (", a.str(f), ") must be finite");
  if (F == &ModelConfig::activation_func_clamp_value && a.given(f) && !(c.*F > 0.0f))
    MOECORE_FAIL(f, " (", a.str(f), ") must be greater than zero (leave it unset for no clamp)");
  c.moe.glu = c.glu_params();
}

void rotary_percent(const Args& a, const char* f, ModelConfig& c) {
  c.rotary_percent = static_cast<float>(a.f64(f));
  if (!(c.rotary_percent > 0.0f && c.rotary_percent <= 1.0f)) MOECORE_FAIL(f, " (", a.str(f), ") must be in (0, 1]");
}

void normalization(const Args& a, const char* f, ModelConfig& c) {
  const std::string norm = a.str(f);
  if (norm != "RMSNorm" && norm != "LayerNorm") MOECORE_FAIL(f, " '", norm, "' is not one of RMSNorm, LayerNorm");
  c.normalization = norm == "LayerNorm" ? model::Normalization::layernorm : model::Normalization::rmsnorm;
}

// Megatron's MLATransformerConfig defaults rope_type to yarn; the other attentions read it not (their YaRN is
// --position-embedding-type yarn).
void rope_type(const Args& a, const char* f, ModelConfig& c) {
  const std::string t = a.str(f);
  if (!t.empty() && t != "rope" && t != "yarn") MOECORE_FAIL(f, " '", t, "' is not one of rope, yarn");
  if (!a.on("--multi-latent-attention")) {
    if (t == "yarn")
      MOECORE_FAIL(f,
                   " yarn is read with --multi-latent-attention (Megatron's MLA); standard attention takes YaRN "
                   "from --position-embedding-type yarn (Megatron's GPT YaRN)");
    return;
  }
  c.yarn = t == "yarn" || t.empty();
}

void max_positions(const Args& a, const char* f, ModelConfig& c) {
  c.max_position_embeddings = a.i64_or(f, 0);
  if (a.given(f) && c.max_position_embeddings <= 0)
    MOECORE_FAIL(f, " (", c.max_position_embeddings, ") must be positive");
}

void load_balancing(const Args& a, const char* f, ModelConfig& c) {
  c.moe.load_balancing_type.clear();
  for (const auto& t : split_list(a.str(f))) c.moe.load_balancing_type.push_back(moe::parse_load_balancing(t));
}

void aux_loss_coeff(const Args& a, const char* f, ModelConfig& c) {
  c.moe.aux_loss_coeff.clear();
  for (const auto& x : split_list(a.str(f))) {
    double v = 0;
    if (!parse_number(x, v) || v < 0) MOECORE_FAIL(f, " '", a.str(f), "': '", x, "' is not a non-negative number");
    c.moe.aux_loss_coeff.push_back(static_cast<float>(v));
  }
}

void router_dtype(const Args& a, const char* f, ModelConfig& c) {
  const std::string rd = a.str(f).empty() ? "fp32" : a.str(f);
  if (rd != "fp32" && rd != "fp64") MOECORE_FAIL(f, " '", rd, "' is not one of fp32, fp64");
  c.moe.router_dtype = rd == "fp64" ? DType::f64 : DType::f32;
}

void capacity_factor(const Args& a, const char* f, ModelConfig& c) {
  c.moe.capacity_factor = static_cast<float>(a.f64_or(f, 0.0));
  if (a.given(f) && !(c.moe.capacity_factor > 0.0f))
    MOECORE_FAIL(f, " (", a.str(f), ") must be positive (leave it unset for dropless)");
}

// --moe-received-token-capacity and --moe-expert-rank-capacity-factor set one field; both given must agree.
void received_token_capacity(const Args& a, const char* f, ModelConfig& c) {
  if (!a.given(f)) return;
  const auto v = static_cast<float>(a.f64(f));
  if (!(v > 0.0f)) MOECORE_FAIL(f, " (", a.str(f), ") must be positive (leave it unset for the synced dropless path)");
  if (c.moe.received_token_capacity > 0 && c.moe.received_token_capacity != v)
    MOECORE_FAIL("--moe-received-token-capacity and --moe-expert-rank-capacity-factor name one setting; got ",
                 c.moe.received_token_capacity, " and ", v);
  c.moe.received_token_capacity = v;
}

void drop_policy(const Args& a, const char* f, ModelConfig& c) {
  const std::string pol = a.str(f);
  if (pol != "probs" && pol != "position") MOECORE_FAIL(f, " '", pol, "' is not one of probs, position");
  c.moe.drop_policy = pol == "position" ? moe::DropPolicy::position : moe::DropPolicy::probs;
}

// clang-format off
const ModelFlag kModelFlags[] = {
  // Sizes (Megatron requires the first four; --help says so).
  {"--num-layers", Kind::value, nullptr, "transformer layers", i64<&ModelConfig::num_layers>, &ModelConfig::num_layers},
  {"--hidden-size", Kind::value, nullptr, "hidden size H", i64<&ModelConfig::hidden_size>, &ModelConfig::hidden_size},
  {"--num-attention-heads", Kind::value, nullptr, "query heads", i64<&ModelConfig::num_attention_heads>,
   &ModelConfig::num_attention_heads},
  {"--group-query-attention", Kind::flag, "", "grouped-query attention with --num-query-groups key/value heads", nullptr},
  {"--num-query-groups", Kind::value, "1", "key/value heads; read only with --group-query-attention (as Megatron)",
   query_groups},
  {"--kv-channels", Kind::value, "", "head dim (unset: hidden / heads)", positive_or_unset<&ModelConfig::kv_channels>},
  {"--ffn-hidden-size", Kind::value, "", "MLP hidden size (unset: 4 * hidden)",
   positive_or_unset<&ModelConfig::ffn_hidden_size>},
  {"--vocab-size", Kind::value, "", "vocabulary size (unset: the tokenizer's, padded)", nullptr},  // model_config_from
  {"--seq-length", Kind::value, nullptr, "tokens per sample", i64<&ModelConfig::seq_length>, &ModelConfig::seq_length},
  {"--max-position-embeddings", Kind::value, "",
   "rows of the learned position table; must be >= --seq-length (Megatron: required; unset here: --seq-length)",
   max_positions},
  // Positions.
  {"--position-embedding-type", Kind::value, "learned_absolute", "learned_absolute | rope | yarn (RoPE with YaRN, standard attention) | none", position_embedding},
  {"--no-position-embedding", Kind::flag, "",
   "Megatron's switch for learned positions: a no-op with rope, an error otherwise", nullptr},
  {"--rotary-base", Kind::value, "10000", "RoPE base", f32<&ModelConfig::rotary_base>},
  {"--rotary-percent", Kind::value, "1.0", "share of each head's channels RoPE rotates, (0, 1]", rotary_percent},
  // Layers.
  {"--disable-bias-linear", Kind::flag, "", "no biases on the linear layers (Megatron adds them by default)",
   [](const Args& a, const char* f, ModelConfig& c) { c.add_bias_linear = !a.on(f); }},
  {"--qk-layernorm", Kind::flag, "",
   "QK-norm: the --normalization norm over each query and key head before RoPE (MLA: over the q and kv latents)",
   on<&ModelConfig::qk_layernorm>},
  {"--qk-layernorm-over-heads", Kind::flag, "",
   "with --qk-layernorm: one norm over each token's whole query (key) projection, all heads together (OLMoE), not "
   "one per head (moecore)",
   on<&ModelConfig::qk_layernorm_over_heads>},
  {"--add-qkv-bias", Kind::flag, "", "a bias on linear_qkv only (Qwen2-style), with --disable-bias-linear",
   on<&ModelConfig::add_qkv_bias>},
  {"--hidden-dropout", Kind::value, "0.1", "dropout on the embedding output and both residual branches, [0, 1)",
   probability<&ModelConfig::hidden_dropout>},
  {"--attention-dropout", Kind::value, "0.1", "dropout on the attention probabilities, [0, 1)",
   probability<&ModelConfig::attention_dropout>},
  {"--norm-epsilon", Kind::value, "1e-05", "norm epsilon", f32<&ModelConfig::norm_epsilon>},
  {"--init-method-std", Kind::value, "0.02", "std of the normal weight init", f32<&ModelConfig::init_method_std>},
  {"--normalization", Kind::value, "LayerNorm", "LayerNorm | RMSNorm", normalization},
  {"--swiglu", Kind::flag, "", "SwiGLU MLP and experts (without it: GeLU, as in Megatron)",
   [](const Args& a, const char* f, ModelConfig& c) { c.swiglu = c.moe.swiglu = a.on(f); }},
  {"--quick-geglu", Kind::flag, "",
   "gated linear unit with quick-GELU, x sigmoid(1.702 x), in the MLP and experts (GPT-OSS); not with --swiglu",
   quick_geglu},
  {"--glu-linear-offset", Kind::value, "0.0", "the gated linear unit's act(gate) * (up + offset)",
   glu<&ModelConfig::glu_linear_offset>},
  {"--activation-func-clamp-value", Kind::value, "",
   "clamp of the gated linear unit's input: gate <= value, -value <= up <= value (GPT-OSS: 7)",
   glu<&ModelConfig::activation_func_clamp_value>},
  {"--untie-embeddings-and-output-weights", Kind::flag, "",
   "separate output layer (without it the embedding is shared)",
   on<&ModelConfig::untie_embeddings_and_output_weights>},
  {"--bf16", Kind::flag, "", "bf16 compute with fp32 master weights",
   [](const Args& a, const char* f, ModelConfig& c) { c.compute_dtype = a.on(f) ? DType::bf16 : DType::f32; }},
  {"--fp16", Kind::flag, "",
   "fp16 compute with fp32 master weights and loss scaling (dynamic unless --loss-scale; see --initial-loss-scale)",
   [](const Args& a, const char* f, ModelConfig& c) {
     if (!a.on(f)) return;
     if (a.on("--bf16")) MOECORE_FAIL("--fp16 and --bf16 exclude each other (Megatron's check): give one");
     c.compute_dtype = DType::f16;
   }},
  // Attention's implementation and softmax precision (Megatron's switches; the attention here is one flash-style
  // kernel per device with an exact fp32 softmax, which is what each of them asks for).
  {"--attention-backend", Kind::value, "auto",
   "flash | fused | unfused | local | auto: Megatron's kernel choice; each is moecore's flash-style attention with "
   "an exact fp32 softmax (local needs Megatron's --spec local, which moecore does not have)",
   [](const Args& a, const char* f, ModelConfig&) {
     if (a.str(f) == "local")
       MOECORE_FAIL(f, " local selects Megatron's local layer spec (--spec local), which moecore does not have; use "
                    "--attention-backend auto");
   }},
  {"--attention-softmax-in-fp32", Kind::flag, "",
   "the attention softmax in fp32 under --bf16: always so here (the flag changes nothing moecore computes)", nullptr},
  {"--apply-query-key-layer-scaling", Kind::flag, "",
   "Megatron scales Q.K^T by 1/layer_number and the fp32 softmax multiplies it back: the same attention in exact "
   "arithmetic, kept for fp16; implies --attention-softmax-in-fp32, as in Megatron (always fp32 here)",
   nullptr},
  {"--use-rotary-position-embeddings", Kind::flag, "",
   "Megatron's older spelling of --position-embedding-type rope", nullptr},
  // Multi-latent attention and YaRN.
  {"--multi-latent-attention", Kind::flag, "",
   "multi-latent attention (MLA, DeepSeek-V2/V3); --qk-layernorm then norms the q and kv latents",
   on<&ModelConfig::multi_latent_attention>},
  {"--q-lora-rank", Kind::value, "", "MLA: rank of the q down-projection (unset: q projected directly, as V2-Lite)",
   positive_or_unset<&ModelConfig::q_lora_rank>},
  {"--kv-lora-rank", Kind::value, "32", "MLA: rank of the kv down-projection", i64<&ModelConfig::kv_lora_rank>},
  {"--qk-head-dim", Kind::value, "128", "MLA: q/k channels per head without RoPE", i64<&ModelConfig::qk_head_dim>},
  {"--qk-pos-emb-head-dim", Kind::value, "64", "MLA: q/k channels per head with RoPE",
   i64<&ModelConfig::qk_pos_emb_head_dim>},
  {"--v-head-dim", Kind::value, "128", "MLA: value channels per head", i64<&ModelConfig::v_head_dim>},
  {"--rope-type", Kind::value, "", "rope | yarn (unset: yarn with MLA, as Megatron's MLATransformerConfig; else rope)",
   rope_type},
  {"--rotary-scaling-factor", Kind::value, "1.0", "YaRN: context extension factor",
   [](const Args& a, const char* f, ModelConfig& c) { c.yarn_config.scaling_factor = static_cast<float>(a.f64(f)); }},
  {"--mscale", Kind::value, "1.0", "YaRN: mscale (cos/sin scale mscale(factor, mscale) / mscale(factor, all-dim))",
   [](const Args& a, const char* f, ModelConfig& c) { c.yarn_config.mscale = static_cast<float>(a.f64(f)); }},
  {"--mscale-all-dim", Kind::value, "0.0", "YaRN: mscale_all_dim (also scales the MLA softmax by its mscale^2)",
   [](const Args& a, const char* f, ModelConfig& c) { c.yarn_config.mscale_all_dim = static_cast<float>(a.f64(f)); }},
  {"--yarn-original-max-position-embeddings", Kind::value, "", "YaRN: the original context (unset: 4096)",
   [](const Args& a, const char* f, ModelConfig& c) { c.yarn_config.original_max_position_embeddings = a.i64_or(f, 4096); }},
  {"--yarn-beta-fast", Kind::value, "", "YaRN: beta_fast (unset: 32)",
   [](const Args& a, const char* f, ModelConfig& c) { c.yarn_config.beta_fast = static_cast<float>(a.f64_or(f, 32.0)); }},
  {"--yarn-beta-slow", Kind::value, "", "YaRN: beta_slow (unset: 1)",
   [](const Args& a, const char* f, ModelConfig& c) { c.yarn_config.beta_slow = static_cast<float>(a.f64_or(f, 1.0)); }},
  {"--yarn-correction-range-round-to-int", Kind::flag, "", "YaRN: floor/ceil the correction range (the default)",
   nullptr},
  {"--no-yarn-correction-range-round-to-int", Kind::flag, "", "YaRN: keep the correction range fractional",
   [](const Args& a, const char* f, ModelConfig& c) {
     exclusive(a, "--yarn-correction-range-round-to-int", f);
     c.yarn_config.correction_range_round_to_int = !a.on(f);
   }},
  // Multi-token prediction.
  {"--mtp-num-layers", Kind::value, "", "multi-token prediction depths (unset: none)",
   positive_or_unset<&ModelConfig::mtp_num_layers>},
  {"--mtp-loss-scaling-factor", Kind::value, "0.1", "weight of the MTP losses, divided by --mtp-num-layers",
   f32<&ModelConfig::mtp_loss_scaling_factor>},
  // Precision and recompute.
  {"--recompute-activations", Kind::flag, "",
   "shorthand for --recompute-granularity selective (as Megatron: it wins over that flag)", nullptr},
  {"--recompute-granularity", Kind::value, "",
   "full: backward recomputes whole layers from their chunk's input; selective: the --recompute-modules' outputs (unset: "
   "off)",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.recompute.granularity = a.on("--recompute-activations") ? "selective" : a.str(f);
     if (!a.on("--moe-layer-recompute")) return;
     if (c.recompute.granularity == "full")
       MOECORE_FAIL("--moe-layer-recompute with --recompute-granularity full: do not set both (as Megatron says)");
     c.recompute.granularity = "selective";
   }},
  {"--recompute-method", Kind::value, "",
   "with full: uniform (chunks of --recompute-num-layers layers) | block (the first --recompute-num-layers layers "
   "of each pipeline stage)",
   [](const Args& a, const char* f, ModelConfig& c) { c.recompute.method = a.str(f); }},
  {"--recompute-num-layers", Kind::value, "", "with full: layers per chunk (uniform) or recomputed layers (block)",
   [](const Args& a, const char* f, ModelConfig& c) { c.recompute.num_layers = a.str(f).empty() ? 0 : a.i64(f); }},
  {"--recompute-modules", Kind::list, "",
   "with selective: the modules whose outputs backward recomputes, of core_attn, mlp, moe, shared_experts, layernorm "
   "and moe_act (unset: core_attn, Megatron's default)",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.recompute.modules.clear();
     for (const std::string& v : a.list(f))
       for (const std::string& m : split_list(v)) c.recompute.modules.push_back(m);
     const auto& m = c.recompute.modules;
     if (a.on("--moe-layer-recompute") && std::find(m.begin(), m.end(), "moe") == m.end())
       c.recompute.modules.push_back("moe");
   }},
  {"--moe-layer-recompute", Kind::flag, "",
   "Megatron's older spelling of --recompute-granularity selective --recompute-modules moe (added to the modules)",
   nullptr},
  // Mixture of experts.
  {"--num-experts", Kind::value, "", "routed experts per MoE layer (unset: dense model)",
   moe_i64_or_unset<&moe::MoeConfig::num_experts>},
  {"--moe-ffn-hidden-size", Kind::value, "", "expert MLP hidden size (unset: --ffn-hidden-size)",
   moe_i64_or_unset<&moe::MoeConfig::ffn_hidden_size>},
  {"--moe-router-topk", Kind::value, "2", "experts per token",
   [](const Args& a, const char* f, ModelConfig& c) { c.moe.router_topk = a.i64(f); }},
  {"--moe-router-load-balancing-type", Kind::value, "aux_loss",
   "aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none, or a comma-separated list", load_balancing},
  {"--moe-aux-loss-coeff", Kind::value, "0.0", "balancing-loss coefficient, or one per type (comma-separated)",
   aux_loss_coeff},
  {"--moe-z-loss-coeff", Kind::value, "", "router z-loss coefficient (unset: off)",
   moe_f32_or_unset<&moe::MoeConfig::z_loss_coeff>},
  {"--moe-input-jitter-eps", Kind::value, "", "multiplicative router-input jitter (unset: off)",
   moe_f32_or_unset<&moe::MoeConfig::input_jitter_eps>},
  {"--moe-router-score-function", Kind::value, "softmax", "softmax | sigmoid | sqrtsoftplus",
   [](const Args& a, const char* f, ModelConfig& c) { c.moe.score_function = moe::parse_score_function(a.str(f)); }},
  {"--moe-router-pre-softmax", Kind::flag, "", "softmax over all experts before top-k",
   moe_on<&moe::MoeConfig::pre_softmax>},
  {"--moe-router-topk-scaling-factor", Kind::value, "", "scale of the top-k weights (unset: none)",
   moe_f32_or_unset<&moe::MoeConfig::topk_scaling_factor>},
  {"--moe-router-dtype", Kind::value, "",
   "router logits/probs precision: fp32 | fp64 (unset: fp32 here; Megatron then uses the input dtype)", router_dtype},
  {"--moe-router-num-groups", Kind::value, "", "expert groups for group-limited routing (unset: none)",
   moe_i64_or_unset<&moe::MoeConfig::num_groups>},
  {"--moe-router-group-topk", Kind::value, "", "groups each token may use (unset: none)",
   moe_i64_or_unset<&moe::MoeConfig::group_topk>},
  {"--moe-router-group-score-topk", Kind::value, "",
   "scores summed per group for group-limited routing (unset: topk / group-topk, Megatron's; moecore only: "
   "transformers' DeepSeek-V3 sums 2)",
   moe_i64_or_unset<&moe::MoeConfig::group_score_topk>},
  {"--moe-router-enable-expert-bias", Kind::flag, "", "aux-loss-free balancing bias (sigmoid / sqrtsoftplus)",
   moe_on<&moe::MoeConfig::enable_expert_bias>},
  {"--moe-router-bias-update-rate", Kind::value, "0.001", "expert-bias step per optimizer step",
   [](const Args& a, const char* f, ModelConfig& c) { c.moe.bias_update_rate = static_cast<float>(a.f64(f)); }},
  {"--moe-router-force-load-balancing", Kind::flag, "", "random router logits (benchmarking only)",
   moe_on<&moe::MoeConfig::force_load_balancing>},
  {"--moe-router-force-biased", Kind::value, "",
   "random router logits plus a per-expert N(0, |STD|) bias shared by all ranks, new each forward (STD > 0) or fixed "
   "per layer (STD < 0): skewed routing for benchmarking (unset: off)",
   moe_f32_or_unset<&moe::MoeConfig::force_biased>},
  {"--moe-expert-capacity-factor", Kind::value, "", "expert capacity factor (unset: dropless)", capacity_factor},
  {"--moe-token-drop-policy", Kind::value, "probs", "probs | position", drop_policy},
  {"--moe-pad-expert-input-to-capacity", Kind::flag, "", "pad every expert to its capacity",
   moe_on<&moe::MoeConfig::pad_expert_input_to_capacity>},
  {"--moe-router-padding-for-quantization", Kind::flag, "",
   "pad each expert's routed tokens to the FP8 recipe's alignment (16; 32 for mxfp8) with unrouted tokens of "
   "probability 0 (needs --fp8-format)",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.moe.router_padding_alignment = a.on(f) || a.on("--moe-router-padding-for-fp8") ? 16 : 0;
   }},
  {"--moe-router-padding-for-fp8", Kind::flag, "", "Megatron's older spelling of --moe-router-padding-for-quantization",
   nullptr},
  {"--no-moe-grouped-gemm", Kind::flag, "",
   "sequential per-expert reference instead of the grouped GEMM (moecore only)",
   [](const Args& a, const char* f, ModelConfig& c) {
     exclusive(a, "--moe-grouped-gemm", f);
     c.moe.grouped_gemm = !a.on(f);
   }},
  {"--moe-shared-expert-intermediate-size", Kind::value, "", "shared expert hidden size (unset: none)",
   moe_i64_or_unset<&moe::MoeConfig::shared_expert_intermediate_size>},
  {"--moe-shared-expert-gate", Kind::flag, "", "sigmoid gate on the shared expert output",
   moe_on<&moe::MoeConfig::shared_expert_gate>},
  // FP8 training (nn/fp8.h, docs/fp8-spec.md).
  {"--fp8-format", Kind::value, "",
   "FP8 training: e4m3 (every GEMM operand E4M3) | hybrid (gradients E5M2); the linear layers' GEMMs quantise their "
   "operands with --fp8-recipe (unset: off)",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.fp8.on = !a.str(f).empty();
     if (c.fp8.on) c.fp8.format = enum_parse<nn::Fp8Format>(a.str(f), f);
   }},
  {"--fp8-recipe", Kind::value, "delayed",
   "with --fp8-format: delayed (a scale per quantizer from the amax history of earlier steps, reduced over TP x DP x "
   "CP) | tensorwise (a current scale per tensor) | blockwise (power-of-two scales per 1x128 activation and 128x128 "
   "weight block) | mxfp8 (E8M0 scales per 32 values); custom is not supported",
   [](const Args& a, const char* f, ModelConfig& c) {
     const std::string r = a.str(f);
     if (a.given(f) && !a.given("--fp8-format"))
       MOECORE_FAIL("--fp8-recipe ", r, " needs --fp8-format e4m3 or hybrid (FP8 training is off without it)");
     for (const char* d : {"--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo"})
       if (a.given(d) && !(c.fp8.on && r == "delayed"))
         MOECORE_FAIL(d, " applies to --fp8-format with --fp8-recipe delayed only (Megatron ignores it otherwise); "
                      "drop it or give --fp8-recipe delayed");
     if (!c.fp8.on) return;
     if (r == "custom")
       MOECORE_FAIL("--fp8-recipe custom needs a Python quantizer factory (--fp8-quantizer-factory), which moecore "
                    "cannot load; give --fp8-recipe delayed, tensorwise, blockwise or mxfp8");
     c.fp8.recipe = enum_parse<nn::Fp8Recipe>(r, f);
   }},
  {"--fp8-margin", Kind::value, "0", "with --fp8-recipe delayed: scale = fp8_max * 2^-margin / amax",
   [](const Args& a, const char* f, ModelConfig& c) { c.fp8.margin = a.i64(f); }},
  {"--fp8-amax-history-len", Kind::value, "1",
   "with --fp8-recipe delayed: the amaxes of how many past steps each quantizer keeps (Megatron's default 1)",
   [](const Args& a, const char* f, ModelConfig& c) { c.fp8.amax_history_len = a.i64(f); }},
  {"--fp8-amax-compute-algo", Kind::value, "most_recent",
   "with --fp8-recipe delayed: most_recent (the newest amax) | max (the largest in the history) sets the scale",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.fp8.amax_compute_algo = enum_parse<nn::Fp8AmaxAlgo>(a.str(f), f);
   }},
  {"--first-last-layers-bf16", Kind::flag, "",
   "with --fp8-format: the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 decoder layers "
   "run their GEMMs without FP8",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.fp8.first_last_layers_bf16 = a.on(f);
     if (a.on(f) && !a.given("--fp8-format"))
       MOECORE_FAIL("--first-last-layers-bf16 needs --fp8-format (without FP8 every layer runs in --bf16 already)");
     for (const char* n : {"--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"})
       if (a.given(n) && !a.on(f)) MOECORE_FAIL(n, " needs --first-last-layers-bf16");
   }},
  {"--fp8-output-proj", Kind::flag, "",
   "with --fp8-recipe mxfp8: the output layer's GEMMs in FP8 too (Megatron's TE LM head; otherwise it stays in "
   "--bf16)",
   [](const Args& a, const char* f, ModelConfig& c) { c.fp8.output_proj = a.on(f); }},
  {"--num-layers-at-start-in-bf16", Kind::value, "1", "with --first-last-layers-bf16: decoder layers at the start",
   [](const Args& a, const char* f, ModelConfig& c) { c.fp8.num_layers_at_start_in_bf16 = a.i64(f); }},
  {"--num-layers-at-end-in-bf16", Kind::value, "1", "with --first-last-layers-bf16: decoder layers at the end",
   [](const Args& a, const char* f, ModelConfig& c) { c.fp8.num_layers_at_end_in_bf16 = a.i64(f); }},
  // Attention sinks and sliding windows (gpt-oss).
  {"--softmax-type", Kind::value, "vanilla",
   "vanilla | off-by-one (a fixed exp(0) in every softmax denominator) | learnable (a learned sink logit per head: "
   "self_attention.core_attention.softmax_offset)",
   softmax_type},
  {"--window-size", Kind::value, "",
   "sliding-window attention '(left, right)': the query at position p sees keys p - left .. p; right must be 0 "
   "(causal; -1 reads as 0), left -1 means no window (unset: none)",
   window_size},
  {"--window-attn-skip-freq", Kind::value, "",
   "which layers get the window: N (layer_number, 1-based, unless layer_number % N == 0) or a list of 0/1 per layer, "
   "e.g. '([1]*3+[0]*1)*2' (unset: every layer)",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.window_attn_skip_freq = a.str(f);
     if (a.given(f) && c.window_attn_skip_freq.empty()) MOECORE_FAIL(f, " is empty");
     if (c.window_size >= 0) (void)c.window_layers();  // names the flag on a bad pattern
   }},
  {"--moe-layer-freq", Kind::value, "1",
   "MoE layer pattern: N (layer i is MoE when i % N == 0) or a list expression, e.g. '[0]*3+[1]*58'",
   [](const Args& a, const char* f, ModelConfig& c) {
     c.moe_layer_freq = a.str(f);
     (void)model::parse_layer_pattern(c.moe_layer_freq, a.i64("--num-layers"), f);  // checked even for dense models
   }},
  // MoE ECHO (Megatron PR #2368's flags) and the static received-token capacity (Megatron mainline's name).
  {"--moe-enable-echo", Kind::flag, "", "clone hot experts onto under-loaded EP ranks each step (needs the alltoall "
   "token dispatcher and EP > 1)", moe_on<&moe::MoeConfig::enable_echo>},
  {"--moe-num-echo-experts", Kind::value, "", "global clone slots, a multiple of --expert-model-parallel-size",
   moe_i64_or_unset<&moe::MoeConfig::num_echo_experts>},
  {"--moe-echo-expert-dispatcher-type", Kind::value, "alltoall",
   "how clone weights travel: alltoall (host-sized; the PR's default hybridep is a GPU dispatcher)",
   [](const Args& a, const char* f, ModelConfig& c) { c.moe.echo_dispatcher_type = a.str(f); }},
  {"--moe-echo-recompute-expert-dispatch", Kind::flag, "",
   "drop clone weights after forward and fetch them again in backward (one clone buffer for all layers)",
   moe_on<&moe::MoeConfig::echo_recompute_expert_dispatch>},
  {"--moe-echo-enable-random-offloading", Kind::flag, "", "random clones each step (debugging ECHO's equivalence)",
   moe_on<&moe::MoeConfig::echo_random_offloading>},
  {"--moe-received-token-capacity", Kind::value, "",
   "static token-expert rows each EP rank can receive, x the average; overflow re-runs the step synced (unset: "
   "synced dropless)", received_token_capacity},
  {"--moe-expert-rank-capacity-factor", Kind::value, "", "Megatron mainline's name of --moe-received-token-capacity",
   received_token_capacity},
};
// clang-format on

// What each numeric model flag accepts, checked at start-up whether or not the model uses the flag (Args::domain).
// Enumerations are checked by their readers above, which every command runs; the other value flags are free text
// with their own parsers (--moe-layer-freq).
const std::pair<const char*, FlagDomain> kModelFlagDomains[] = {
    {"--num-layers", FlagDomain::integer(1, 1e5)},
    {"--attention-backend", FlagDomain::one_of({"flash", "fused", "unfused", "local", "auto"})},
    {"--fp8-format", FlagDomain::one_of({"e4m3", "hybrid"})},
    {"--fp8-recipe", FlagDomain::one_of({"tensorwise", "delayed", "mxfp8", "blockwise", "custom"})},
    {"--fp8-margin", FlagDomain::integer(0, 64)},
    {"--fp8-amax-history-len", FlagDomain::integer(1, 1 << 20)},
    {"--fp8-amax-compute-algo", FlagDomain::one_of({"most_recent", "max"})},
    {"--num-layers-at-start-in-bf16", FlagDomain::integer(0, 1e9)},
    {"--num-layers-at-end-in-bf16", FlagDomain::integer(0, 1e9)},
    {"--recompute-granularity", FlagDomain::one_of({"full", "selective"})},
    {"--softmax-type", FlagDomain::one_of({"vanilla", "off-by-one", "learnable"})},
    {"--recompute-method", FlagDomain::one_of({"uniform", "block"})},
    {"--recompute-num-layers", FlagDomain::integer(1, 1e5)},
    {"--hidden-size", FlagDomain::integer(1)},
    {"--num-attention-heads", FlagDomain::integer(1)},
    {"--num-query-groups", FlagDomain::integer(1)},
    {"--kv-channels", FlagDomain::integer(1)},
    {"--ffn-hidden-size", FlagDomain::integer(1)},
    {"--vocab-size", FlagDomain::integer(1)},
    {"--seq-length", FlagDomain::integer(1)},
    {"--max-position-embeddings", FlagDomain::integer(1)},
    {"--rotary-base", FlagDomain::positive_number()},
    {"--rotary-percent", FlagDomain::positive_number(1.0)},
    {"--glu-linear-offset", FlagDomain::number(-1e3, 1e3)},
    {"--activation-func-clamp-value", FlagDomain::positive_number()},
    {"--hidden-dropout", FlagDomain::fraction()},
    {"--attention-dropout", FlagDomain::fraction()},
    {"--norm-epsilon", FlagDomain::positive_number()},
    {"--init-method-std", FlagDomain::number(0.0)},
    {"--q-lora-rank", FlagDomain::integer(1)},
    {"--kv-lora-rank", FlagDomain::integer(1)},
    {"--qk-head-dim", FlagDomain::integer(1)},
    {"--qk-pos-emb-head-dim", FlagDomain::integer(1)},
    {"--v-head-dim", FlagDomain::integer(1)},
    {"--rotary-scaling-factor", FlagDomain::positive_number()},
    {"--mscale", FlagDomain::number(0.0)},
    {"--mscale-all-dim", FlagDomain::number(0.0)},
    {"--yarn-original-max-position-embeddings", FlagDomain::integer(1)},
    {"--yarn-beta-fast", FlagDomain::positive_number()},
    {"--yarn-beta-slow", FlagDomain::positive_number()},
    {"--mtp-num-layers", FlagDomain::integer(1, 1e6)},
    {"--mtp-loss-scaling-factor", FlagDomain::number(0.0)},
    {"--num-experts", FlagDomain::integer(1, 1e6)},
    {"--moe-ffn-hidden-size", FlagDomain::integer(1)},
    {"--moe-router-topk", FlagDomain::integer(1, 1e6)},
    {"--moe-aux-loss-coeff", FlagDomain::numbers(0.0)},
    {"--moe-z-loss-coeff", FlagDomain::number(0.0)},
    {"--moe-input-jitter-eps", FlagDomain::fraction()},
    {"--moe-router-topk-scaling-factor", FlagDomain::positive_number()},
    {"--moe-router-num-groups", FlagDomain::integer(1, 1e6)},
    {"--moe-router-group-topk", FlagDomain::integer(1, 1e6)},
    {"--moe-router-group-score-topk", FlagDomain::integer(1, 1e6)},
    {"--moe-router-bias-update-rate", FlagDomain::number(0.0)},
    {"--moe-expert-capacity-factor", FlagDomain::positive_number()},
    {"--moe-shared-expert-intermediate-size", FlagDomain::integer(1)},
    {"--moe-num-echo-experts", FlagDomain::integer(1, 1e6)},
    {"--moe-echo-expert-dispatcher-type", FlagDomain::one_of({"alltoall", "hybridep"})},
    {"--moe-router-force-biased", FlagDomain::number(-1e3, 1e3)},
    {"--moe-received-token-capacity", FlagDomain::positive_number()},
    {"--moe-expert-rank-capacity-factor", FlagDomain::positive_number()},
};

}  // namespace

// Defaults are Megatron's (megatron/training/arguments.py); "" is Megatron's None (unset). Flags Megatron requires
// keep a small default from `d` for quick experiments, and --help says so.
bool model_flags_given(const Args& a) {
  for (const ModelFlag& f : kModelFlags)
    if ((f.kind == Kind::value || f.kind == Kind::list || f.kind == Kind::flag) && a.given(f.name)) return true;
  return false;
}

void add_model_flags(Args& a, const model::ModelConfig& d) {
  for (const ModelFlag& f : kModelFlags) {
    switch (f.kind) {
      case Kind::value:
        if (f.required)
          a.option(f.name, std::to_string(d.*f.required), std::string(f.help) + " (Megatron: required)");
        else
          a.option(f.name, f.def, f.help);
        break;
      case Kind::list:
        a.list_option(f.name, f.help);
        break;
      case Kind::flag:
        a.flag(f.name, f.help);
        break;
    }
  }
  for (const auto& [name, domain] : kModelFlagDomains) a.domain(name, domain);
}

model::ModelConfig model_config_from(const Args& a, int64_t tokenizer_vocab, int64_t tokenizer_ids) {
  model::ModelConfig c;
  for (const ModelFlag& f : kModelFlags)
    if (f.apply) f.apply(a, f.name, c);
  c.vocab_size = a.i64_or("--vocab-size", 0);
  if (c.vocab_size == 0) c.vocab_size = tokenizer_vocab;
  const int64_t need = tokenizer_ids >= 0 ? tokenizer_ids : tokenizer_vocab;
  if (need > 0 && c.vocab_size < need)
    MOECORE_FAIL("--vocab-size (", c.vocab_size, ") is smaller than the tokenizer's vocabulary (", need, ")");
  if (c.add_bias_linear && c.moe.enabled() && c.moe.shared_expert_intermediate_size > 0)
    MOECORE_FAIL(
        "--moe-shared-expert-intermediate-size with linear biases: shared experts carry no biases (as in "
        "Megatron); pass --disable-bias-linear");
  if (c.fp8.on && c.fp8.recipe == nn::Fp8Recipe::mxfp8 && c.moe.router_padding_alignment > 0)
    c.moe.router_padding_alignment = 32;  // MXFP8's block (Megatron's get_fp8_align_size)
  c.validate();
  return c;
}

}  // namespace moecore::apps
