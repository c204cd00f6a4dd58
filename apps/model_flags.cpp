#include "apps/model_flags.h"

#include <string>
#include <vector>

#include "moecore/core/error.h"

namespace moecore::apps {

void add_model_flags(Args& a, const model::ModelConfig& d) {
  a.option("--num-layers", std::to_string(d.num_layers), "transformer layers")
      .option("--hidden-size", std::to_string(d.hidden_size), "hidden size H")
      .option("--num-attention-heads", std::to_string(d.num_attention_heads), "query heads")
      .option("--num-query-groups", std::to_string(d.num_query_groups), "key/value heads (GQA); 0 = heads")
      .option("--kv-channels", std::to_string(d.kv_channels), "head dim; 0 = hidden / heads")
      .option("--ffn-hidden-size", std::to_string(d.ffn_hidden_size), "MLP hidden size; 0 = 4 * hidden")
      .option("--vocab-size", std::to_string(d.vocab_size), "vocabulary size (0: the tokenizer's, padded)")
      .option("--seq-length", std::to_string(d.seq_length), "tokens per sample")
      .option("--norm-epsilon", std::to_string(d.norm_epsilon), "RMSNorm epsilon")
      .option("--rotary-base", std::to_string(d.rotary_base), "RoPE base")
      .option("--init-method-std", std::to_string(d.init_method_std), "std of the normal weight init")
      .option("--normalization", "RMSNorm", "RMSNorm or LayerNorm (Megatron's default is LayerNorm)")
      .flag("--swiglu", "SwiGLU MLP (without it: GeLU, as in Megatron)")
      .flag("--untie-embeddings-and-output-weights", "separate output layer (without it the embedding is shared)")
      .flag("--bf16", "bf16 compute with fp32 master weights");
  add_moe_flags(a);
}

void add_moe_flags(Args& a) {
  a.option("--num-experts", "0", "routed experts per MoE layer (0: dense model)")
      .option("--moe-ffn-hidden-size", "0", "expert MLP hidden size (0: --ffn-hidden-size)")
      .option("--moe-router-topk", "2", "experts per token")
      .option("--moe-router-load-balancing-type", "aux_loss",
              "aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none, or a comma-separated list")
      .option("--moe-aux-loss-coeff", "0", "balancing-loss coefficient, or one per type (comma-separated)")
      .option("--moe-z-loss-coeff", "0", "router z-loss coefficient (0: off)")
      .option("--moe-input-jitter-eps", "0", "multiplicative router-input jitter (0: off)")
      .option("--moe-router-score-function", "softmax", "softmax | sigmoid | sqrtsoftplus")
      .flag("--moe-router-pre-softmax", "softmax over all experts before top-k")
      .option("--moe-router-topk-scaling-factor", "0", "scale of the top-k weights (0: none)")
      .option("--moe-router-dtype", "fp32", "router logits/probs precision: fp32 | fp64")
      .option("--moe-router-num-groups", "0", "expert groups for group-limited routing")
      .option("--moe-router-group-topk", "0", "groups each token may use")
      .flag("--moe-router-enable-expert-bias", "aux-loss-free balancing bias (sigmoid / sqrtsoftplus)")
      .option("--moe-router-bias-update-rate", "1e-3", "expert-bias step per optimizer step")
      .flag("--moe-router-force-load-balancing", "random router logits (benchmarking only)")
      .option("--moe-expert-capacity-factor", "0", "expert capacity factor (0: dropless)")
      .option("--moe-token-drop-policy", "probs", "probs | position")
      .flag("--moe-pad-expert-input-to-capacity", "pad every expert to its capacity")
      .flag("--moe-router-padding-for-fp8", "pad per-expert token counts to multiples of 16 (needs FP8)")
      .flag("--moe-grouped-gemm", "grouped-GEMM experts (the default here)")
      .flag("--no-moe-grouped-gemm", "sequential per-expert reference instead of the grouped GEMM")
      .option("--moe-shared-expert-intermediate-size", "0", "shared expert hidden size (0: none)")
      .flag("--moe-shared-expert-gate", "sigmoid gate on the shared expert output")
      .option("--moe-layer-freq", "1", "MoE layer pattern: N (every N-th layer from 0) or a 0/1 list");
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
  m.num_experts = a.i64("--num-experts");
  m.ffn_hidden_size = a.i64("--moe-ffn-hidden-size");
  m.router_topk = a.i64("--moe-router-topk");
  m.load_balancing_type.clear();
  for (const auto& t : split_list(a.str("--moe-router-load-balancing-type")))
    m.load_balancing_type.push_back(moe::parse_load_balancing(t));
  m.aux_loss_coeff.clear();
  for (const auto& c : split_list(a.str("--moe-aux-loss-coeff"))) m.aux_loss_coeff.push_back(std::stof(c));
  m.z_loss_coeff = static_cast<float>(a.f64("--moe-z-loss-coeff"));
  m.input_jitter_eps = static_cast<float>(a.f64("--moe-input-jitter-eps"));
  m.score_function = moe::parse_score_function(a.str("--moe-router-score-function"));
  m.pre_softmax = a.on("--moe-router-pre-softmax");
  m.topk_scaling_factor = static_cast<float>(a.f64("--moe-router-topk-scaling-factor"));
  const std::string rd = a.str("--moe-router-dtype");
  if (rd != "fp32" && rd != "fp64") MOECORE_FAIL("--moe-router-dtype '", rd, "' is not one of fp32, fp64");
  m.router_dtype = rd == "fp64" ? DType::f64 : DType::f32;
  m.num_groups = a.i64("--moe-router-num-groups");
  m.group_topk = a.i64("--moe-router-group-topk");
  m.enable_expert_bias = a.on("--moe-router-enable-expert-bias");
  m.bias_update_rate = static_cast<float>(a.f64("--moe-router-bias-update-rate"));
  m.force_load_balancing = a.on("--moe-router-force-load-balancing");
  m.capacity_factor = static_cast<float>(a.f64("--moe-expert-capacity-factor"));
  const std::string pol = a.str("--moe-token-drop-policy");
  if (pol != "probs" && pol != "position") MOECORE_FAIL("--moe-token-drop-policy '", pol, "' is not one of probs, position");
  m.drop_policy = pol == "position" ? moe::DropPolicy::position : moe::DropPolicy::probs;
  m.pad_expert_input_to_capacity = a.on("--moe-pad-expert-input-to-capacity");
  m.router_padding_alignment = a.on("--moe-router-padding-for-fp8") ? 16 : 0;
  if (a.on("--moe-grouped-gemm") && a.on("--no-moe-grouped-gemm"))
    MOECORE_FAIL("flags --moe-grouped-gemm and --no-moe-grouped-gemm exclude each other");
  m.grouped_gemm = !a.on("--no-moe-grouped-gemm");
  m.shared_expert_intermediate_size = a.i64("--moe-shared-expert-intermediate-size");
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
  c.num_query_groups = a.i64("--num-query-groups");
  c.kv_channels = a.i64("--kv-channels");
  c.ffn_hidden_size = a.i64("--ffn-hidden-size");
  c.vocab_size = a.i64("--vocab-size");
  if (c.vocab_size == 0) c.vocab_size = tokenizer_vocab;
  if (tokenizer_vocab > 0 && c.vocab_size < tokenizer_vocab)
    MOECORE_FAIL("--vocab-size (", c.vocab_size, ") is smaller than the tokenizer's vocabulary (", tokenizer_vocab, ")");
  c.seq_length = a.i64("--seq-length");
  c.norm_epsilon = static_cast<float>(a.f64("--norm-epsilon"));
  c.rotary_base = static_cast<float>(a.f64("--rotary-base"));
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
  c.validate();
  return c;
}

}  // namespace moecore::apps
