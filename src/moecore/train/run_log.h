// The reports of a training run: the log line every cfg.log_interval steps (Megatron's, with MFU, communication shares
// and ETA), the validation lines, and the metrics (--metrics-jsonl, --tensorboard-dir). Internal to train/: trainer.cpp
// feeds it every step. Not here: what a step computes (step.h), the run around it (trainer.h).
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <vector>

#include "moecore/io/metrics.h"
#include "moecore/model/gpt.h"
#include "moecore/parallel/comm.h"
#include "moecore/train/step.h"
#include "moecore/train/train_groups.h"
#include "moecore/train/trainer.h"

namespace moecore::train {

// MoE ECHO's plans of the last micro-batch, per layer (nullopt: no ECHO there), read once per logged step.
using EchoLayers = std::vector<std::optional<moe::EchoStatsHost>>;

// Writers for --metrics-jsonl and --tensorboard-dir, opened once per run.
struct MetricSinks {
  std::unique_ptr<io::JsonlMetricsWriter> jsonl;
  std::unique_ptr<io::TensorBoardWriter> tb;
};

// The log line every cfg.log_interval steps (Megatron's, with MFU, communication shares and ETA) and the metrics
// (--metrics-jsonl, --tensorboard-dir: written by the first rank only -- data-, tensor- and context-parallel rank 0 --
// as every rank holds the same reduced values), averaged over the interval's steps that were not skipped; validation
// lines.
class RunLog {
 public:
  RunLog(model::GptModel& gpt, const TrainConfig& cfg, const TrainGroups& g, int64_t first_iteration, std::FILE* log);
  // After step `it` (0-based): a line and metrics when it ends an interval.
  void step(int64_t it, const StepResult& r, float lr, int64_t consumed_samples, double grad_reduce_blocked,
            double pipeline_wait);
  void validation(int64_t it, double v);
  // Time spent outside training steps (evaluation) stays out of the next interval's throughput and shares.
  void exclude(std::chrono::steady_clock::duration d);

 private:
  void interval(int64_t it, const StepResult& r, float lr, int64_t consumed_samples);

  model::GptModel& gpt_;
  const TrainConfig& cfg_;
  const ProcessGroup& pp_;
  int64_t micro_per_rank_;
  std::FILE* log_;
  int64_t first_iteration_;
  int world_size_;
  double flops_per_step_, peak_gflops_;
  MetricSinks sinks_;
  std::chrono::steady_clock::time_point t_start_ = std::chrono::steady_clock::now(), t_last_ = t_start_;
  double blocked_last_ = comm_blocked_seconds(), grad_reduce_blocked_ = 0, pipeline_wait_ = 0;
  double loss_acc_ = 0;
  std::vector<double> mtp_acc_;  // MTP losses over the interval
  int64_t logged_steps_ = 0;
  int64_t retries_ = 0;  // steps of the interval run again (received-token capacity)
  int64_t skipped_ = 0;  // steps of the interval skipped (--nan-action skip)
};

}  // namespace moecore::train
