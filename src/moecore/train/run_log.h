// The reports of a training run: the log line every cfg.log_interval steps (Megatron's, with MFU, communication shares
// and ETA), the validation lines, and the metrics (--metrics-jsonl, --tensorboard-dir). Internal to train/: trainer.cpp
// feeds it every step. Not here: what a step computes (step.h), the run around it (trainer.h).
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moecore/io/metrics.h"
#include "moecore/model/gpt.h"
#include "moecore/parallel/comm.h"
#include "moecore/train/step.h"
#include "moecore/train/timers.h"
#include "moecore/train/train_groups.h"
#include "moecore/train/trainer.h"

namespace moecore::train {

// MoE ECHO's plans of the last micro-batch, per layer (nullopt: no ECHO there), read once per logged step.
using EchoLayers = std::vector<std::optional<moe::EchoStatsHost>>;

// One interval's measurements: per step (dt: seconds; the run's tokens/s and model TFLOP/s) and shares of the
// interval (-1: not measured in this layout).
struct IntervalStats {
  double dt = 0, tokens_per_s = 0, tflops = 0;
  double comm_share = -1, exposed_share = -1, grad_reduce_share = -1, pipeline_wait_share = -1, bubble = 0;
};

// Writers for --metrics-jsonl and --tensorboard-dir, opened once per run.
struct MetricSinks {
  std::unique_ptr<io::JsonlMetricsWriter> jsonl;
  std::unique_ptr<io::TensorBoardWriter> tb;
};

// The log line every cfg.log_interval steps (Megatron's, with MFU, communication shares and ETA) and the metrics
// (--metrics-jsonl, --tensorboard-dir: written by the first rank only -- data-, tensor- and context-parallel rank 0 --
// as every rank holds the same reduced values), averaged over the interval's steps that were not skipped; validation
// lines. With Megatron's logging flags (TrainConfig): the logged step's num zeros and params norm, the throughput per
// GPU, and after the line the timers block of the interval (timers.h); under loss scaling the line's loss scale (and
// Megatron's skipped-iterations count, which counts its overflows); in the metrics loss-scale (1 without loss scaling,
// as Megatron; not with --no-log-loss-scale-to-tensorboard), num-zeros, params-norm,
// iteration-time, throughput, "<timer>-time" and the memory of the model's device (Megatron's torch.cuda.memory_stats
// keys): mem-allocated-bytes, mem-max-allocated-bytes and mem-allocated-count are moecore's counters of the tensors on
// that device (memory_device_stats: bytes live, their peak, storages live); mem-reserved-bytes is on cuda what the
// device-memory pool holds from the driver (live tensors and freed blocks kept for reuse), on cpu and sim, whose
// tensors come from the process's heap and mappings, the process's resident set (the closest count of what it holds
// from the system; it includes the program and its libraries). The lines follow TrainConfig::logging_level. Every rank
// calls step() (the timers and the pipeline's shares are collective).
class RunLog {
 public:
  RunLog(model::GptModel& gpt, const TrainConfig& cfg, const TrainGroups& g, int64_t first_iteration, std::FILE* log,
         Timers* timers = nullptr);
  // After step `it` (0-based): a line and metrics when it ends an interval.
  void step(int64_t it, const StepResult& r, float lr, int64_t consumed_samples, double grad_reduce_blocked,
            double pipeline_wait);
  void validation(int64_t it, double v);
  // Time spent outside training steps (evaluation) stays out of the next interval's throughput and shares.
  void exclude(std::chrono::steady_clock::duration d);

 private:
  void interval(int64_t it, const StepResult& r, float lr, int64_t consumed_samples);
  IntervalStats take_interval_stats();  // collective over pp
  std::string format_run_fields(const IntervalStats& st, const EchoLayers& echo);
  std::vector<std::pair<std::string, double>> flag_metrics(const StepResult& r, const IntervalStats& st,
                                                           const TimerReport& timers) const;

  model::GptModel& gpt_;
  const TrainConfig& cfg_;
  const TrainGroups& g_;
  int64_t micro_per_rank_;
  std::FILE* log_;
  Timers* timers_;
  int64_t first_iteration_;
  int world_size_;
  double flops_per_step_, peak_gflops_;
  MetricSinks sinks_;
  std::chrono::steady_clock::time_point t_start_ = std::chrono::steady_clock::now(), t_last_ = t_start_;
  double blocked_last_ = comm_blocked_seconds(), grad_reduce_blocked_ = 0, pipeline_wait_ = 0;
  double loss_acc_ = 0;
  std::vector<double> metric_acc_;  // the step loss list's values summed over the interval (steps not skipped)
  int64_t logged_steps_ = 0;
  int64_t retries_ = 0;  // steps of the interval run again (received-token capacity)
  int64_t skipped_ = 0;  // steps of the interval skipped (--nan-action skip)
};

}  // namespace moecore::train
