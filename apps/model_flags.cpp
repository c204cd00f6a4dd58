#include "apps/model_flags.h"

#include <string>

#include "moecore/core/error.h"

namespace moecore::apps {

void add_model_flags(Args& a, const model::ModelConfig& d) {
  a.option("--num-layers", std::to_string(d.num_layers), "transformer layers")
      .option("--hidden-size", std::to_string(d.hidden_size), "hidden size H")
      .option("--num-attention-heads", std::to_string(d.num_attention_heads), "query heads")
      .option("--num-query-groups", std::to_string(d.num_query_groups), "key/value heads (GQA); 0 = heads")
      .option("--kv-channels", std::to_string(d.kv_channels), "head dim; 0 = hidden / heads")
      .option("--ffn-hidden-size", std::to_string(d.ffn_hidden_size), "MLP hidden size; 0 = 4 * hidden")
      .option("--vocab-size", std::to_string(d.vocab_size), "vocabulary size")
      .option("--seq-length", std::to_string(d.seq_length), "tokens per sample")
      .option("--norm-epsilon", std::to_string(d.norm_epsilon), "RMSNorm epsilon")
      .option("--rotary-base", std::to_string(d.rotary_base), "RoPE base")
      .option("--init-method-std", std::to_string(d.init_method_std), "std of the normal weight init")
      .option("--normalization", "RMSNorm", "RMSNorm or LayerNorm (Megatron's default is LayerNorm)")
      .flag("--swiglu", "SwiGLU MLP (without it: GeLU, as in Megatron)")
      .flag("--untie-embeddings-and-output-weights", "separate output layer (without it the embedding is shared)")
      .flag("--bf16", "bf16 compute with fp32 master weights");
}

model::ModelConfig model_config_from(const Args& a) {
  model::ModelConfig c;
  c.num_layers = a.i64("--num-layers");
  c.hidden_size = a.i64("--hidden-size");
  c.num_attention_heads = a.i64("--num-attention-heads");
  c.num_query_groups = a.i64("--num-query-groups");
  c.kv_channels = a.i64("--kv-channels");
  c.ffn_hidden_size = a.i64("--ffn-hidden-size");
  c.vocab_size = a.i64("--vocab-size");
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
  c.validate();
  return c;
}

}  // namespace moecore::apps
