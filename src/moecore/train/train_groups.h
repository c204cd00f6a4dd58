// The process groups of a multi-process training run (TP = CP = PP = 1). Megatron's semantics: the
// data-parallel group `dp` splits every global batch (with EP it contains the EP ranks: expert parallelism
// folds into data parallelism for the attention layers); `ep` is the model's expert-parallel group; `edp`
// holds the ranks with the same experts. Non-expert gradients are summed over dp, expert gradients over edp.
#pragma once
#include "moecore/parallel/comm.h"

namespace moecore::train {

struct TrainGroups {
  ProcessGroup dp = comm_single("dp");
  ProcessGroup ep = comm_single("ep");
  ProcessGroup edp = comm_single("edp");
};

}  // namespace moecore::train
