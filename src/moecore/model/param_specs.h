// The specs of a GPT decoder, derived from its configuration alone: the list of transformer layers (each layer's
// attention and MLP variant), the parameter table (every parameter's Megatron name, global shape, initialisation
// and expert sharding, in the model's order) and the model FLOPs. GptModel builds its layers and allocates its
// parameters from them; the HF weight map (hf_weights.h) and checkpoint conversion read them without allocating a
// model. A new model family is new specs here (and their modules), not a new constructor.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"
#include "moecore/model/config.h"

namespace moecore::model {

// One transformer layer: its attention (Megatron's SelfAttention with GQA/MHA, or MLASelfAttention) and MLP
// (dense, or MoE with the config's routed and shared experts).
enum class AttentionKind : uint8_t { standard, mla };
enum class MlpKind : uint8_t { dense, moe };
struct LayerSpec {
  std::string prefix;  // parameter-name prefix: "decoder.layers.3." or "mtp.layers.0.transformer_layer."
  AttentionKind attention = AttentionKind::standard;
  bool qk_norm = false;  // standard: the per-head q/k norms; MLA: the q/kv latent norms (Megatron: --qk-layernorm)
  int64_t window = -1;   // the sliding window of its attention (ModelConfig::window_size), -1: none
  MlpKind mlp = MlpKind::dense;
  bool mtp = false;  // the transformer layer of a multi-token-prediction depth (its kind: the last decoder layer's)
  bool fp8 = false;  // its linears run FP8 (nn/fp8.h; ModelConfig::fp8, --first-last-layers-bf16)
};
// The decoder's layers, then one per MTP depth: index l of every per-layer array of the model.
std::vector<LayerSpec> layer_specs(const ModelConfig& cfg);

enum class ParamInit : uint8_t { normal, ones, zeros };

// What a parameter is to the module that reads it. With ParamSpec::layer it identifies the parameter: the model binds
// its modules by role (DecoderLayer::bind), and only the table below spells Megatron's names.
// A transformer layer's roles stay together, from input_norm to shared_gate (layer_role reads that range).
enum class ParamRole : uint8_t {
  // the model's own (layer -1)
  word_embeddings,
  position_embeddings,
  final_norm,
  final_norm_bias,
  output_layer,
  // a transformer layer's: the norms, standard attention (q_norm / k_norm: the per-head QK-norms; with MLA q_norm is
  // the q latent norm), MLA, the dense MLP, the MoE block
  input_norm,
  input_norm_bias,
  mlp_norm,
  mlp_norm_bias,
  qkv,
  qkv_bias,
  proj,
  proj_bias,
  softmax_offset,
  q_norm,
  q_norm_bias,
  k_norm,
  k_norm_bias,
  q_proj,
  q_down_proj,
  q_up_proj,
  kv_down_proj,
  kv_up_proj,
  kv_norm,
  kv_norm_bias,
  fc1,
  fc1_bias,
  fc2,
  fc2_bias,
  router,
  router_bias,
  experts_fc1,
  experts_fc1_bias,
  experts_fc2,
  experts_fc2_bias,
  shared_fc1,
  shared_fc2,
  shared_gate,
  // a multi-token-prediction depth's own, around its transformer layer
  mtp_enorm,
  mtp_enorm_bias,
  mtp_hnorm,
  mtp_hnorm_bias,
  mtp_eh_proj,
  mtp_final_norm,
  mtp_final_norm_bias,
};
// Whether the role is a transformer layer's (DecoderLayer::bind), not the model's or an MTP depth's own.
constexpr bool layer_role(ParamRole r) {
  return r >= ParamRole::input_norm && r <= ParamRole::shared_gate;
}

struct ParamSpec {
  std::string name;  // Megatron name, e.g. "decoder.layers.0.mlp.linear_fc1.weight"
  Shape shape;       // global shape; routed-expert weights [E, ...]
  ParamInit init = ParamInit::normal;
  float std = 0.0f;     // N(0, std^2) for ParamInit::normal
  bool expert = false;  // dim 0 is the expert index, sharded over the expert-parallel group
  // Under tensor parallelism (Megatron's layers): split along tp_dim (-1: replicated) in tp_parts pieces (TensorShard):
  // column-parallel weights and biases along dim 0 (QKV by query group, SwiGLU's fc1 as its gate and up halves), row-
  // parallel weights along dim 1, the word embedding and output layer along the vocabulary (dim 0). The routed
  // experts' weights are split the same way within each expert (fc1 along dim 1, fc2 along dim 2), over the expert-
  // tensor-parallel group instead (the fc2 bias stays whole).
  int tp_dim = -1;
  int tp_parts = 1;
  // A replicated parameter's gradient on each TP rank: a partial sum (summed over TP, Param::tp_grad_sum) under
  // sequence parallelism when the rank's rows feed it (norms, row-parallel biases, router, shared experts), always
  // when the rank's heads feed it (QK-norms, MLA's latent norms and down-projections), or whole (the learned positions,
  // whose gradient comes from the gathered rows).
  enum class TpGrad : uint8_t { sequence_partial, head_partial, whole };
  TpGrad tp_grad = TpGrad::sequence_partial;
  ParamRole role = ParamRole::word_embeddings;
  // The layer of a layer's (and of an MTP depth's own) parameter: its index in layer_specs (MTP depth k: num_layers +
  // k); -1: the model's own.
  int64_t layer = -1;
};

// Order: embeddings; per layer the input norm, linear_qkv (+bias), linear_proj (+bias), the learnable softmax's
// core_attention.softmax_offset ([heads], split by head like linear_qkv, init_method), the MLP norm, QK-norms
// (MLA: linear_q_proj or linear_q_down_proj + linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj,
// linear_proj, the MLP norm, the latent norms q_layernorm / kv_layernorm), then the dense MLP or the MoE block (router,
// experts, biases, shared experts); the final norm; the output layer (absent when tied). Weights start at N(0,
// init_method_std^2), the output projections of each block at std / sqrt(2 * num_layers) (Megatron's scaled init); norm
// weights at 1, norm and linear biases at 0, the router's bias like a weight (as Megatron).
std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg);
// Parameters one rank holds: every parameter, the routed experts divided over `ep` expert-parallel ranks and split
// over `etp`, the other tensor-parallel splits over `tp` ranks (as GptModel allocates them). Overflow-checked: absurd
// sizes are an Error, before anything is allocated.
// held: the parameters a pipeline stage holds (empty: all).
int64_t parameters_per_rank(const ModelConfig& cfg, int ep, int tp = 1, int etp = 1,
                            const std::function<bool(const std::string&)>& held = {});

// Model FLOPs (docs/echo-folding-perf.md's formula, Megatron's count) derived from the same configuration:
// per token, the attention projections P_attn (multiply-adds per token per layer) and the attention core A_core
// (QK^T and AV over the causal half, per token and key position).
struct AttentionCost {
  double p_attn = 0, a_core = 0;
};
AttentionCost attention_cost(const ModelConfig& cfg, AttentionKind kind);
// One forward+backward over micro_batch x seq_length tokens: 3x the forward GEMMs, every transformer layer (MTP
// depths included, with their norms + eh_proj and one more logit GEMM), causal attention counted at full S^2 / 2.
double model_flops_per_step(const ModelConfig& cfg, int64_t micro_batch);

}  // namespace moecore::model
