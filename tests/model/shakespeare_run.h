// The shared recipe of the "learns tinyshakespeare" tests: a 2-layer byte-level model (dense or MoE, as the
// caller configures) trained 300 steps on ../shared/data/tinyshakespeare with one fixed optimizer setup, on
// testing::test_device().
#pragma once
#include <string>

#include "moecore/data/byte_corpus.h"
#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "moecore/train/trainer.h"
#include "test_util.h"

namespace moecore::testing {

struct ShakespeareRun {
  double valid_before = 0;  // validation loss of the initial weights
  train::TrainLog log;
};

// The model config with its byte-level shape filled in; callers add MoE fields before run_shakespeare.
inline model::ModelConfig shakespeare_config() {
  model::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.vocab_size = 256;
  c.seq_length = 64;
  return c;
}

inline ShakespeareRun run_shakespeare(const model::ModelConfig& c, const std::string& data_dir) {
  const data::ByteCorpus corpus(data_dir + "/tinyshakespeare/input.txt", 0.1);
  train::TrainConfig t;
  t.micro_batch_size = 16;
  t.global_batch_size = 16;
  t.train_iters = 300;
  t.lr = 1e-2f;
  t.min_lr = 1e-3f;
  t.lr_warmup_iters = 20;
  t.eval_iters = 8;
  // Values these tests were written against where TrainConfig's defaults (the command line's) differ.
  t.lr_decay_style = train::LrDecayStyle::cosine;
  t.log_interval = 10;
  t.exit_signal_handler = true;
  model::GptModel m(c, t.micro_batch_size, 1234, {}, test_device());
  optim::AdamWConfig o;
  o.beta2 = 0.95f;
  o.weight_decay = 0.1f;
  optim::AdamW opt(m.params(), o);
  const train::BatchFn batches = [&](Tensor& tok, Tensor& lab, bool valid, int64_t i) {
    corpus.batch(tok, lab, valid, t.seed, i);
  };
  ShakespeareRun r;
  r.valid_before = train::evaluate(m, t, batches);
  r.log = train::train(m, opt, t, batches, nullptr);
  return r;
}

}  // namespace moecore::testing
