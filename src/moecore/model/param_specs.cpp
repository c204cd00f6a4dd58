#include "moecore/model/param_specs.h"

#include <cmath>

namespace moecore::model {

std::vector<LayerSpec> layer_specs(const ModelConfig& cfg) {
  const std::vector<bool> moe = cfg.moe_layers(), windowed = cfg.window_layers();
  const AttentionKind attention = cfg.multi_latent_attention ? AttentionKind::mla : AttentionKind::standard;
  std::vector<LayerSpec> out;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    out.push_back({"decoder.layers." + std::to_string(l) + ".", attention, cfg.qk_layernorm,
                   windowed[static_cast<size_t>(l)] ? cfg.window_size : -1,
                   moe[static_cast<size_t>(l)] ? MlpKind::moe : MlpKind::dense, false,
                   cfg.fp8.layer_runs_fp8(l, cfg.num_layers)});
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k)
    out.push_back({"mtp.layers." + std::to_string(k) + ".transformer_layer.", attention, cfg.qk_layernorm, -1,
                   moe.back() ? MlpKind::moe : MlpKind::dense, true, cfg.fp8.on});
  return out;
}

int64_t parameters_per_rank(const ModelConfig& cfg, int ep, int tp, int etp,
                            const std::function<bool(const std::string&)>& held) {
  int64_t n = 0;
  for (const ParamSpec& p : parameter_specs(cfg)) {
    if (held && !held(p.name)) continue;
    const int64_t split = p.tp_dim < 0 ? 1 : p.expert ? etp : tp;
    const int64_t k = (p.expert ? p.shape.numel() / ep : p.shape.numel()) / split;
    if (__builtin_add_overflow(n, k, &n)) MOECORE_FAIL("model: more than 2^63 parameters (", cfg.summary(), ")");
  }
  return n;
}

namespace {

// The table in the making: one method per module, each adding its parameters in Megatron's order.
class SpecTable {
 public:
  explicit SpecTable(const ModelConfig& cfg)
      : c_(cfg),
        H_(cfg.hidden_size),
        std_w_(cfg.init_method_std),
        std_out_(std_w_ / std::sqrt(2.0f * static_cast<float>(cfg.num_layers))),
        glu_parts_(cfg.swiglu ? 2 : 1) {}
  std::vector<ParamSpec> take() { return std::move(out_); }
  void set_layer(int64_t l) { layer_ = l; }

  void embeddings() {
    add(ParamRole::word_embeddings, "embedding.word_embeddings.weight", {c_.vocab_size, H_}, ParamInit::normal, std_w_);
    split(0);
    if (c_.position_embedding_type != PositionEmbedding::learned_absolute) return;
    add(ParamRole::position_embeddings, "embedding.position_embeddings.weight", {c_.max_positions(), H_},
        ParamInit::normal, std_w_);
    out_.back().tp_grad = ParamSpec::TpGrad::whole;
  }
  // One transformer layer (a decoder layer, or an MTP depth's transformer layer).
  void layer(const LayerSpec& spec) {
    norm(ParamRole::input_norm, ParamRole::input_norm_bias, spec.prefix + "input_layernorm", H_);
    if (spec.attention == AttentionKind::mla)
      mla(spec);
    else
      standard_attention(spec);
    if (spec.mlp == MlpKind::dense)
      dense_mlp(spec.prefix);
    else
      moe_block(spec.prefix);
  }
  void final_norm() { norm(ParamRole::final_norm, ParamRole::final_norm_bias, "decoder.final_layernorm", H_); }
  // Megatron's MultiTokenPredictionLayer k around its transformer layer.
  void mtp_depth(int64_t k, const LayerSpec& spec) {
    using enum ParamRole;
    const std::string pre = "mtp.layers." + std::to_string(k) + ".";
    norm(mtp_enorm, mtp_enorm_bias, pre + "enorm", H_);
    norm(mtp_hnorm, mtp_hnorm_bias, pre + "hnorm", H_);
    add(mtp_eh_proj, pre + "eh_proj.weight", {H_, 2 * H_}, ParamInit::normal, std_w_);
    layer(spec);
    norm(mtp_final_norm, mtp_final_norm_bias, pre + "final_layernorm", H_);
  }
  void output_layer() {
    add(ParamRole::output_layer, "output_layer.weight", {c_.vocab_size, H_}, ParamInit::normal, std_w_);
    split(0);
  }

 private:
  void add(ParamRole role, std::string name, Shape shape, ParamInit init, float std = 0.0f, bool expert = false) {
    out_.push_back({std::move(name), shape, init, std, expert});
    out_.back().role = role;
    out_.back().layer = layer_;
  }
  void split(int dim, int parts = 1) {  // the tensor-parallel split of the last parameter added
    out_.back().tp_dim = dim;
    out_.back().tp_parts = parts;
  }
  void head_partial(size_t from) {  // the parameters added since `from` are fed by the rank's heads under TP
    for (size_t i = from; i < out_.size(); ++i) out_[i].tp_grad = ParamSpec::TpGrad::head_partial;
  }
  void norm(ParamRole role, ParamRole bias_role, const std::string& prefix, int64_t width) {
    add(role, prefix + ".weight", {width}, ParamInit::ones);
    if (c_.normalization == Normalization::layernorm) add(bias_role, prefix + ".bias", {width}, ParamInit::zeros);
  }
  int64_t glu(int64_t f) const { return c_.swiglu ? 2 * f : f; }

  // Megatron's SelfAttention. Rows of linear_qkv are grouped by query group ([G][R + 2][D]): a split along dim 0 is a
  // split by query group.
  void standard_attention(const LayerSpec& spec) {
    using enum ParamRole;
    const std::string sa = spec.prefix + "self_attention.";
    const int64_t D = c_.head_dim(), Hq = c_.num_attention_heads, rows = (Hq + 2 * c_.query_groups()) * D;
    add(qkv, sa + "linear_qkv.weight", {rows, H_}, ParamInit::normal, std_w_);
    split(0);
    add(proj, sa + "linear_proj.weight", {H_, Hq * D}, ParamInit::normal, std_out_);
    split(1);
    if (c_.qkv_bias()) {
      add(qkv_bias, sa + "linear_qkv.bias", {rows}, ParamInit::zeros);
      split(0);
    }
    if (c_.add_bias_linear) add(proj_bias, sa + "linear_proj.bias", {H_}, ParamInit::zeros);
    if (c_.softmax_type == SoftmaxType::learnable) {  // Megatron: init_method, split by head over TP
      add(softmax_offset, sa + "core_attention.softmax_offset", {Hq}, ParamInit::normal, std_w_);
      split(0);
    }
    norm(mlp_norm, mlp_norm_bias, spec.prefix + "pre_mlp_layernorm", H_);
    if (!spec.qk_norm) return;
    const size_t from = out_.size();
    if (c_.qk_layernorm_over_heads) {  // over each token's whole projections: every TP rank norms all heads
      norm(q_norm, q_norm_bias, sa + "q_layernorm", Hq * D);
      norm(k_norm, k_norm_bias, sa + "k_layernorm", c_.query_groups() * D);
      for (size_t i = from; i < out_.size(); ++i) out_[i].tp_grad = ParamSpec::TpGrad::whole;
      return;
    }
    // Megatron's q_layernorm / k_layernorm: weights [D] shared by the heads
    norm(q_norm, q_norm_bias, sa + "q_layernorm", D);
    norm(k_norm, k_norm_bias, sa + "k_layernorm", D);
    head_partial(from);
  }
  // Megatron's MLASelfAttention (local spec names). Under TP the up-projections split by head (rows grouped by head),
  // linear_proj by its input; the down-projections are replicated (as Megatron's "duplicated" linears).
  void mla(const LayerSpec& spec) {
    using enum ParamRole;
    const std::string sa = spec.prefix + "self_attention.";
    const int64_t qr = c_.q_lora_rank, kvr = c_.kv_lora_rank, dr = c_.qk_pos_emb_head_dim, Hq = c_.num_attention_heads;
    const int64_t q_rows = Hq * (c_.qk_head_dim + dr);
    if (qr) {
      add(q_down_proj, sa + "linear_q_down_proj.weight", {qr, H_}, ParamInit::normal, std_w_);
      head_partial(out_.size() - 1);
      add(q_up_proj, sa + "linear_q_up_proj.weight", {q_rows, qr}, ParamInit::normal, std_w_);
    } else {
      add(q_proj, sa + "linear_q_proj.weight", {q_rows, H_}, ParamInit::normal, std_w_);
    }
    split(0);
    add(kv_down_proj, sa + "linear_kv_down_proj.weight", {kvr + dr, H_}, ParamInit::normal, std_w_);
    head_partial(out_.size() - 1);
    add(kv_up_proj, sa + "linear_kv_up_proj.weight", {Hq * (c_.qk_head_dim + c_.v_head_dim), kvr}, ParamInit::normal,
        std_w_);
    split(0);
    add(proj, sa + "linear_proj.weight", {H_, Hq * c_.v_head_dim}, ParamInit::normal, std_out_);
    split(1);
    norm(mlp_norm, mlp_norm_bias, spec.prefix + "pre_mlp_layernorm", H_);
    if (!spec.qk_norm) return;
    const size_t from = out_.size();  // with MLA, --qk-layernorm normalises the q and kv latents
    if (qr) norm(q_norm, q_norm_bias, sa + "q_layernorm", qr);
    norm(kv_norm, kv_norm_bias, sa + "kv_layernorm", kvr);
    head_partial(from);
  }
  void dense_mlp(const std::string& pre) {
    using enum ParamRole;
    const int64_t F = c_.ffn();
    add(fc1, pre + "mlp.linear_fc1.weight", {glu(F), H_}, ParamInit::normal, std_w_);
    split(0, glu_parts_);
    add(fc2, pre + "mlp.linear_fc2.weight", {H_, F}, ParamInit::normal, std_out_);
    split(1);
    if (!c_.add_bias_linear) return;
    add(fc1_bias, pre + "mlp.linear_fc1.bias", {glu(F)}, ParamInit::zeros);
    split(0, glu_parts_);
    add(fc2_bias, pre + "mlp.linear_fc2.bias", {H_}, ParamInit::zeros);
  }
  // The router, the routed experts ([E, ...]; expert tensor parallelism splits within each expert) and the shared
  // experts.
  void moe_block(const std::string& pre) {
    using enum ParamRole;
    const int64_t E = c_.moe.num_experts, Fm = c_.moe_ffn(), Fs = c_.moe.shared_expert_intermediate_size;
    add(router, pre + "mlp.router.weight", {E, H_}, ParamInit::normal, std_w_);
    add(experts_fc1, pre + "mlp.experts.linear_fc1.weight", {E, glu(Fm), H_}, ParamInit::normal, std_w_, true);
    split(1, glu_parts_);
    add(experts_fc2, pre + "mlp.experts.linear_fc2.weight", {E, H_, Fm}, ParamInit::normal, std_out_, true);
    split(2);
    if (c_.add_bias_linear) {
      add(router_bias, pre + "mlp.router.bias", {E}, ParamInit::normal, std_w_);
      add(experts_fc1_bias, pre + "mlp.experts.linear_fc1.bias", {E, glu(Fm)}, ParamInit::zeros, 0.0f, true);
      split(1, glu_parts_);
      add(experts_fc2_bias, pre + "mlp.experts.linear_fc2.bias", {E, H_}, ParamInit::zeros, 0.0f, true);
    }
    if (Fs == 0) return;
    add(shared_fc1, pre + "mlp.shared_experts.linear_fc1.weight", {glu(Fs), H_}, ParamInit::normal, std_w_);
    add(shared_fc2, pre + "mlp.shared_experts.linear_fc2.weight", {H_, Fs}, ParamInit::normal, std_out_);
    if (c_.moe.shared_expert_gate)
      add(shared_gate, pre + "mlp.shared_experts.gate_weight", {1, H_}, ParamInit::normal, std_w_);
  }

  const ModelConfig& c_;
  const int64_t H_;
  const float std_w_, std_out_;
  const int glu_parts_;
  int64_t layer_ = -1;  // of the parameters added (-1: the model's own)
  std::vector<ParamSpec> out_;
};

}  // namespace

std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg) {
  SpecTable t(cfg);
  t.embeddings();
  const std::vector<LayerSpec> layers = layer_specs(cfg);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    t.set_layer(l);
    t.layer(layers[static_cast<size_t>(l)]);
  }
  t.set_layer(-1);
  t.final_norm();
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k) {
    t.set_layer(cfg.num_layers + k);
    t.mtp_depth(k, layers[static_cast<size_t>(cfg.num_layers + k)]);
  }
  t.set_layer(-1);
  if (cfg.untie_embeddings_and_output_weights) t.output_layer();
  return t.take();
}

AttentionCost attention_cost(const ModelConfig& cfg, AttentionKind kind) {
  const double h = static_cast<double>(cfg.hidden_size);
  if (kind == AttentionKind::mla) {
    const double nh = static_cast<double>(cfg.num_attention_heads), dqk = static_cast<double>(cfg.qk_head_dim);
    const double dr = static_cast<double>(cfg.qk_pos_emb_head_dim), dv = static_cast<double>(cfg.v_head_dim);
    const double qr = static_cast<double>(cfg.q_lora_rank), kvr = static_cast<double>(cfg.kv_lora_rank);
    const double p_q = qr > 0 ? qr * (h + nh * (dqk + dr) + 1) : h * nh * (dqk + dr);
    return {p_q + kvr * (h + nh * (dqk + dv) + 1) + h * dr + nh * dv * h, nh * (dqk + dr) / 2 + nh * dv / 2};
  }
  const double q = static_cast<double>(cfg.num_attention_heads * cfg.head_dim());
  const double kv = static_cast<double>(cfg.query_groups() * cfg.head_dim());
  return {h * (q + 2 * kv) + q * h, q};
}

double model_flops_per_step(const ModelConfig& cfg, int64_t micro_batch) {
  const double S = static_cast<double>(cfg.seq_length), T = static_cast<double>(micro_batch) * S;
  const double h = static_cast<double>(cfg.hidden_size), n_mtp = static_cast<double>(cfg.mtp_num_layers);
  const double ffn_mult = cfg.swiglu ? 3.0 : 2.0;
  double per_token = 0, core = 0;  // summed over the layers: 6 x (MLP + projections) per token, 6 x A_core
  for (const LayerSpec& spec : layer_specs(cfg)) {
    const double mlp =
        spec.mlp == MlpKind::dense
            ? static_cast<double>(cfg.ffn())
            : static_cast<double>(cfg.moe_ffn() * cfg.moe.router_topk + cfg.moe.shared_expert_intermediate_size);
    const AttentionCost a = attention_cost(cfg, spec.attention);
    per_token += 6 * h * ffn_mult * mlp + 6 * a.p_attn;
    core += 6 * a.a_core;
  }
  return T * (per_token + 6 * n_mtp * (3 * h + 2 * h * h) + 6 * h * static_cast<double>(cfg.vocab_size) * (n_mtp + 1)) +
         static_cast<double>(micro_batch) * S * S * core;
}

}  // namespace moecore::model
