// One description of a module's buffers, walked twice: once to allocate them, once to count their bytes, so that
// a memory plan cannot drift from the allocation it predicts (no second copy of the shape formulas).
#pragma once
#include "moecore/core/tensor.h"

namespace moecore {

class BufferPlan {
 public:
  // allocate: the walk creates each tensor in `category`; otherwise it only adds up the bytes.
  // device: where the walk allocates.
  BufferPlan(MemCategory category, bool allocate, Device device = Device::cpu)
      : category_(category), allocate_(allocate), device_(device) {}
  void empty(Tensor& t, const Shape& shape, DType dtype) { add(t, shape, dtype, false); }
  void zeros(Tensor& t, const Shape& shape, DType dtype) { add(t, shape, dtype, true); }
  int64_t bytes() const { return bytes_; }

 private:
  void add(Tensor& t, const Shape& shape, DType dtype, bool zero) {
    bytes_ += shape.numel() * static_cast<int64_t>(dtype_size(dtype));
    if (allocate_)
      t = zero ? Tensor::zeros(shape, dtype, category_, device_) : Tensor::empty(shape, dtype, category_, device_);
  }
  MemCategory category_;
  bool allocate_;
  Device device_;
  int64_t bytes_ = 0;
};

// The two walks of a plan function plan(Buffers&, BufferPlan&): the allocated buffers, or their bytes.
template <class Buffers, class Plan>
Buffers plan_allocate(MemCategory category, Plan&& plan, Device device = Device::cpu) {
  Buffers b;
  BufferPlan p(category, true, device);
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
