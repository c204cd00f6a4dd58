// The whole tensor from its tensor-parallel shards (core/shard.h): checkpoints save layout-free tensors, and tests
// compare a sharded run with one process. Not for the step loop (it allocates host tensors).
#pragma once
#include "moecore/core/shard.h"
#include "moecore/parallel/comm.h"

namespace moecore {

// Collective over g (its size must equal s.size, its rank s.rank): every rank gets the global tensor, on the host.
// local: this rank's shard, any device, contiguous. A replicated tensor (!s.sharded()) comes back as a host copy.
Tensor all_gather_shards(const Tensor& local, const TensorShard& s, const ProcessGroup& g);

}  // namespace moecore
