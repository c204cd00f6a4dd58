#include "moecore/core/shard.h"

#include <cstring>

namespace moecore {

Shape TensorShard::local_shape(const Shape& global) const {
  if (!sharded()) return global;
  if (dim >= global.ndim || parts < 1 || size < 1 || global[dim] % (static_cast<int64_t>(parts) * size) != 0)
    MOECORE_FAIL("tensor shard: dim ", dim, " of ", global.str(), " does not split into ", parts, " piece(s) x ", size,
                 " ranks");
  Shape s = global;
  s[dim] /= size;
  return s;
}

Shape TensorShard::global_shape(const Shape& local) const {
  if (!sharded()) return local;
  MOECORE_CHECK(dim < local.ndim, "tensor shard: dim ", dim, " is out of range for ", local.str());
  Shape s = local;
  s[dim] *= size;
  return s;
}

namespace {
void check_pair(const Tensor& whole, const Tensor& local, const TensorShard& s, const char* what) {
  MOECORE_CHECK(whole.device() == Device::cpu && local.device() == Device::cpu && whole.is_contiguous() &&
                    local.is_contiguous() && whole.dtype() == local.dtype(),
                what, ": needs contiguous host tensors of one dtype, got ", whole.str(), " and ", local.str());
  MOECORE_CHECK(s.local_shape(whole.shape()) == local.shape(), what, ": the shard of ", whole.str(), " (dim ", s.dim,
                ", ", s.parts, " piece(s), rank ", s.rank, " of ", s.size, ") is not ", local.str());
}
}  // namespace

Tensor shard_slice(const Tensor& whole, const TensorShard& s) {
  Tensor local = Tensor::empty(s.local_shape(whole.shape()), whole.dtype(), MemCategory::workspace);
  check_pair(whole, local, s, "shard_slice");
  const int64_t es = dtype_size(whole.dtype());
  const auto* src = static_cast<const char*>(whole.raw());
  auto* dst = static_cast<char*>(local.raw());
  s.for_each_run(whole.shape(), [&](int64_t lo, int64_t go, int64_t n) {
    std::memcpy(dst + lo * es, src + go * es, static_cast<size_t>(n * es));
  });
  return local;
}

void shard_place(Tensor& whole, const Tensor& local, const TensorShard& s) {
  check_pair(whole, local, s, "shard_place");
  const int64_t es = dtype_size(whole.dtype());
  const auto* src = static_cast<const char*>(local.raw());
  auto* dst = static_cast<char*>(whole.raw());
  s.for_each_run(whole.shape(), [&](int64_t lo, int64_t go, int64_t n) {
    std::memcpy(dst + go * es, src + lo * es, static_cast<size_t>(n * es));
  });
}

}  // namespace moecore
