#include "apps/model_flags.h"

#include <cstdio>
#include <string>
#include <vector>

#include "moecore/core/error.h"

namespace moecore::apps {

// Defaults are Megatron's (megatron/training/arguments.py); "" is Megatron's None (unset). Flags Megatron requires
// keep a small default here for quick experiments, and --help says so.
void add_model_flags(Args& a, const model::ModelConfig& d) {
  const std::string req = " (Megatron: required)";
  a.option("--num-layers", std::to_string(d.num_layers), "transformer layers" + req)
      .option("--hidden-size", std::to_string(d.hidden_size), "hidden size H" + req)
      .option("--num-attention-heads", std::to_string(d.num_attention_heads), "query heads" + req)
      .flag("--group-query-attention", "grouped-query attention with --num-query-groups key/value heads")
      .option("--num-query-groups", "1", "key/value heads; read only with --group-query-attention (as Megatron)")
      .option("--kv-channels", "", "head dim (unset: hidden / heads)")
      .option("--ffn-hidden-size", "", "MLP hidden size (unset: 4 * hidden)")
      .option("--vocab-size", "", "vocabulary size (unset: the tokenizer's, padded)")
      .option("--seq-length", std::to_string(d.seq_length), "tokens per sample" + req)
      .option("--max-position-embeddings", "",
              "rows of the learned position table; must be >= --seq-length (Megatron: required; unset here: "
              "--seq-length)")
      .option("--position-embedding-type", "learned_absolute", "learned_absolute | rope | none")
      .flag("--no-position-embedding", "Megatron's switch for learned positions: a no-op with rope, an error otherwise")
      .option("--rotary-base", "10000", "RoPE base")
      .option("--rotary-percent", "1.0", "share of each head's channels RoPE rotates, (0, 1]")
      .flag("--disable-bias-linear", "no biases on the linear layers (Megatron adds them by default)")
      .flag("--qk-layernorm", "QK-norm: the --normalization norm over each query and key head before RoPE")
      .flag("--add-qkv-bias", "a bias on linear_qkv only (Qwen2-style), with --disable-bias-linear")
      .option("--hidden-dropout", "0.1", "dropout on the embedding output and both residual branches, [0, 1)")
      .option("--attention-dropout", "0.1", "dropout on the attention probabilities, [0, 1)")
      .option("--norm-epsilon", "1e-05", "norm epsilon")
      .option("--init-method-std", "0.02", "std of the normal weight init")
      .option("--normalization", "LayerNorm", "LayerNorm | RMSNorm")
      .flag("--swiglu", "SwiGLU MLP (without it: GeLU, as in Megatron)")
      .flag("--untie-embeddings-and-output-weights", "separate output layer (without it the embedding is shared)")
      .flag("--bf16", "bf16 compute with fp32 master weights")
      .accepted("--use-mcore-models", "Megatron-Core models (deprecated in Megatron; the only kind here)")
      .option("--transformer-impl", "transformer_engine",
              "transformer_engine | local (accepted for Megatron scripts; does not change numerics here)")
      .accepted("--no-masked-softmax-fusion", "unfused masked softmax")
      .accepted("--no-rope-fusion", "unfused RoPE")
      .accepted("--no-bias-swiglu-fusion", "unfused bias + SwiGLU")
      .accepted("--no-bias-gelu-fusion", "unfused bias + GeLU")
      .accepted("--no-bias-dropout-fusion", "unfused bias + dropout + residual")
      .accepted("--no-gradient-accumulation-fusion", "unfused weight-gradient accumulation")
      .accepted("--cross-entropy-loss-fusion", "fused cross-entropy (the loss here is always fused)")
      .accepted("--use-flash-attn", "flash attention (the attention here is always flash-style)")
      .flag("--multi-latent-attention",
            "multi-latent attention (MLA, DeepSeek-V2/V3); --qk-layernorm then norms the "
            "q and kv latents")
      .option("--q-lora-rank", "", "MLA: rank of the q down-projection (unset: q projected directly, as V2-Lite)")
      .option("--kv-lora-rank", "32", "MLA: rank of the kv down-projection")
      .option("--qk-head-dim", "128", "MLA: q/k channels per head without RoPE")
      .option("--qk-pos-emb-head-dim", "64", "MLA: q/k channels per head with RoPE")
      .option("--v-head-dim", "128", "MLA: value channels per head")
      .unsupported_switch("--qk-l2-norm", "QK L2-norm")
      .option("--rope-type", "", "rope | yarn (unset: yarn with MLA, as Megatron's MLATransformerConfig; else rope)")
      .option("--rotary-scaling-factor", "1.0", "YaRN: context extension factor")
      .option("--mscale", "1.0", "YaRN: mscale (cos/sin scale mscale(factor, mscale) / mscale(factor, all-dim))")
      .option("--mscale-all-dim", "0.0", "YaRN: mscale_all_dim (also scales the MLA softmax by its mscale^2)")
      .option("--yarn-original-max-position-embeddings", "", "YaRN: the original context (unset: 4096)")
      .option("--yarn-beta-fast", "", "YaRN: beta_fast (unset: 32)")
      .option("--yarn-beta-slow", "", "YaRN: beta_slow (unset: 1)")
      .flag("--yarn-correction-range-round-to-int", "YaRN: floor/ceil the correction range (the default)")
      .flag("--no-yarn-correction-range-round-to-int", "YaRN: keep the correction range fractional")
      .unsupported_switch("--rotary-interleaved", "interleaved RoPE")
      .unsupported_switch("--apply-layernorm-1p", "zero-centred (1 + w) LayerNorm")
      .unsupported_switch("--apply-residual-connection-post-layernorm", "post-LayerNorm residuals")
      .unsupported_switch("--openai-gelu", "the tanh GeLU approximation")
      .unsupported_switch("--squared-relu", "squared-ReLU MLPs")
      .option("--mtp-num-layers", "", "multi-token prediction depths (unset: none)")
      .option("--mtp-loss-scaling-factor", "0.1", "weight of the MTP losses, divided by --mtp-num-layers")
      .unsupported_switch("--fp16", "fp16 training (use --bf16)")
      .unsupported("--fp8-format", "", "FP8 training")
      .unsupported("--fp8-recipe", "delayed", "FP8 training")
      .unsupported_switch("--recompute-activations", "activation recompute")
      .unsupported("--recompute-granularity", "", "activation recompute")
      .unsupported("--recompute-method", "", "activation recompute")
      .unsupported("--recompute-num-layers", "", "activation recompute")
      .unsupported_switch("--moe-layer-recompute", "MoE-layer recompute")
      .unsupported_switch("--reset-position-ids", "position ids that restart at each document")
      .unsupported_switch("--reset-attention-mask", "attention masks that stop at document boundaries");
  add_moe_flags(a);
}

void add_moe_flags(Args& a) {
  a.option("--num-experts", "", "routed experts per MoE layer (unset: dense model)")
      .option("--moe-ffn-hidden-size", "", "expert MLP hidden size (unset: --ffn-hidden-size)")
      .option("--moe-router-topk", "2", "experts per token")
      .option("--moe-router-load-balancing-type", "aux_loss",
              "aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none, or a comma-separated list")
      .option("--moe-aux-loss-coeff", "0.0", "balancing-loss coefficient, or one per type (comma-separated)")
      .option("--moe-z-loss-coeff", "", "router z-loss coefficient (unset: off)")
      .option("--moe-input-jitter-eps", "", "multiplicative router-input jitter (unset: off)")
      .option("--moe-router-score-function", "softmax", "softmax | sigmoid | sqrtsoftplus")
      .flag("--moe-router-pre-softmax", "softmax over all experts before top-k")
      .option("--moe-router-topk-scaling-factor", "", "scale of the top-k weights (unset: none)")
      .option("--moe-router-dtype", "",
              "router logits/probs precision: fp32 | fp64 (unset: fp32 here; Megatron then uses the input dtype)")
      .option("--moe-router-num-groups", "", "expert groups for group-limited routing (unset: none)")
      .option("--moe-router-group-topk", "", "groups each token may use (unset: none)")
      .flag("--moe-router-enable-expert-bias", "aux-loss-free balancing bias (sigmoid / sqrtsoftplus)")
      .option("--moe-router-bias-update-rate", "0.001", "expert-bias step per optimizer step")
      .flag("--moe-router-force-load-balancing", "random router logits (benchmarking only)")
      .option("--moe-expert-capacity-factor", "", "expert capacity factor (unset: dropless)")
      .option("--moe-token-drop-policy", "probs", "probs | position")
      .flag("--moe-pad-expert-input-to-capacity", "pad every expert to its capacity")
      .flag("--moe-router-padding-for-fp8", "pad per-expert token counts to multiples of 16 (needs FP8)")
      .accepted("--moe-grouped-gemm", "grouped-GEMM experts (always used here unless --no-moe-grouped-gemm)")
      .flag("--no-moe-grouped-gemm", "sequential per-expert reference instead of the grouped GEMM (moecore only)")
      .accepted("--moe-permute-fusion", "fused token permutation")
      .accepted("--moe-router-fusion", "fused router kernels")
      .option("--moe-shared-expert-intermediate-size", "", "shared expert hidden size (unset: none)")
      .flag("--moe-shared-expert-gate", "sigmoid gate on the shared expert output")
      .option("--moe-layer-freq", "1",
              "MoE layer pattern: N (layer i is MoE when i % N == 0) or a list expression, e.g. '[0]*3+[1]*58'")
      .unsupported_switch("--moe-shared-expert-overlap", "overlapping the shared expert with dispatch")
      .unsupported_switch("--moe-apply-probs-on-input", "routing probabilities applied to the expert input")
      .unsupported_switch("--moe-enable-deepep", "the DeepEP dispatcher");
}

namespace {
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
}  // namespace

moe::MoeConfig moe_config_from(const Args& a, bool swiglu) {
  moe::MoeConfig m;
  m.num_experts = a.i64_or("--num-experts", 0);
  m.ffn_hidden_size = a.i64_or("--moe-ffn-hidden-size", 0);
  m.router_topk = a.i64("--moe-router-topk");
  m.load_balancing_type.clear();
  for (const auto& t : split_list(a.str("--moe-router-load-balancing-type")))
    m.load_balancing_type.push_back(moe::parse_load_balancing(t));
  m.aux_loss_coeff.clear();
  for (const auto& c : split_list(a.str("--moe-aux-loss-coeff"))) m.aux_loss_coeff.push_back(std::stof(c));
  m.z_loss_coeff = static_cast<float>(a.f64_or("--moe-z-loss-coeff", 0.0));
  m.input_jitter_eps = static_cast<float>(a.f64_or("--moe-input-jitter-eps", 0.0));
  m.score_function = moe::parse_score_function(a.str("--moe-router-score-function"));
  m.pre_softmax = a.on("--moe-router-pre-softmax");
  m.topk_scaling_factor = static_cast<float>(a.f64_or("--moe-router-topk-scaling-factor", 0.0));
  const std::string rd = a.str("--moe-router-dtype").empty() ? "fp32" : a.str("--moe-router-dtype");
  if (rd != "fp32" && rd != "fp64") MOECORE_FAIL("--moe-router-dtype '", rd, "' is not one of fp32, fp64");
  m.router_dtype = rd == "fp64" ? DType::f64 : DType::f32;
  m.num_groups = a.i64_or("--moe-router-num-groups", 0);
  m.group_topk = a.i64_or("--moe-router-group-topk", 0);
  m.enable_expert_bias = a.on("--moe-router-enable-expert-bias");
  m.bias_update_rate = static_cast<float>(a.f64("--moe-router-bias-update-rate"));
  m.force_load_balancing = a.on("--moe-router-force-load-balancing");
  m.capacity_factor = static_cast<float>(a.f64_or("--moe-expert-capacity-factor", 0.0));
  if (a.given("--moe-expert-capacity-factor") && !(m.capacity_factor > 0.0f))
    MOECORE_FAIL("--moe-expert-capacity-factor (", a.str("--moe-expert-capacity-factor"),
                 ") must be positive (leave it unset for dropless)");
  const std::string pol = a.str("--moe-token-drop-policy");
  if (pol != "probs" && pol != "position")
    MOECORE_FAIL("--moe-token-drop-policy '", pol, "' is not one of probs, position");
  m.drop_policy = pol == "position" ? moe::DropPolicy::position : moe::DropPolicy::probs;
  m.pad_expert_input_to_capacity = a.on("--moe-pad-expert-input-to-capacity");
  m.router_padding_alignment = a.on("--moe-router-padding-for-fp8") ? 16 : 0;
  if (a.on("--moe-grouped-gemm") && a.on("--no-moe-grouped-gemm"))
    MOECORE_FAIL("flags --moe-grouped-gemm and --no-moe-grouped-gemm exclude each other");
  m.grouped_gemm = !a.on("--no-moe-grouped-gemm");
  m.shared_expert_intermediate_size = a.i64_or("--moe-shared-expert-intermediate-size", 0);
  m.shared_expert_gate = a.on("--moe-shared-expert-gate");
  m.swiglu = swiglu;
  m.validate(/*fp8=*/false);
  return m;
}

model::ModelConfig model_config_from(const Args& a, int64_t tokenizer_vocab) {
  model::ModelConfig c;
  c.num_layers = a.i64("--num-layers");
  c.hidden_size = a.i64("--hidden-size");
  c.num_attention_heads = a.i64("--num-attention-heads");
  // Megatron reads --num-query-groups only with --group-query-attention; otherwise every head has its own k/v.
  c.num_query_groups = a.on("--group-query-attention") ? a.i64("--num-query-groups") : 0;
  if (a.on("--group-query-attention") && c.num_query_groups <= 0)
    MOECORE_FAIL("--num-query-groups (", c.num_query_groups, ") must be positive with --group-query-attention");
  if (!a.on("--group-query-attention") && a.given("--num-query-groups") && a.i64("--num-query-groups") != 1)
    std::fprintf(stderr,
                 "warning: --num-query-groups %lld is ignored without --group-query-attention (as in "
                 "Megatron): every attention head has its own key/value head\n",
                 static_cast<long long>(a.i64("--num-query-groups")));
  c.kv_channels = a.i64_or("--kv-channels", 0);
  c.ffn_hidden_size = a.i64_or("--ffn-hidden-size", 0);
  c.vocab_size = a.i64_or("--vocab-size", 0);
  if (c.vocab_size == 0) c.vocab_size = tokenizer_vocab;
  if (tokenizer_vocab > 0 && c.vocab_size < tokenizer_vocab)
    MOECORE_FAIL("--vocab-size (", c.vocab_size, ") is smaller than the tokenizer's vocabulary (", tokenizer_vocab,
                 ")");
  c.seq_length = a.i64("--seq-length");
  c.max_position_embeddings = a.i64_or("--max-position-embeddings", 0);
  if (a.given("--max-position-embeddings") && c.max_position_embeddings <= 0)
    MOECORE_FAIL("--max-position-embeddings (", c.max_position_embeddings, ") must be positive");
  const std::string pos = a.str("--position-embedding-type");
  if (pos == "learned_absolute")
    c.position_embedding_type = model::PositionEmbedding::learned_absolute;
  else if (pos == "rope")
    c.position_embedding_type = model::PositionEmbedding::rope;
  else if (pos == "none")
    c.position_embedding_type = model::PositionEmbedding::none;
  else if (pos == "mrope" || pos == "relative" || pos == "yarn")
    MOECORE_FAIL("--position-embedding-type ", pos, " is not supported yet (learned_absolute, rope or none)");
  else
    MOECORE_FAIL("--position-embedding-type '", pos, "' is not one of learned_absolute, rope, none");
  if (a.on("--no-position-embedding") && !c.rope())
    MOECORE_FAIL(
        "--no-position-embedding needs --position-embedding-type rope (as in Megatron); for no position "
        "embedding at all use --position-embedding-type none");
  c.rotary_base = static_cast<float>(a.f64("--rotary-base"));
  c.rotary_percent = static_cast<float>(a.f64("--rotary-percent"));
  if (!(c.rotary_percent > 0.0f && c.rotary_percent <= 1.0f))
    MOECORE_FAIL("--rotary-percent (", a.str("--rotary-percent"), ") must be in (0, 1]");
  c.add_bias_linear = !a.on("--disable-bias-linear");
  c.add_qkv_bias = a.on("--add-qkv-bias");
  c.qk_layernorm = a.on("--qk-layernorm");
  c.multi_latent_attention = a.on("--multi-latent-attention");
  c.mtp_num_layers = a.i64_or("--mtp-num-layers", 0);
  if (a.given("--mtp-num-layers") && c.mtp_num_layers <= 0)
    MOECORE_FAIL("--mtp-num-layers (", a.str("--mtp-num-layers"), ") must be positive (leave it unset for none)");
  c.mtp_loss_scaling_factor = static_cast<float>(a.f64("--mtp-loss-scaling-factor"));
  c.q_lora_rank = a.i64_or("--q-lora-rank", 0);
  if (a.given("--q-lora-rank") && c.q_lora_rank <= 0)
    MOECORE_FAIL("--q-lora-rank (", a.str("--q-lora-rank"), ") must be positive (leave it unset for no q LoRA)");
  c.kv_lora_rank = a.i64("--kv-lora-rank");
  c.qk_head_dim = a.i64("--qk-head-dim");
  c.qk_pos_emb_head_dim = a.i64("--qk-pos-emb-head-dim");
  c.v_head_dim = a.i64("--v-head-dim");
  const std::string rope_type = a.str("--rope-type");
  if (!rope_type.empty() && rope_type != "rope" && rope_type != "yarn")
    MOECORE_FAIL("--rope-type '", rope_type, "' is not one of rope, yarn");
  c.yarn = rope_type == "yarn" || (rope_type.empty() && c.multi_latent_attention);
  c.yarn_config.scaling_factor = static_cast<float>(a.f64("--rotary-scaling-factor"));
  c.yarn_config.mscale = static_cast<float>(a.f64("--mscale"));
  c.yarn_config.mscale_all_dim = static_cast<float>(a.f64("--mscale-all-dim"));
  c.yarn_config.original_max_position_embeddings = a.i64_or("--yarn-original-max-position-embeddings", 4096);
  c.yarn_config.beta_fast = static_cast<float>(a.f64_or("--yarn-beta-fast", 32.0));
  c.yarn_config.beta_slow = static_cast<float>(a.f64_or("--yarn-beta-slow", 1.0));
  if (a.on("--yarn-correction-range-round-to-int") && a.on("--no-yarn-correction-range-round-to-int"))
    MOECORE_FAIL(
        "flags --yarn-correction-range-round-to-int and --no-yarn-correction-range-round-to-int exclude "
        "each other");
  c.yarn_config.correction_range_round_to_int = !a.on("--no-yarn-correction-range-round-to-int");
  for (const char* f : {"--hidden-dropout", "--attention-dropout"}) {
    const double p = a.f64(f);
    if (!(p >= 0.0 && p < 1.0)) MOECORE_FAIL(f, " (", a.str(f), ") must be in [0, 1)");
  }
  c.hidden_dropout = static_cast<float>(a.f64("--hidden-dropout"));
  c.attention_dropout = static_cast<float>(a.f64("--attention-dropout"));
  const std::string impl = a.str("--transformer-impl");
  if (impl != "transformer_engine" && impl != "local" && impl != "inference_optimized")
    MOECORE_FAIL("--transformer-impl '", impl, "' is not one of transformer_engine, local, inference_optimized");
  c.norm_epsilon = static_cast<float>(a.f64("--norm-epsilon"));
  c.init_method_std = static_cast<float>(a.f64("--init-method-std"));
  const std::string norm = a.str("--normalization");
  if (norm != "RMSNorm" && norm != "LayerNorm")
    MOECORE_FAIL("--normalization '", norm, "' is not one of RMSNorm, LayerNorm");
  c.normalization = norm == "LayerNorm" ? model::Normalization::layernorm : model::Normalization::rmsnorm;
  c.swiglu = a.on("--swiglu");
  c.untie_embeddings_and_output_weights = a.on("--untie-embeddings-and-output-weights");
  c.compute_dtype = a.on("--bf16") ? DType::bf16 : DType::f32;
  c.moe = moe_config_from(a, c.swiglu);
  c.moe_layer_freq = a.str("--moe-layer-freq");
  if (c.add_bias_linear && c.moe.enabled() && c.moe.shared_expert_intermediate_size > 0)
    MOECORE_FAIL(
        "--moe-shared-expert-intermediate-size with linear biases: shared experts carry no biases (as in "
        "Megatron); pass --disable-bias-linear");
  c.validate();
  return c;
}

}  // namespace moecore::apps
