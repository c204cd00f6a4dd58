// The values a training step reports besides its lm loss -- the MTP losses and the MoE balancing losses -- as one
// list: each entry names itself once (its log-line label and its TensorBoard / --metrics-jsonl key), says how it is
// reduced over the pipeline stages and data-parallel ranks, and how a log interval summarises it. The step fills it
// (step.cpp), one call reduces it, and the log line, JSONL and TensorBoard all read it (run_log.cpp).
// Not here: the interval's timing and communication shares (run_log.h), the optimizer's fields (grad norm, ...).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/parallel/comm.h"

namespace moecore::train {

enum class MetricReduce : uint8_t { mean, sum };  // over the data-parallel ranks (the stages always sum)
enum class MetricInterval : uint8_t {
  mean,  // the mean over the interval's steps that were not skipped (Megatron's averaged losses)
  last,  // the logged step's value
};

struct StepMetric {
  std::string label;  // on the log line: " | <label> %.4f"
  std::string key;    // TensorBoard tag and --metrics-jsonl key
  MetricReduce over_dp = MetricReduce::mean;
  MetricInterval over_interval = MetricInterval::mean;
  bool per_moe_layer = false;  // summed over micro-batches and MoE layers: reduce() divides by their count
  double value = 0;
};

class StepMetrics {
 public:
  // Appends an entry (value 0); the list's order is the order on the log line and in the metrics.
  void add(StepMetric m) { items_.push_back(std::move(m)); }
  const std::vector<StepMetric>& items() const { return items_; }
  std::vector<StepMetric>& items() { return items_; }
  // The value under `key` (0 when the step has none: a dense model's MoE losses).
  double value(std::string_view key) const;
  // Over the pipeline stages (sum: each stage holds its own layers' share; the loss heads' values are the last
  // stage's), then the per_moe_layer entries divided by micro_batches x the MoE layers of every stage, then over the
  // data-parallel ranks (mean or sum). `loss` (the step's lm loss, a mean over dp) and `moe_layers` (this stage's
  // count) travel in the same two collectives. Collective over pp and dp when they have more than one rank.
  void reduce(double& loss, int64_t moe_layers, int64_t micro_batches, const ProcessGroup& pp, const ProcessGroup& dp);

 private:
  std::vector<StepMetric> items_;
};

}  // namespace moecore::train
