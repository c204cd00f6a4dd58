// The parallel layout the process-group tests build their rank layouts from.
#pragma once
#include <string>

#include "moecore/parallel/process_groups.h"

namespace moecore::testing {

// TP, CP, PP, EP and ETP sizes (ETP 0: TP, Megatron's default), Megatron's rank order and
// --num-distributed-optimizer-instances.
inline ParallelConfig parallel_config(int tp, int cp, int pp, int ep, int etp,
                                      const std::string& order = ParallelConfig{}.order, int instances = 1) {
  ParallelConfig c;
  c.tensor_model_parallel_size = tp;
  c.context_parallel_size = cp;
  c.pipeline_model_parallel_size = pp;
  c.expert_model_parallel_size = ep;
  c.expert_tensor_parallel_size = etp;
  c.order = order;
  c.num_distributed_optimizer_instances = instances;
  return c;
}

}  // namespace moecore::testing
