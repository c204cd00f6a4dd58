// The training loop for one process: micro-batches with gradient accumulation, AdamW with a warmup +
// cosine (or constant) learning-rate schedule, periodic validation and Megatron-style log lines.
// Not here (later issues): checkpoints, .bin/.idx datasets, metrics files, multi-process runs.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"

namespace moecore::train {

struct TrainConfig {
  int64_t micro_batch_size = 4;     // --micro-batch-size: sequences per forward/backward
  int64_t global_batch_size = 4;    // --global-batch-size: sequences per optimizer step
  int64_t train_iters = 100;        // --train-iters: optimizer steps
  float lr = 1e-3f;                 // --lr: peak learning rate
  float min_lr = 0.0f;              // --min-lr: floor of the decay
  int64_t lr_warmup_iters = 0;      // --lr-warmup-iters: linear warmup from 0
  std::string lr_decay_style = "cosine";  // --lr-decay-style: constant | linear | cosine
  int64_t log_interval = 10;        // --log-interval: steps between log lines
  int64_t eval_interval = 0;        // --eval-interval: steps between validations (0: only at the end)
  int64_t eval_iters = 4;           // --eval-iters: validation batches per evaluation
  uint64_t seed = 1234;             // --seed
  bool moe_per_layer_logging = false;  // --moe-per-layer-logging: a line per MoE layer at each log
  void validate() const;
  int64_t micro_batches() const { return global_batch_size / micro_batch_size; }
};

// Learning rate at (0-based) step `it`, Megatron's OptimizerParamScheduler semantics for these styles.
float lr_at(const TrainConfig& cfg, int64_t it);

// Supplies micro-batch `index` of the training (valid=false) or validation split into tokens/labels [B, S].
using BatchFn = std::function<void(Tensor& tokens, Tensor& labels, bool valid, int64_t index)>;

// MoE balancing losses of one step as Megatron logs them: the coefficient-free value of each configured
// loss, averaged over micro-batches and MoE layers.
struct MoeStepLosses {
  double aux_loss = 0, seq_aux_loss = 0, global_aux_loss = 0, z_loss = 0;
};

struct TrainLog {
  std::vector<double> train_loss;   // per step, mean over its micro-batches
  std::vector<double> grad_norm;    // per step, before clipping
  std::vector<MoeStepLosses> moe_losses;  // per step (zeros for dense models)
  std::vector<std::pair<int64_t, double>> valid_loss;  // (step, loss)
};

TrainLog train(model::GptModel& gpt, optim::AdamW& opt, const TrainConfig& cfg, const BatchFn& batches,
               std::FILE* log);

// Mean validation loss over cfg.eval_iters batches.
double evaluate(model::GptModel& gpt, const TrainConfig& cfg, const BatchFn& batches);

// Samples `count` tokens after `prompt` (temperature sampling, top-k 40) with the model's fixed sequence
// window; returns the new tokens.
std::vector<int32_t> generate(model::GptModel& gpt, const std::vector<int32_t>& prompt, int64_t count,
                              float temperature, uint64_t seed);

}  // namespace moecore::train
