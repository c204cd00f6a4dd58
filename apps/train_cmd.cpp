// `moecore train`: trains a GPT on a text file (byte-level tokens), logs Megatron-style lines, validates,
// and prints a generated sample at the end.
#include <cstdio>
#include <string>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/model_flags.h"
#include "moecore/data/byte_corpus.h"
#include "moecore/train/trainer.h"

namespace moecore::apps {

int train_main(int argc, char** argv) {
  Args a("train");
  model::ModelConfig defaults;
  defaults.num_layers = 4;
  defaults.hidden_size = 128;
  defaults.num_attention_heads = 4;
  defaults.vocab_size = 256;
  defaults.seq_length = 128;
  add_model_flags(a, defaults);
  a.option("--data-path", "", "text file to train on (byte-level tokens, vocabulary 256)")
      .option("--split-valid-fraction", "0.05", "share of the file held out for validation")
      .option("--micro-batch-size", "8", "sequences per forward/backward")
      .option("--global-batch-size", "8", "sequences per optimizer step")
      .option("--train-iters", "200", "optimizer steps")
      .option("--lr", "3e-3", "peak learning rate")
      .option("--min-lr", "3e-4", "final learning rate of the decay")
      .option("--lr-warmup-iters", "20", "linear warmup steps")
      .option("--lr-decay-style", "cosine", "constant | linear | cosine")
      .option("--weight-decay", "0.1", "decoupled weight decay on 2-D weights")
      .option("--adam-beta1", "0.9", "AdamW beta1")
      .option("--adam-beta2", "0.95", "AdamW beta2")
      .option("--adam-eps", "1e-8", "AdamW epsilon")
      .option("--clip-grad", "1.0", "global gradient-norm clip (0: off)")
      .option("--log-interval", "10", "steps between log lines")
      .option("--eval-interval", "50", "steps between validations")
      .option("--eval-iters", "8", "validation batches")
      .option("--seed", "1234", "random seed (weights, data order)")
      .flag("--moe-per-layer-logging", "log tokens per expert, load, drops and losses of every MoE layer")
      .option("--generate-tokens", "300", "tokens sampled after training (0: none)")
      .option("--prompt", "ROMEO:\n", "text the sample starts from");
  if (!a.parse(argc, argv)) return 0;
  if (a.str("--data-path").empty()) MOECORE_FAIL("train: --data-path is required");
  const model::ModelConfig mcfg = model_config_from(a);
  if (mcfg.vocab_size < 256) MOECORE_FAIL("train: byte-level data needs --vocab-size >= 256, got ", mcfg.vocab_size);

  train::TrainConfig tcfg;
  tcfg.micro_batch_size = a.i64("--micro-batch-size");
  tcfg.global_batch_size = a.i64("--global-batch-size");
  tcfg.train_iters = a.i64("--train-iters");
  tcfg.lr = static_cast<float>(a.f64("--lr"));
  tcfg.min_lr = static_cast<float>(a.f64("--min-lr"));
  tcfg.lr_warmup_iters = a.i64("--lr-warmup-iters");
  tcfg.lr_decay_style = a.str("--lr-decay-style");
  tcfg.log_interval = a.i64("--log-interval");
  tcfg.eval_interval = a.i64("--eval-interval");
  tcfg.eval_iters = a.i64("--eval-iters");
  tcfg.seed = static_cast<uint64_t>(a.i64("--seed"));
  tcfg.moe_per_layer_logging = a.on("--moe-per-layer-logging");
  tcfg.validate();
  optim::AdamWConfig ocfg;
  ocfg.beta1 = static_cast<float>(a.f64("--adam-beta1"));
  ocfg.beta2 = static_cast<float>(a.f64("--adam-beta2"));
  ocfg.eps = static_cast<float>(a.f64("--adam-eps"));
  ocfg.weight_decay = static_cast<float>(a.f64("--weight-decay"));
  ocfg.clip_grad = static_cast<float>(a.f64("--clip-grad"));

  const data::ByteCorpus corpus(a.str("--data-path"), a.f64("--split-valid-fraction"));
  model::GptModel gpt(mcfg, tcfg.micro_batch_size, tcfg.seed);
  optim::AdamW opt(gpt.params(), ocfg);
  std::printf("moecore train: %s\n  %lld parameters; corpus %lld train / %lld validation tokens\n%s",
              mcfg.summary().c_str(), static_cast<long long>(gpt.num_parameters()),
              static_cast<long long>(corpus.train_tokens()), static_cast<long long>(corpus.valid_tokens()),
              gpt.memory_plan(opt.state_bytes_per_param()).format().c_str());
  const train::BatchFn batches = [&](Tensor& t, Tensor& l, bool valid, int64_t i) {
    corpus.batch(t, l, valid, tcfg.seed, i);
  };
  const double v0 = train::evaluate(gpt, tcfg, batches);
  std::printf(" validation loss before training: %.4f\n", v0);
  train::train(gpt, opt, tcfg, batches, stdout);
  const int64_t n = a.i64("--generate-tokens");
  if (n > 0) {
    const std::string prompt = a.str("--prompt");
    const std::vector<int32_t> ids(prompt.begin(), prompt.end());
    const auto out = train::generate(gpt, ids, n, 0.8f, tcfg.seed);
    std::printf("\n---- sample ----\n%s%s\n----------------\n", prompt.c_str(), data::ByteCorpus::decode(out).c_str());
  }
  return 0;
}

}  // namespace moecore::apps
