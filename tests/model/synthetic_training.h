// The small MoE model and the deterministic synthetic data the training tests share (single-process
// resume/NaN tests and the multi-rank equivalence tests).
#pragma once
#include "moecore/core/rng.h"
#include "moecore/core/tensor.h"
#include "moecore/model/config.h"
#include "moecore/train/trainer.h"

namespace moecore::testing {

// 2 layers (dense, then MoE), hidden 32, 4 heads in 2 groups, vocab 64, sequence 16; top-2 over
// `num_experts` experts of ffn 24 with aux_loss 1e-2.
inline model::ModelConfig small_moe_model(int64_t num_experts) {
  model::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.moe.num_experts = num_experts;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = 24;
  c.moe.aux_loss_coeff = {1e-2f};
  c.moe_layer_freq = "[0,1]";
  return c;
}

// The training settings those tests start from: micro-batches of 2 in a global batch of 4 (gradient accumulation),
// lr 5e-3 after 2 warm-up steps, one validation batch.
inline train::TrainConfig small_train_config(int64_t iters) {
  train::TrainConfig t;
  t.micro_batch_size = 2;
  t.global_batch_size = 4;
  t.train_iters = iters;
  t.lr = 5e-3f;
  t.lr_warmup_iters = 2;
  t.eval_iters = 1;
  // Values these tests were written against where TrainConfig's defaults (the command line's) differ.
  t.lr_decay_style = train::LrDecayStyle::cosine;
  t.log_interval = 10;
  t.exit_signal_handler = true;
  return t;
}

// Batch `index` depends on the index alone, like the real samplers; labels are a learnable mapping of the
// tokens (vocab 64).
inline void synthetic_batch(Tensor& tok, Tensor& lab, bool valid, int64_t index) {
  const int64_t n = tok.numel();
  const PhiloxKey key = philox_key(valid ? 2 : 1, "synthetic");
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = static_cast<int32_t>(philox_uniform(key, static_cast<uint64_t>(index * n + i)) * 61);
    tok.data<int32_t>()[i] = v;
    lab.data<int32_t>()[i] = (v * 7 + 3) % 64;
  }
}

}  // namespace moecore::testing
