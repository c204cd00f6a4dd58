// A parameter's tensor-parallel shard (Megatron's column- and row-parallel weights, the vocabulary-parallel
// embedding): the global tensor is split along `dim` into `parts` equal pieces (2 for SwiGLU's fc1, whose gate and up
// halves are split together), and each piece into `size` equal slices; rank r holds slice r of every piece, the
// pieces in order. dim < 0 or size 1: the tensor is whole on every rank.
// Pure index arithmetic (no communication): initialisation, checkpoints and tests map local elements to global ones
// through for_each_run.
#pragma once
#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore {

struct TensorShard {
  int dim = -1;   // the split dim, or -1: replicated
  int parts = 1;  // equal pieces of that dim, each split over the group
  int rank = 0;   // this rank's slice
  int size = 1;   // ranks in the group
  bool sharded() const { return dim >= 0 && size > 1; }
  // The local shape of a global one; raises Error naming both when the dim does not divide into parts x size.
  Shape local_shape(const Shape& global) const;
  Shape global_shape(const Shape& local) const;
  TensorShard at_rank(int r) const {
    TensorShard s = *this;
    s.rank = r;
    return s;
  }

  // fn(local_offset, global_offset, length): the contiguous runs of the local tensor (row-major, in elements) and
  // where each sits in the global tensor, in local order.
  template <class Fn>
  void for_each_run(const Shape& global, Fn&& fn) const {
    if (!sharded()) {
      fn(int64_t{0}, int64_t{0}, global.numel());
      return;
    }
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < dim; ++i) outer *= global[i];
    for (int i = dim + 1; i < global.ndim; ++i) inner *= global[i];
    const int64_t n = global[dim], piece = n / parts, slice = piece / size, len = slice * inner;
    int64_t local = 0;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t p = 0; p < parts; ++p, local += len)
        fn(local, (o * n + p * piece + static_cast<int64_t>(rank) * slice) * inner, len);
  }
};

// Host tensors: the shard of a whole tensor (copied out), and a shard written into its place in the whole tensor.
// Both contiguous, one dtype.
Tensor shard_slice(const Tensor& whole, const TensorShard& s);
void shard_place(Tensor& whole, const Tensor& local, const TensorShard& s);

}  // namespace moecore
