// Model configuration of a GPT decoder, with Megatron's argument names in the comments.
// Validated once at start-up; errors name the fields and values. The defaults here are the library's (the
// small plain models of the tests: RoPE, RMSNorm, no biases, no dropout); the command line starts from
// Megatron's own defaults instead (apps/model_flags.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/dtype.h"
#include "moecore/moe/config.h"
#include "moecore/nn/fp8.h"

namespace moecore::model {

enum class Normalization : uint8_t { rmsnorm, layernorm };
// --softmax-type (Megatron's SoftmaxOne): vanilla; off-by-one adds exp(0) to every softmax denominator; learnable adds
// exp(s_h), s_h a learned logit per query head (Megatron's core_attention.softmax_offset; gpt-oss's sinks).
enum class SoftmaxType : uint8_t { vanilla, off_by_one, learnable };
const char* softmax_type_name(SoftmaxType t);  // Megatron's spelling: vanilla, off-by-one, learnable
// --position-embedding-type: learned_absolute (Megatron's default), rope, none.
enum class PositionEmbedding : uint8_t { learned_absolute, rope, none };

// YaRN scaling of the rotary frequencies (Megatron's YarnRotaryEmbedding; --rope-type yarn, MLA only).
struct YarnConfig {
  float scaling_factor = 1.0f;                      // --rotary-scaling-factor
  float mscale = 1.0f;                              // --mscale
  float mscale_all_dim = 0.0f;                      // --mscale-all-dim
  int64_t original_max_position_embeddings = 4096;  // --yarn-original-max-position-embeddings
  float beta_fast = 32.0f;                          // --yarn-beta-fast
  float beta_slow = 1.0f;                           // --yarn-beta-slow
  bool correction_range_round_to_int = true;        // --no-yarn-correction-range-round-to-int clears it
};

// Activation recompute (Megatron's flags and defaults): a memory policy, not part of the architecture (checkpoints do
// not record it). granularity "full" keeps only the input of every chunk of recomputed layers and runs the chunk's
// forward again in its backward (bitwise the same: the dropout masks are counter-based, MoE layers keep their
// routing); method "uniform" makes chunks of num_layers consecutive layers of each pipeline stage, "block" recomputes
// the first num_layers layers of each stage one by one and keeps the rest. granularity "selective" drops the outputs of
// the named modules and recomputes them from what the layer keeps (Megatron's output-discarding recompute): layernorm
// (the input and pre-MLP norms' outputs, from the residual stream and the norm statistics), moe_act (the routed
// experts' activation outputs, from their fc1 outputs), core_attn (the core attention's output and log-sum-exp, from
// the kept q, k, v: Megatron's default module), mlp (a dense layer's MLP: its norm output, fc1 output and
// activation, from the residual stream), moe (an MoE layer's dispatched rows, experts' and shared expert's
// activations: the layer runs again from its kept routing) and shared_experts (the shared expert's fc1 output and
// activation) and mla_up_proj (MLA's up projections: the attention kernel's input, from the kept latents).
struct RecomputeConfig {
  std::string granularity;           // --recompute-granularity: "" (Megatron's None: off) | full | selective
  std::string method;                // --recompute-method: uniform | block (needed by full)
  int64_t num_layers = 0;            // --recompute-num-layers: layers per chunk (uniform) or recomputed layers (block)
  std::vector<std::string> modules;  // --recompute-modules (selective; unset: Megatron's default, core_attn)
  void validate() const;             // Error naming the flags and values
  bool full() const { return granularity == "full"; }
  bool selects(const std::string& module) const {  // a module selective recompute drops (unset: core_attn)
    if (granularity != "selective") return false;
    return modules.empty() ? module == "core_attn" : std::find(modules.begin(), modules.end(), module) != modules.end();
  }
};

struct ModelConfig {
  int64_t num_layers = 2;           // --num-layers: transformer layers, e.g. 12
  int64_t hidden_size = 64;         // --hidden-size: H, e.g. 768
  int64_t num_attention_heads = 4;  // --num-attention-heads: query heads, e.g. 12
  int64_t num_query_groups = 0;     // --num-query-groups: key/value heads (GQA); 0 = num_attention_heads
  int64_t kv_channels = 0;          // --kv-channels: head dim D; 0 = hidden_size / num_attention_heads
  int64_t ffn_hidden_size = 0;      // --ffn-hidden-size: F; 0 = 4 * hidden_size
  int64_t vocab_size = 256;         // --vocab-size (padded): V
  int64_t seq_length = 128;         // --seq-length: S, tokens per sample
  float norm_epsilon = 1e-5f;       // --norm-epsilon
  Normalization normalization = Normalization::rmsnorm;                 // --normalization RMSNorm | LayerNorm
  PositionEmbedding position_embedding_type = PositionEmbedding::rope;  // --position-embedding-type
  int64_t max_position_embeddings = 0;  // --max-position-embeddings: rows of the learned table; 0 = seq_length
  float rotary_base = 10000.0f;         // --rotary-base
  float rotary_percent = 1.0f;          // --rotary-percent: share of each head's channels RoPE rotates, (0, 1]
  bool add_bias_linear = false;         // Megatron's add_bias_linear (--disable-bias-linear clears it): biases on
                                        // linear_qkv, linear_proj, linear_fc1, linear_fc2 and the experts' fc1/fc2
  bool add_qkv_bias = false;            // --add-qkv-bias: a bias on linear_qkv only (Qwen2-style)
  bool qk_layernorm = false;            // --qk-layernorm: the model's norm over each query and key head before RoPE
  // --qk-layernorm-over-heads (moecore): with --qk-layernorm, one norm over each token's whole query projection and
  // one over its whole key projection (all heads together: OLMoE's q_norm / k_norm, weights [heads * D] and
  // [groups * D]) instead of one over each head.
  bool qk_layernorm_over_heads = false;
  // Multi-latent attention (DeepSeek-V2/V3). With it, --qk-layernorm puts a norm on the q and kv latents.
  bool multi_latent_attention = false;  // --multi-latent-attention
  int64_t q_lora_rank = 0;              // --q-lora-rank: 0 (Megatron's None) projects q directly from the input
  int64_t kv_lora_rank = 32;            // --kv-lora-rank
  int64_t qk_head_dim = 128;            // --qk-head-dim: q/k channels per head without RoPE
  int64_t qk_pos_emb_head_dim = 64;     // --qk-pos-emb-head-dim: q/k channels per head with RoPE
  int64_t v_head_dim = 128;             // --v-head-dim
  bool yarn = false;                    // --rope-type yarn (Megatron's default with MLA)
  YarnConfig yarn_config;
  // Multi-token prediction (DeepSeek-V3; Megatron's MultiTokenPredictionBlock): depth k predicts token i + 1 + k.
  int64_t mtp_num_layers = 0;            // --mtp-num-layers (Megatron's None = 0: off)
  float mtp_loss_scaling_factor = 0.1f;  // --mtp-loss-scaling-factor: the MTP losses weigh this / mtp_num_layers
  float hidden_dropout = 0.0f;           // --hidden-dropout: embedding output and both bias-dropout-adds, [0, 1)
  float attention_dropout = 0.0f;        // --attention-dropout: on the attention probabilities, [0, 1)
  bool swiglu = true;                    // --swiglu (else GeLU MLP, Megatron's default); with --quick-geglu: the GLU
  // --quick-geglu: the gated linear unit with quick-GELU, x sigmoid(1.702 x) (GPT-OSS), instead of SiLU (swiglu is
  // then true: the MLPs are gated, fc1 [2F, H]).
  bool quick_geglu = false;
  float glu_linear_offset = 0.0f;            // --glu-linear-offset: act(gate) * (up + offset)
  float activation_func_clamp_value = 0.0f;  // --activation-func-clamp-value (Megatron's None: 0): the GLU's clamps
  ops::GluParams glu_params() const {
    return {quick_geglu ? ops::kQuickGeluAlpha : 1.0f, glu_linear_offset, activation_func_clamp_value};
  }
  ops::MlpActivation mlp_activation() const { return {swiglu, glu_params()}; }
  bool untie_embeddings_and_output_weights = true;  // --untie-embeddings-and-output-weights (else tied)
  float init_method_std = 0.02f;                    // --init-method-std: N(0, std^2) for weights
  DType compute_dtype = DType::f32;                 // --bf16 / --fp16 select bf16 / f16 compute (fp32 masters)
  moe::MoeConfig moe;                               // MoE flags; moe.num_experts == 0 keeps every layer dense
  std::string moe_layer_freq = "1";                 // --moe-layer-freq: integer N or a list expression ("[0]*3+[1]*58")
  SoftmaxType softmax_type = SoftmaxType::vanilla;  // --softmax-type vanilla | off-by-one | learnable
  // --window-size "(left, right)" (Megatron's sliding window; causal, so right is 0 or -1): in a windowed layer the
  // query at position p sees keys p - left .. p (left + 1 keys). -1 (Megatron's None, or left = -1): no window.
  int64_t window_size = -1;
  // --window-attn-skip-freq: which layers the window applies to: "" (Megatron's None: all), N (layer_number, 1-based,
  // is windowed when layer_number % N != 0) or a list expression of 0/1 per layer ("([1]*3+[0]*1)*2", 1 = windowed).
  std::string window_attn_skip_freq;
  RecomputeConfig recompute;  // --recompute-*: which activations backward recomputes
  nn::Fp8Config fp8;          // --fp8-*: FP8 training (off unless --fp8-format)

  int64_t query_groups() const { return num_query_groups ? num_query_groups : num_attention_heads; }
  int64_t head_dim() const { return kv_channels ? kv_channels : hidden_size / num_attention_heads; }
  int64_t ffn() const { return ffn_hidden_size ? ffn_hidden_size : 4 * hidden_size; }
  int64_t moe_ffn() const { return moe.ffn_hidden_size ? moe.ffn_hidden_size : ffn(); }
  int64_t max_positions() const { return max_position_embeddings ? max_position_embeddings : seq_length; }
  bool rope() const { return position_embedding_type == PositionEmbedding::rope; }
  // Channels RoPE rotates per head: int(head_dim * rotary_percent), as Megatron's RotaryEmbedding; MLA: the
  // q/k channels with RoPE.
  int64_t rotary_dim() const {
    return multi_latent_attention ? qk_pos_emb_head_dim
                                  : static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent);
  }
  // The MLA softmax scale is this / sqrt(qk_head_dim + qk_pos_emb_head_dim): YaRN's mscale(factor, mscale_all_dim)^2.
  float mla_softmax_scale_mult() const;
  bool qkv_bias() const { return add_bias_linear || add_qkv_bias; }
  std::vector<bool> moe_layers() const;     // which decoder layers are MoE (all false for a dense model)
  std::vector<bool> window_layers() const;  // which decoder layers have the sliding window (all false without one)
  // Decoder layers plus one transformer layer per MTP depth (those follow the decoder's in per-layer arrays).
  int64_t num_transformer_layers() const { return num_layers + mtp_num_layers; }
  void validate() const;            // throws Error naming the offending fields and values
  void validate_sizes() const;      // (validate's parts: sizes, positions, dropouts, dtype, norm;
  void validate_attention() const;  // QK-norm, MLA, YaRN, sinks, windows;
  void validate_fp8() const;        // FP8 training)
  std::string summary() const;
};

}  // namespace moecore::model
