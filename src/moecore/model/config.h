// Model configuration of a GPT decoder, with Megatron's argument names in the comments.
// Validated once at start-up; errors name the fields and values.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/dtype.h"
#include "moecore/moe/config.h"

namespace moecore::model {

enum class Normalization : uint8_t { rmsnorm, layernorm };

struct ModelConfig {
  int64_t num_layers = 2;             // --num-layers: transformer layers, e.g. 12
  int64_t hidden_size = 64;           // --hidden-size: H, e.g. 768
  int64_t num_attention_heads = 4;    // --num-attention-heads: query heads, e.g. 12
  int64_t num_query_groups = 0;       // --num-query-groups: key/value heads (GQA); 0 = num_attention_heads
  int64_t kv_channels = 0;            // --kv-channels: head dim D; 0 = hidden_size / num_attention_heads
  int64_t ffn_hidden_size = 0;        // --ffn-hidden-size: F; 0 = 4 * hidden_size
  int64_t vocab_size = 256;           // --vocab-size (padded): V
  int64_t seq_length = 128;           // --seq-length: S, tokens per sample
  float norm_epsilon = 1e-5f;         // --norm-epsilon
  Normalization normalization = Normalization::rmsnorm;  // --normalization RMSNorm | LayerNorm
  float rotary_base = 10000.0f;       // --rotary-base
  bool swiglu = true;                 // --swiglu (else GeLU MLP, Megatron's default)
  bool untie_embeddings_and_output_weights = true;  // --untie-embeddings-and-output-weights (else tied)
  float init_method_std = 0.02f;      // --init-method-std: N(0, std^2) for weights
  DType compute_dtype = DType::f32;   // --bf16 selects bf16 compute (fp32 master weights)
  moe::MoeConfig moe;                 // MoE flags; moe.num_experts == 0 keeps every layer dense
  std::string moe_layer_freq = "1";   // --moe-layer-freq: integer N or a 0/1 list of num_layers entries

  int64_t query_groups() const { return num_query_groups ? num_query_groups : num_attention_heads; }
  int64_t head_dim() const { return kv_channels ? kv_channels : hidden_size / num_attention_heads; }
  int64_t ffn() const { return ffn_hidden_size ? ffn_hidden_size : 4 * hidden_size; }
  int64_t moe_ffn() const { return moe.ffn_hidden_size ? moe.ffn_hidden_size : ffn(); }
  std::vector<bool> moe_layers() const;  // which layers are MoE (all false for a dense model)
  void validate() const;  // throws Error naming the offending fields and values
  std::string summary() const;
};

}  // namespace moecore::model
