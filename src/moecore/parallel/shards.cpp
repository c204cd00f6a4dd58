#include "moecore/parallel/shards.h"

namespace moecore {

Tensor all_gather_shards(const Tensor& local, const TensorShard& s, const ProcessGroup& g) {
  const Tensor mine = local.to_device(Device::cpu);
  if (!s.sharded()) return mine;
  if (g.size() != s.size || g.rank() != s.rank)
    MOECORE_FAIL("all_gather_shards: the shard is rank ", s.rank, " of ", s.size, " but the group '", g.name(),
                 "' has rank ", g.rank(), " of ", g.size());
  const int64_t n = mine.numel();
  Tensor all = Tensor::empty({s.size * n}, mine.dtype(), MemCategory::workspace);
  all_gather(all, mine.view({n}), g);
  Tensor whole = Tensor::empty(s.global_shape(mine.shape()), mine.dtype(), MemCategory::workspace);
  for (int q = 0; q < s.size; ++q)
    shard_place(whole, all.slice(0, q * n, (q + 1) * n).view(mine.shape()), s.at_rank(q));
  return whole;
}

}  // namespace moecore
