// `moecore generate`: samples text from a checkpoint. The model flags must match the training run's
// (the checkpoint's recorded configuration is checked, as Megatron's text-generation tools require).
#include <cstdio>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/data_flags.h"
#include "apps/hf_config.h"
#include "apps/model_flags.h"
#include "moecore/core/error.h"
#include "moecore/io/checkpoint.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/trainer.h"

namespace moecore::apps {

int generate_main(int argc, char** argv) {
  Args a("generate");
  model::ModelConfig defaults;
  defaults.num_layers = 4;
  defaults.hidden_size = 128;
  defaults.num_attention_heads = 4;
  defaults.vocab_size = 0;
  defaults.seq_length = 128;
  add_model_flags(a, defaults);
  add_tokenizer_flags(a);
  add_hf_config_flag(a);
  a.option("--load", "", "checkpoint directory (the newest committed checkpoint is used)")
      .option("--ckpt-step", "", "load this iteration of --load instead of the newest")
      .option("--prompt", "The ", "text to continue (empty: a new document, from the end-of-document token)")
      .option("--max-new-tokens", "200", "tokens to sample")
      .option("--temperature", "0.8", "sampling temperature (top-k 40)")
      .option("--seed", "1234", "sampling seed")
      .domain("--ckpt-step", FlagDomain::integer(0, 1e12))
      .domain("--max-new-tokens", FlagDomain::integer(0, 1e6))
      .domain("--temperature", FlagDomain::positive_number())
      .domain("--seed", FlagDomain::integer(0, 4294967295.0));
  if (!a.parse(argc, argv)) return 0;
  hf_config_apply(a, "--hf-config");
  if (a.str("--load").empty()) MOECORE_FAIL("generate: --load is required");
  const auto tok = tokenizer_from(a);
  const model::ModelConfig mcfg = model_config_from(a, padded_vocab_size(*tok, a));
  const int64_t step = a.i64_or("--ckpt-step", -1);
  const auto dir = io::checkpoint_find_latest(a.str("--load"), step >= 0 ? std::optional<int64_t>(step) : std::nullopt);
  if (!dir) MOECORE_FAIL("generate: no committed checkpoint under ", a.str("--load"));
  model::GptModel gpt(mcfg, 1, 0);
  optim::AdamW opt(gpt.params(), optim::AdamWConfig{});
  const uint64_t seed = static_cast<uint64_t>(a.i64("--seed"));
  train::load_training_checkpoint(*dir, gpt, opt, seed);
  const std::string prompt = a.str("--prompt");
  std::vector<int32_t> ids;
  try {
    ids = train::generate(gpt, prompt_tokens(*tok, prompt), a.i64("--max-new-tokens"),
                          static_cast<float>(a.f64("--temperature")), seed, tok->eod(), tok->vocab_size());
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (checkpoint " + *dir + ")");
  }
  std::printf("%s%s\n", prompt.c_str(), tok->decode(ids).c_str());
  return 0;
}

}  // namespace moecore::apps
