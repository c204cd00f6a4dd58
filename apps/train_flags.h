// The training flags of `moecore train`: one table (train_flags.cpp, kTrainFlags) holds each flag once, with its
// kind, default, help, domain and the TrainConfig (or AdamWConfig) field it fills; a flag with a cross-field rule
// names the rule there. The fields' initializers in train/trainer.h and optim/adamw.h are the defaults (Megatron's,
// or moecore's where Megatron requires the flag), so --help, the parser and the structs never disagree. Not here:
// the model flags (model_flags.h) and Megatron's flags that are accepted without effect or refused (megatron_flags.h).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "apps/args.h"
#include "moecore/optim/adamw.h"
#include "moecore/train/trainer.h"

namespace moecore::apps {

// Declares every training flag (data, schedule, optimizer, loss scaling, checkpoints, logging, parallel layout, the
// closing sample) with its default, help and domain.
void add_training_flags(Args& a);

// The TrainConfig the flags give, validated; dp_size: the data-parallel size, which --global-batch-size (unset: the
// micro-batch size x dp) and --ddp-bucket-size (unset: max(40000000, 1000000 x dp)) default by. Rows without a field
// are read elsewhere (the parallel layout, data, device: train_cmd.cpp). hf_config_json is left to the caller.
train::TrainConfig train_config_from(const Args& a, int64_t dp_size);

// AdamW's settings (--adam-beta1, ..., --clip-grad), validated; Megatron's optimizers other than adam are refused by
// name, and reduced-precision moments need --use-precision-aware-optimizer.
optim::AdamWConfig optimizer_config_from(const Args& a);

// For tests: every row that fills a field, as (flag, the field's value in t or o as --help would print it), in the
// table's order; `ruled`: whether a cross-field rule may change the field after it is read.
struct TrainFlagField {
  std::string flag, value;
  bool ruled = false;
};
std::vector<TrainFlagField> train_flag_fields(const train::TrainConfig& t, const optim::AdamWConfig& o);

}  // namespace moecore::apps
