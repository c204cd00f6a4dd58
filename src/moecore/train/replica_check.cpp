// The replica-divergence guard: an FNV-1a hash of each parameter's fp32 master values (a host copy for device
// tensors), all-gathered over the group its gradient is reduced over, and compared.
#include "moecore/train/replica_check.h"

#include <span>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/comm.h"

namespace moecore::train {
namespace {

int64_t tensor_hash(const Tensor& t) {
  const Tensor host = t.to_device(Device::cpu);
  const auto* b = static_cast<const unsigned char*>(host.raw());
  uint64_t h = 0xCBF29CE484222325ull;
  for (int64_t i = 0; i < host.nbytes(); ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return static_cast<int64_t>(h);
}

// Compares the hashes of `params` (this rank's) with the other members of `g`; Error naming the first that differs.
void compare(const std::vector<const Param*>& params, const ProcessGroup& g) {
  if (g.size() <= 1 || params.empty()) return;
  std::vector<int64_t> mine;
  mine.reserve(params.size());
  for (const Param* p : params) mine.push_back(tensor_hash(p->value));
  const auto n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> all(static_cast<size_t>(n * g.size()));
  all_gather(std::span<int64_t>(all), std::span<const int64_t>(mine), g);
  for (int64_t i = 0; i < n; ++i)
    for (int r = 1; r < g.size(); ++r)
      if (all[static_cast<size_t>(r * n + i)] != all[static_cast<size_t>(i)])
        MOECORE_FAIL("--check-weight-hash-across-dp-replicas-interval: the replicas of '",
                     params[static_cast<size_t>(i)]->name, "' differ: ", g.name(), " rank ", r,
                     " holds other values than ", g.name(), " rank 0 (this rank is ", g.name(), " rank ", g.rank(),
                     "); the data-parallel replicas have diverged, so the run stops before it trains on");
}

}  // namespace

int64_t check_replica_hashes(const model::GptModel& gpt, const TrainGroups& groups, int64_t iteration, std::FILE* log) {
  std::vector<const Param*> dense, expert;
  for (const Param& p : gpt.params()) (p.expert_parallel ? expert : dense).push_back(&p);
  compare(dense, groups.dense_grads());
  compare(expert, groups.edp);
  if (log) std::fprintf(log, " >>> Weight hashes match after %lld iterations\n", static_cast<long long>(iteration));
  return static_cast<int64_t>(dense.size() + expert.size());
}

}  // namespace moecore::train
