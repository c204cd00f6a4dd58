#include "moecore/model/config.h"

#include <cmath>

#include "moecore/core/error.h"
#include "moecore/model/layer_pattern.h"

namespace moecore::model {

void RecomputeConfig::validate() const {
  if (granularity.empty()) {
    if (!modules.empty()) MOECORE_FAIL("--recompute-modules needs --recompute-granularity selective");
    if (!method.empty() || num_layers != 0)
      MOECORE_FAIL("--recompute-method (", method.empty() ? "unset" : method, ") and --recompute-num-layers (",
                   num_layers, ") need --recompute-granularity full");
    return;
  }
  if (granularity == "selective") {
    if (!method.empty() || num_layers != 0)
      MOECORE_FAIL("--recompute-method (", method.empty() ? "unset" : method, ") and --recompute-num-layers (",
                   num_layers, ") are for --recompute-granularity full, not selective");
    const std::vector<std::string> megatron = {"core_attn", "moe_act", "layernorm",     "mla_up_proj",
                                               "mlp",       "moe",     "shared_experts"};
    // (unset: Megatron's default, core_attn)
    for (const std::string& m : modules.empty() ? std::vector<std::string>{"core_attn"} : modules) {
      if (std::find(megatron.begin(), megatron.end(), m) == megatron.end())
        MOECORE_FAIL("--recompute-modules: '", m,
                     "' is not one of core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts");
    }
    return;
  }
  if (!modules.empty()) MOECORE_FAIL("--recompute-modules needs --recompute-granularity selective");
  if (granularity != "full") MOECORE_FAIL("--recompute-granularity '", granularity, "' is not one of full, selective");
  if (method != "uniform" && method != "block")
    MOECORE_FAIL("--recompute-granularity full needs --recompute-method uniform or block, got '",
                 method.empty() ? "unset" : method, "'");
  if (num_layers < 1) MOECORE_FAIL("--recompute-granularity full needs --recompute-num-layers >= 1, got ", num_layers);
}

// The sizes, positions, dropouts, dtype and norm.
void ModelConfig::validate_sizes() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) MOECORE_FAIL("model config: ", name, " (", v, ") must be positive");
  };
  positive("num_layers", num_layers);
  positive("hidden_size", hidden_size);
  positive("num_attention_heads", num_attention_heads);
  positive("vocab_size", vocab_size);
  positive("seq_length", seq_length);
  if (num_query_groups < 0 || kv_channels < 0 || ffn_hidden_size < 0)
    MOECORE_FAIL("model config: num_query_groups (", num_query_groups, "), kv_channels (", kv_channels,
                 ") and ffn_hidden_size (", ffn_hidden_size, ") must not be negative");
  if (num_attention_heads % query_groups() != 0)
    MOECORE_FAIL("model config: num_attention_heads (", num_attention_heads,
                 ") must be divisible by num_query_groups (", query_groups(), ")");
  if (!kv_channels && !multi_latent_attention && hidden_size % num_attention_heads != 0)
    MOECORE_FAIL("model config: hidden_size (", hidden_size, ") must be divisible by num_attention_heads (",
                 num_attention_heads, ") unless kv_channels is set");
  if (!(rotary_percent > 0.0f && rotary_percent <= 1.0f))
    MOECORE_FAIL("model config: --rotary-percent (", rotary_percent, ") must be in (0, 1]");
  if (rope() && (rotary_dim() < 2 || rotary_dim() % 2 != 0))
    MOECORE_FAIL("model config: RoPE rotates int(head dim ", head_dim(), " x --rotary-percent ", rotary_percent,
                 ") = ", rotary_dim(), " channels per head; that must be even and at least 2");
  for (auto [name, p] : {std::pair{"--hidden-dropout", hidden_dropout}, {"--attention-dropout", attention_dropout}})
    if (!(p >= 0.0f && p < 1.0f)) MOECORE_FAIL("model config: ", name, " (", p, ") must be in [0, 1)");
  if (max_position_embeddings < 0)
    MOECORE_FAIL("model config: --max-position-embeddings (", max_position_embeddings, ") must not be negative");
  if (max_positions() < seq_length)  // Megatron asserts this for every position-embedding type
    MOECORE_FAIL("model config: --max-position-embeddings (", max_position_embeddings,
                 ") must be at least --seq-length (", seq_length, ")");
  if (compute_dtype != DType::f32 && compute_dtype != DType::bf16 && compute_dtype != DType::f16)
    MOECORE_FAIL("model config: compute dtype ", dtype_name(compute_dtype), " is not supported (use f32, bf16 or f16)");
  if (!(norm_epsilon > 0.0f)) MOECORE_FAIL("model config: norm_epsilon (", norm_epsilon, ") must be positive");
}

// The attention: QK-norm over heads, MLA, YaRN, sinks and windows.
void ModelConfig::validate_attention() const {
  if (qk_layernorm_over_heads && (!qk_layernorm || multi_latent_attention))
    MOECORE_FAIL("model config: --qk-layernorm-over-heads needs --qk-layernorm and standard attention (not MLA)");
  if (multi_latent_attention && (softmax_type != SoftmaxType::vanilla || window_size >= 0))
    MOECORE_FAIL("model config: --softmax-type (", softmax_type_name(softmax_type), ") and --window-size (",
                 window_size,
                 ") need standard attention: MLA supports vanilla softmax and no window only (Megatron "
                 "asserts window_size None for MLA)");
  if (multi_latent_attention) {
    if (!rope())
      MOECORE_FAIL(
          "model config: --multi-latent-attention applies RoPE to its q/k RoPE channels; pass "
          "--position-embedding-type rope");
    if (q_lora_rank < 0 || kv_lora_rank <= 0 || qk_head_dim <= 0 || v_head_dim <= 0 || qk_pos_emb_head_dim < 2 ||
        qk_pos_emb_head_dim % 2 != 0)
      MOECORE_FAIL("model config: MLA needs --q-lora-rank >= 0 (", q_lora_rank, "), --kv-lora-rank (", kv_lora_rank,
                   "), --qk-head-dim (", qk_head_dim, ") and --v-head-dim (", v_head_dim,
                   ") positive and --qk-pos-emb-head-dim (", qk_pos_emb_head_dim, ") even and at least 2");
    if (rotary_percent != 1.0f)
      MOECORE_FAIL("model config: --rotary-percent (", rotary_percent, ") is not supported with MLA (only 1.0)");
    if (add_bias_linear || add_qkv_bias)
      MOECORE_FAIL("model config: linear biases in MLA are not supported yet; pass --disable-bias-linear");
  }
  if (yarn) {  // MLA's --rope-type yarn, or standard attention's --position-embedding-type yarn
    if (!rope()) MOECORE_FAIL("model config: YaRN is a RoPE variant; it needs rotary positions");
    const YarnConfig& y = yarn_config;
    if (!(y.scaling_factor > 0.0f) || y.original_max_position_embeddings <= 0 || !(y.beta_fast > 0.0f) ||
        !(y.beta_slow > 0.0f))
      MOECORE_FAIL("model config: YaRN needs --rotary-scaling-factor (", y.scaling_factor,
                   "), --yarn-original-max-position-embeddings (", y.original_max_position_embeddings,
                   "), --yarn-beta-fast (", y.beta_fast, ") and --yarn-beta-slow (", y.beta_slow, ") positive");
  }
  if (window_size < -1)
    MOECORE_FAIL("model config: --window-size left (", window_size, ") must be -1 (no window) or >= 0");
  if (mtp_num_layers > 0 && window_size >= 0)
    MOECORE_FAIL("model config: --window-size with --mtp-num-layers is not supported yet (the MTP layers' window)");
}

void ModelConfig::validate() const {
  validate_sizes();
  validate_attention();
  // Megatron's rules for the gated linear unit (transformer_config.py): offset and clamp act on a GLU only; a clamped
  // SwiGLU is for MoE models and takes no offset.
  if (!swiglu && (glu_linear_offset != 0.0f || activation_func_clamp_value > 0.0f))
    MOECORE_FAIL(
        "model config: --glu-linear-offset and --activation-func-clamp-value act on a gated MLP only; pass --swiglu "
        "or --quick-geglu");
  if (swiglu && !quick_geglu && activation_func_clamp_value > 0.0f && (!moe.enabled() || glu_linear_offset != 0.0f))
    MOECORE_FAIL(
        "model config: --activation-func-clamp-value with SwiGLU needs --num-experts and --glu-linear-offset 0 (as "
        "Megatron)");
  if (mtp_num_layers < 0 || !(mtp_loss_scaling_factor >= 0.0f))
    MOECORE_FAIL("model config: --mtp-num-layers (", mtp_num_layers, ") and --mtp-loss-scaling-factor (",
                 mtp_loss_scaling_factor, ") must not be negative");
  if (mtp_num_layers > 0 && position_embedding_type == PositionEmbedding::learned_absolute)
    MOECORE_FAIL(
        "model config: --mtp-num-layers with learned absolute positions is not supported yet; pass "
        "--position-embedding-type rope");
  validate_fp8();
  (void)window_layers();  // validates --window-attn-skip-freq against num_layers
  moe.validate(fp8.on);
  recompute.validate();
  if (recompute.selects("mla_up_proj") && !multi_latent_attention)
    MOECORE_FAIL("--recompute-modules mla_up_proj needs --multi-latent-attention (as in Megatron)");
  if (moe.enabled()) {
    (void)moe_layers();  // validates --moe-layer-freq against num_layers
    if (moe.swiglu != swiglu || !(moe.glu == glu_params()))
      MOECORE_FAIL(
          "model config: the experts' activation must match the model's (--swiglu, --quick-geglu, "
          "--glu-linear-offset and --activation-func-clamp-value apply to both)");
  }
}

float ModelConfig::mla_softmax_scale_mult() const {
  if (!yarn) return 1.0f;
  const double s = yarn_config.scaling_factor, m = yarn_config.mscale_all_dim;
  const double ms = s <= 1.0 ? 1.0 : 0.1 * m * std::log(s) + 1.0;  // Megatron's _yarn_get_mscale
  return static_cast<float>(ms * ms);
}

std::vector<bool> ModelConfig::moe_layers() const {
  if (!moe.enabled()) return std::vector<bool>(static_cast<size_t>(num_layers), false);
  return parse_layer_pattern(moe_layer_freq, num_layers, "--moe-layer-freq");
}

std::vector<bool> ModelConfig::window_layers() const {
  const size_t L = static_cast<size_t>(num_layers);
  const std::string& f = window_attn_skip_freq;
  std::vector<bool> out(L, window_size >= 0);
  if (window_size < 0 || f.empty()) return out;
  if (f.find_first_not_of("0123456789 ") == std::string::npos) {  // N: layer_number % N != 0 (1-based), as Megatron
    const int64_t n = std::stoll(f);
    if (n < 1) MOECORE_FAIL("--window-attn-skip-freq (", f, ") must be a positive integer or a list of 0/1 per layer");
    for (size_t l = 0; l < L; ++l) out[l] = static_cast<int64_t>(l + 1) % n != 0;
    return out;
  }
  return parse_layer_pattern(f, num_layers, "--window-attn-skip-freq");
}

const char* softmax_type_name(SoftmaxType t) {
  return t == SoftmaxType::vanilla ? "vanilla" : t == SoftmaxType::off_by_one ? "off-by-one" : "learnable";
}

std::string ModelConfig::summary() const {
  const char* pos = position_embedding_type == PositionEmbedding::rope               ? ", rope"
                    : position_embedding_type == PositionEmbedding::learned_absolute ? ", learned positions"
                                                                                     : ", no positions";
  return detail::str_cat(
      normalization == Normalization::layernorm ? "LayerNorm" : "RMSNorm", pos,
      rope() && rotary_percent < 1.0f ? detail::str_cat(" (", rotary_dim(), " of ", head_dim(), " ch)") : std::string(),
      qkv_bias() ? (add_bias_linear ? ", biases" : ", qkv bias") : "", qk_layernorm ? ", qk-norm" : "",
      hidden_dropout > 0 || attention_dropout > 0
          ? detail::str_cat(", dropout ", hidden_dropout, "/", attention_dropout)
          : std::string(),
      ", layers ", num_layers, ", hidden ", hidden_size, ", heads ", num_attention_heads,
      multi_latent_attention
          ? detail::str_cat(" (MLA: q_lora ", q_lora_rank, ", kv_lora ", kv_lora_rank, ", qk ", qk_head_dim, "+",
                            qk_pos_emb_head_dim, ", v ", v_head_dim,
                            yarn ? detail::str_cat(", yarn x", yarn_config.scaling_factor) : std::string(), ")")
          : detail::str_cat(" (kv ", query_groups(), ", dim ", head_dim(), ")"),
      ", ffn ", ffn(), swiglu ? " swiglu" : " gelu", ", vocab ", vocab_size, ", seq ", seq_length,
      untie_embeddings_and_output_weights ? ", untied" : ", tied", ", ", dtype_name(compute_dtype),
      moe.enabled() ? detail::str_cat(", MoE ", moe.num_experts, " experts top-", moe.router_topk, " ffn ", moe_ffn(),
                                      " layer-freq ", moe_layer_freq)
                    : std::string(),
      mtp_num_layers ? detail::str_cat(", MTP ", mtp_num_layers, " x ", mtp_loss_scaling_factor) : std::string(),
      softmax_type != SoftmaxType::vanilla ? detail::str_cat(", softmax ", softmax_type_name(softmax_type))
                                           : std::string(),
      window_size >= 0 ? detail::str_cat(", window ", window_size,
                                         window_attn_skip_freq.empty() ? "" : " skip-freq " + window_attn_skip_freq)
                       : std::string());
}

// Megatron's FP8 rules (transformer_config.py) and what moecore's FP8 does not cover yet.
void ModelConfig::validate_fp8() const {
  if (fp8.output_proj && !(fp8.on && fp8.recipe == nn::Fp8Recipe::mxfp8))
    MOECORE_FAIL("model config: --fp8-output-proj needs --fp8-format with --fp8-recipe mxfp8 (Megatron's rule)");
  if (!fp8.on) return;
  if (fp8.recipe == nn::Fp8Recipe::delayed && fp8.first_last_layers_bf16)
    MOECORE_FAIL(
        "model config: --first-last-layers-bf16 is not supported with --fp8-recipe delayed (Megatron's rule: layers "
        "outside the FP8 context break the delayed amax reduction); give --fp8-recipe tensorwise, blockwise or mxfp8");
  if (fp8.amax_history_len < 1)
    MOECORE_FAIL("model config: --fp8-amax-history-len must be >= 1, got ", fp8.amax_history_len);
  if (fp8.margin < 0 || fp8.margin > 64)
    MOECORE_FAIL("model config: --fp8-margin must lie in [0, 64] (the scale is fp8_max * 2^-margin / amax), got ",
                 fp8.margin);
  const int64_t start = fp8.num_layers_at_start_in_bf16, end = fp8.num_layers_at_end_in_bf16;
  if (fp8.first_last_layers_bf16 && (start < 0 || start > num_layers || end < 0 || end > num_layers))
    MOECORE_FAIL("model config: --num-layers-at-start-in-bf16 (", start, ") and --num-layers-at-end-in-bf16 (", end,
                 ") must lie in [0, --num-layers (", num_layers, ")]");
  if (compute_dtype == DType::f16)
    MOECORE_FAIL(
        "model config: --fp8-format with --fp16: FP8 quantises from bf16 or fp32 here; give --bf16 or neither");
}

}  // namespace moecore::model
