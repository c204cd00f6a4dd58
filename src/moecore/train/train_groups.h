// The process groups of a multi-process training run (CP = PP = 1). Megatron's semantics: the data-parallel
// group `dp` splits every global batch (with EP it contains the EP ranks: expert parallelism folds into data
// parallelism for the attention layers); `tp` is the model's tensor-parallel group (its ranks see the same
// batch); `ep` is the model's expert-parallel group; `edp` holds the ranks with the same experts. Non-expert
// gradients are summed over dp, expert gradients over edp (after the model has summed its tp_grad_sum
// parameters over tp).
#pragma once
#include "moecore/parallel/comm.h"

namespace moecore::train {

struct TrainGroups {
  ProcessGroup dp = comm_single("dp");
  ProcessGroup ep = comm_single("ep");
  ProcessGroup edp = comm_single("edp");
  ProcessGroup tp = comm_single("tp");
  ProcessGroup tp_dp = comm_single("tp_dp");  // every rank of the run (checkpoints); needed when tp > 1
};

}  // namespace moecore::train
