// One description of a module's buffers, walked twice: once to allocate them, once to count their bytes, so that
// a memory plan cannot drift from the allocation it predicts (no second copy of the shape formulas).
#pragma once
#include "moecore/core/tensor.h"

namespace moecore {

class BufferPlan {
 public:
  // allocate: the walk creates each tensor in `category`; otherwise it only adds up the bytes.
  BufferPlan(MemCategory category, bool allocate) : category_(category), allocate_(allocate) {}
  void empty(Tensor& t, const Shape& shape, DType dtype) { add(t, shape, dtype, false); }
  void zeros(Tensor& t, const Shape& shape, DType dtype) { add(t, shape, dtype, true); }
  int64_t bytes() const { return bytes_; }

 private:
  void add(Tensor& t, const Shape& shape, DType dtype, bool zero) {
    bytes_ += shape.numel() * static_cast<int64_t>(dtype_size(dtype));
    if (allocate_) t = zero ? Tensor::zeros(shape, dtype, category_) : Tensor::empty(shape, dtype, category_);
  }
  MemCategory category_;
  bool allocate_;
  int64_t bytes_ = 0;
};

// The two walks of a plan function plan(Buffers&, BufferPlan&): the allocated buffers, or their bytes.
template <class Buffers, class Plan>
Buffers plan_allocate(MemCategory category, Plan&& plan) {
  Buffers b;
  BufferPlan p(category, true);
  plan(b, p);
  return b;
}
template <class Buffers, class Plan>
int64_t plan_bytes(MemCategory category, Plan&& plan) {
  Buffers b;
  BufferPlan p(category, false);
  plan(b, p);
  return p.bytes();
}

}  // namespace moecore
