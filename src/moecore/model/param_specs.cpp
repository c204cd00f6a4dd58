#include "moecore/model/param_specs.h"

#include <cmath>

namespace moecore::model {

std::vector<LayerSpec> layer_specs(const ModelConfig& cfg) {
  const std::vector<bool> moe = cfg.moe_layers();
  const AttentionKind attention = cfg.multi_latent_attention ? AttentionKind::mla : AttentionKind::standard;
  std::vector<LayerSpec> out;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    out.push_back({"decoder.layers." + std::to_string(l) + ".", attention, cfg.qk_layernorm,
                   moe[static_cast<size_t>(l)] ? MlpKind::moe : MlpKind::dense, false});
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k)
    out.push_back({"mtp.layers." + std::to_string(k) + ".transformer_layer.", attention, cfg.qk_layernorm,
                   moe.back() ? MlpKind::moe : MlpKind::dense, true});
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

std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg) {
  const int64_t L = cfg.num_layers, H = cfg.hidden_size, V = cfg.vocab_size, D = cfg.head_dim();
  const int64_t G = cfg.query_groups(), Hq = cfg.num_attention_heads, qkv_rows = (Hq + 2 * G) * D;
  const bool ln = cfg.normalization == Normalization::layernorm, bias = cfg.add_bias_linear;
  const float std_w = cfg.init_method_std, std_out = std_w / std::sqrt(2.0f * static_cast<float>(L));
  const moe::MoeConfig& mc = cfg.moe;
  const int64_t Fm = cfg.moe_ffn(), Fs = mc.shared_expert_intermediate_size;
  auto glu = [&](int64_t f) { return cfg.swiglu ? 2 * f : f; };
  std::vector<ParamSpec> out;
  int64_t layer_index = -1;  // of the parameters added (-1: the model's own)
  auto add = [&](ParamRole role, std::string name, Shape shape, ParamInit init, float std = 0.0f, bool expert = false) {
    out.push_back({std::move(name), shape, init, std, expert});
    out.back().role = role;
    out.back().layer = layer_index;
  };
  auto split = [&](int dim, int parts = 1) {  // the tensor-parallel split of the last parameter added
    out.back().tp_dim = dim;
    out.back().tp_parts = parts;
  };
  auto head_partial = [&](size_t from) {  // the parameters added since `from` are fed by the rank's heads under TP
    for (size_t i = from; i < out.size(); ++i) out[i].tp_grad = ParamSpec::TpGrad::head_partial;
  };
  const int glu_parts = cfg.swiglu ? 2 : 1;
  auto norm = [&](ParamRole role, ParamRole bias_role, const std::string& prefix, int64_t width) {
    add(role, prefix + ".weight", {width}, ParamInit::ones);
    if (ln) add(bias_role, prefix + ".bias", {width}, ParamInit::zeros);
  };
  using enum ParamRole;
  add(word_embeddings, "embedding.word_embeddings.weight", {V, H}, ParamInit::normal, std_w);
  split(0);
  if (cfg.position_embedding_type == PositionEmbedding::learned_absolute) {
    add(position_embeddings, "embedding.position_embeddings.weight", {cfg.max_positions(), H}, ParamInit::normal,
        std_w);
    out.back().tp_grad = ParamSpec::TpGrad::whole;
  }
  // One transformer layer's parameters (a decoder layer, or an MTP depth's transformer layer).
  auto layer = [&](const LayerSpec& spec) {
    const std::string& pre = spec.prefix;
    norm(input_norm, input_norm_bias, pre + "input_layernorm", H);
    if (spec.attention == AttentionKind::mla) {  // Megatron's MLASelfAttention (local spec names)
      const int64_t qr = cfg.q_lora_rank, kvr = cfg.kv_lora_rank, dr = cfg.qk_pos_emb_head_dim;
      const int64_t q_rows = Hq * (cfg.qk_head_dim + dr);
      // Under TP the up-projections split by head (rows grouped by head), linear_proj by its input; the
      // down-projections are replicated (as Megatron's "duplicated" linears).
      if (qr) {
        add(q_down_proj, pre + "self_attention.linear_q_down_proj.weight", {qr, H}, ParamInit::normal, std_w);
        head_partial(out.size() - 1);
        add(q_up_proj, pre + "self_attention.linear_q_up_proj.weight", {q_rows, qr}, ParamInit::normal, std_w);
        split(0);
      } else {
        add(q_proj, pre + "self_attention.linear_q_proj.weight", {q_rows, H}, ParamInit::normal, std_w);
        split(0);
      }
      add(kv_down_proj, pre + "self_attention.linear_kv_down_proj.weight", {kvr + dr, H}, ParamInit::normal, std_w);
      head_partial(out.size() - 1);
      add(kv_up_proj, pre + "self_attention.linear_kv_up_proj.weight", {Hq * (cfg.qk_head_dim + cfg.v_head_dim), kvr},
          ParamInit::normal, std_w);
      split(0);
      add(proj, pre + "self_attention.linear_proj.weight", {H, Hq * cfg.v_head_dim}, ParamInit::normal, std_out);
      split(1);
      norm(mlp_norm, mlp_norm_bias, pre + "pre_mlp_layernorm", H);
      if (spec.qk_norm) {  // with MLA, --qk-layernorm normalises the q and kv latents
        const size_t from = out.size();
        if (qr) norm(q_norm, q_norm_bias, pre + "self_attention.q_layernorm", qr);
        norm(kv_norm, kv_norm_bias, pre + "self_attention.kv_layernorm", kvr);
        head_partial(from);
      }
    } else {
      // Rows are grouped by query group ([G][R + 2][D]): a split along dim 0 is a split by query group.
      add(qkv, pre + "self_attention.linear_qkv.weight", {qkv_rows, H}, ParamInit::normal, std_w);
      split(0);
      add(proj, pre + "self_attention.linear_proj.weight", {H, Hq * D}, ParamInit::normal, std_out);
      split(1);
      if (cfg.qkv_bias()) {
        add(qkv_bias, pre + "self_attention.linear_qkv.bias", {qkv_rows}, ParamInit::zeros);
        split(0);
      }
      if (bias) add(proj_bias, pre + "self_attention.linear_proj.bias", {H}, ParamInit::zeros);
      norm(mlp_norm, mlp_norm_bias, pre + "pre_mlp_layernorm", H);
      if (spec.qk_norm) {  // Megatron's q_layernorm / k_layernorm: weights [D] shared by the heads
        const size_t from = out.size();
        norm(q_norm, q_norm_bias, pre + "self_attention.q_layernorm", D);
        norm(k_norm, k_norm_bias, pre + "self_attention.k_layernorm", D);
        head_partial(from);
      }
    }
    if (spec.mlp == MlpKind::dense) {
      add(fc1, pre + "mlp.linear_fc1.weight", {glu(cfg.ffn()), H}, ParamInit::normal, std_w);
      split(0, glu_parts);
      add(fc2, pre + "mlp.linear_fc2.weight", {H, cfg.ffn()}, ParamInit::normal, std_out);
      split(1);
      if (bias) {
        add(fc1_bias, pre + "mlp.linear_fc1.bias", {glu(cfg.ffn())}, ParamInit::zeros);
        split(0, glu_parts);
        add(fc2_bias, pre + "mlp.linear_fc2.bias", {H}, ParamInit::zeros);
      }
      return;
    }
    const int64_t E = mc.num_experts;
    add(router, pre + "mlp.router.weight", {E, H}, ParamInit::normal, std_w);
    add(experts_fc1, pre + "mlp.experts.linear_fc1.weight", {E, glu(Fm), H}, ParamInit::normal, std_w, true);
    split(1, glu_parts);  // (expert tensor parallelism: within each expert)
    add(experts_fc2, pre + "mlp.experts.linear_fc2.weight", {E, H, Fm}, ParamInit::normal, std_out, true);
    split(2);
    if (bias) {
      add(router_bias, pre + "mlp.router.bias", {E}, ParamInit::normal, std_w);
      add(experts_fc1_bias, pre + "mlp.experts.linear_fc1.bias", {E, glu(Fm)}, ParamInit::zeros, 0.0f, true);
      split(1, glu_parts);
      add(experts_fc2_bias, pre + "mlp.experts.linear_fc2.bias", {E, H}, ParamInit::zeros, 0.0f, true);
    }
    if (Fs > 0) {
      add(shared_fc1, pre + "mlp.shared_experts.linear_fc1.weight", {glu(Fs), H}, ParamInit::normal, std_w);
      add(shared_fc2, pre + "mlp.shared_experts.linear_fc2.weight", {H, Fs}, ParamInit::normal, std_out);
      if (mc.shared_expert_gate)
        add(shared_gate, pre + "mlp.shared_experts.gate_weight", {1, H}, ParamInit::normal, std_w);
    }
  };
  const std::vector<LayerSpec> layers = layer_specs(cfg);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    layer_index = l;
    layer(layers[static_cast<size_t>(l)]);
  }
  layer_index = -1;
  norm(final_norm, final_norm_bias, "decoder.final_layernorm", H);
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k) {  // Megatron's MultiTokenPredictionLayer
    const std::string pre = "mtp.layers." + std::to_string(k) + ".";
    layer_index = cfg.num_layers + k;
    norm(mtp_enorm, mtp_enorm_bias, pre + "enorm", H);
    norm(mtp_hnorm, mtp_hnorm_bias, pre + "hnorm", H);
    add(mtp_eh_proj, pre + "eh_proj.weight", {H, 2 * H}, ParamInit::normal, std_w);
    layer(layers[static_cast<size_t>(layer_index)]);
    norm(mtp_final_norm, mtp_final_norm_bias, pre + "final_layernorm", H);
  }
  layer_index = -1;
  if (cfg.untie_embeddings_and_output_weights) {
    add(output_layer, "output_layer.weight", {V, H}, ParamInit::normal, std_w);
    split(0);
  }
  return out;
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
