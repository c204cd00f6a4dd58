// A training step's loss list and its reduction (step_metrics.h).
#include "moecore/train/step_metrics.h"

#include <span>

namespace moecore::train {

double StepMetrics::value(std::string_view key) const {
  for (const StepMetric& m : items_)
    if (m.key == key) return m.value;
  return 0.0;
}

void StepMetrics::reduce(double& loss, int64_t moe_layers, int64_t micro_batches, const ProcessGroup& pp,
                         const ProcessGroup& dp) {
  std::vector<double> v;
  v.reserve(items_.size() + 2);
  v.push_back(loss);
  for (const StepMetric& m : items_) v.push_back(m.value);
  v.push_back(static_cast<double>(moe_layers));
  if (pp.size() > 1) all_reduce_sum(std::span<double>(v), pp);
  const double layers = v.back();
  v.pop_back();
  if (layers > 0)
    for (size_t i = 0; i < items_.size(); ++i)
      if (items_[i].per_moe_layer) v[i + 1] /= static_cast<double>(micro_batches) * layers;
  if (dp.size() > 1) {
    all_reduce_sum(std::span<double>(v), dp);
    const double n = dp.size();
    v[0] /= n;
    for (size_t i = 0; i < items_.size(); ++i)
      if (items_[i].over_dp == MetricReduce::mean) v[i + 1] /= n;
  }
  loss = v[0];
  for (size_t i = 0; i < items_.size(); ++i) items_[i].value = v[i + 1];
}

}  // namespace moecore::train
