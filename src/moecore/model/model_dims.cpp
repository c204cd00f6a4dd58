#include "moecore/model/model_dims.h"

#include "moecore/moe/echo.h"

namespace moecore::model {

const ProcessGroup* moe_sequence_group(const ModelParallel& par) {
  return par.cp.size() > 1 ? &par.tp_cp : par.sequence_parallel ? &par.tp : nullptr;
}

ModelDims model_dims(const ModelConfig& cfg, const ModelParallel& par, int64_t B, uint64_t seed, Device device) {
  const int64_t P = par.tp.size(), EP = par.ep.size(), ETP = par.etp.size();
  const int CP = par.cp.size();
  const int64_t H = cfg.hidden_size, S = cfg.seq_length / CP, T = B * S;
  const int64_t D = cfg.head_dim(), G = cfg.query_groups(), R = cfg.num_attention_heads / G;
  const int64_t N = par.sequence_parallel ? T / P : T;
  const DType c = cfg.compute_dtype;
  ModelDims d;
  nn::DenseLayerDims& n = d.dense;
  n.N = N;
  n.H = H;
  n.F = cfg.ffn() / P;
  n.qkv = {B, S, G / P, R, D};
  n.tp = &par.tp;
  n.sequence_parallel = par.sequence_parallel;
  n.cp = CP > 1 ? &par.cp : nullptr;
  n.eps = cfg.norm_epsilon;
  n.layernorm = cfg.normalization == Normalization::layernorm;
  n.act = cfg.mlp_activation();
  n.rope = cfg.rope();
  n.qk_norm = cfg.qk_layernorm && !cfg.multi_latent_attention;  // (with MLA, --qk-layernorm is the latent norms)
  n.qk_norm_over_heads = cfg.qk_layernorm_over_heads;
  n.softmax_off_by_one = cfg.softmax_type == SoftmaxType::off_by_one;
  n.dropout = cfg.hidden_dropout > 0.0f;
  n.compute = c;
  n.device = device;
  if (cfg.multi_latent_attention)
    d.mla = {B,
             S,
             H,
             cfg.num_attention_heads / P,  // this rank's heads under TP
             cfg.q_lora_rank,
             cfg.kv_lora_rank,
             cfg.qk_head_dim,
             cfg.qk_pos_emb_head_dim,
             cfg.v_head_dim,
             cfg.qk_layernorm,
             cfg.mla_softmax_scale_mult(),
             CP};
  moe::MoeLayerDims& m = d.moe;
  m = {N, B, H, cfg.moe_ffn(), cfg.moe.shared_expert_intermediate_size, c};
  m.global_aux_group = &par.dp;
  m.sequence_group = moe_sequence_group(par);
  m.ep = EP;
  m.etp = ETP;
  m.etp_rank = par.etp.rank();
  m.device = device;
  m.dispatcher = EP * ETP > 1 ? par.dispatcher : moe::DispatcherKind::local;
  m.recompute_act = cfg.recompute.selects("moe_act");
  if (cfg.moe.enabled()) {
    moe::echo_check_layout(cfg.moe, EP, ETP, par.dispatcher);
    m.received_capacity = cfg.moe.received_token_capacity;
  }
  if (cfg.moe.enabled() && cfg.moe.enable_echo) {
    moe::EchoDims& e = m.echo;
    e.slots = cfg.moe.num_echo_experts;
    e.recompute_dispatch = cfg.moe.echo_recompute_expert_dispatch;
    e.random = cfg.moe.echo_random_offloading;
    e.seed = seed;
    e.biases = cfg.add_bias_linear;
    e.group = &par.ep;
  }
  return d;
}

}  // namespace moecore::model
