// Tensor: a typed, strided view of reference-counted storage on one device.
// Storage is allocated once and tagged with a memory category for accounting; views (view, slice,
// select) share it. Tensors carry no autograd: forward/backward are explicit functions (docs/STYLE.md).
// This header knows no CUDA: device memory is allocated through a backend hook.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "moecore/core/dtype.h"
#include "moecore/core/error.h"
#include "moecore/core/memory.h"

namespace moecore {

// cpu: host memory. cuda: a CUDA device. sim: the simulated device of the test suite: host memory that
// host code may not read. Its ops run the CPU kernels; Tensor::data()/raw() on a non-CPU tensor raise
// Error unless a DeviceAccess scope is open on the calling thread (op bodies, collectives, transfers) or
// the caller runs inside an OpenMP parallel region while such a scope is open (an op body's workers). So a test
// suite run on sim proves that no code outside ops, collectives and explicit transfers touches device data; what
// host code may do with device memory is stated once, in core/tensor.cpp, for cuda and sim alike.
// meta: shapes and dtypes without memory (PyTorch's meta device). A model built on it allocates nothing and counts
// what it would allocate (GptModel::plan_memory); writes into a meta tensor do nothing, reading its data raises Error.
// Not a device a user names (parse_device refuses it).
enum class Device : uint8_t { cpu, cuda, sim, meta };
const char* device_name(Device d);  // "cpu", "cuda", "sim", "meta"
// "cpu" | "cuda" | "sim"; anything else raises Error naming the text.
Device parse_device(const std::string& s);

// Marks the calling thread as running an op body (or a collective or a transfer) for its lifetime:
// non-CPU tensors may be addressed. Nestable.
class DeviceAccess {
 public:
  DeviceAccess();
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;
};

inline constexpr int kMaxDims = 6;
struct DeviceView;  // core/backend_hooks.h

struct Shape {
  int64_t d[kMaxDims] = {};
  int ndim = 0;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int64_t operator[](int i) const { return d[i]; }
  int64_t& operator[](int i) { return d[i]; }
  // Product of the dims (0 when any dim is 0). Throws Error naming the shape when it exceeds int64, so a
  // hostile file's shape cannot wrap around into a small allocation.
  int64_t numel() const;
  int64_t bytes(DType t) const;  // numel() * dtype_size(t), overflow-checked the same way
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[2, 3]"
};

// Owning allocation. 64-byte aligned on the CPU. Its memory may be given back and taken again while the object (and
// every tensor viewing it) lives on: release() frees it (the accounting too), acquire() allocates it anew, contents
// undefined (Megatron-FSDP's sharded parameters and gradients between their uses, Tensor::release_storage).
struct Storage {
  void* data = nullptr;
  int64_t bytes = 0;
  Device device = Device::cpu;
  MemCategory category = MemCategory::other;
  bool released = false;
  // allocate false: born released (no memory until acquire()).
  Storage(int64_t bytes, Device device, MemCategory category, bool allocate = true);
  ~Storage();
  void release();
  void acquire();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype, MemCategory category = MemCategory::activations,
                      Device device = Device::cpu);
  static Tensor zeros(const Shape& shape, DType dtype, MemCategory category = MemCategory::activations,
                      Device device = Device::cpu);
  // A tensor whose storage is born released (release_storage): no memory until reacquire_storage or
  // take_storage_of. (On meta, a meta tensor.)
  static Tensor released(const Shape& shape, DType dtype, MemCategory category, Device device = Device::cpu);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t size(int i) const { return shape_.d[axis(i)]; }
  int64_t stride(int i) const { return strides_[axis(i)]; }
  int dim() const { return shape_.ndim; }
  int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::cpu; }
  MemCategory category() const { return storage_ ? storage_->category : MemCategory::other; }
  int64_t nbytes() const { return shape_.bytes(dtype_); }
  bool is_contiguous() const;
  // Same storage and first element (an identity test that reads no data, so it works on any device).
  bool same_data(const Tensor& o) const { return storage_ == o.storage_ && offset_ == o.offset_; }

  // The element at the view's offset. For a non-CPU tensor only inside a DeviceAccess scope (see Device); never while
  // the storage is released (release_storage).
  void* raw() const {
    if (storage_->device != Device::cpu) check_device_access();
    if (storage_->released) [[unlikely]]
      released_error();
    return static_cast<char*>(storage_->data) + offset_ * dtype_size(dtype_);
  }
  // The address of the view's first element in a cuda tensor's device memory, for handing to a CUDA kernel or
  // library call (which address device memory on the device) and for address comparisons. Host code never
  // dereferences it, so no DeviceAccess scope is needed; any other device raises (host tensors use raw()).
  void* device_ptr() const {
    MOECORE_CHECK(storage_ && storage_->device == Device::cuda, "tensor.device_ptr: tensor ", str(), " is on ",
                  device_name(device()), ", not cuda");
    if (storage_->released) [[unlikely]]
      released_error();
    return static_cast<char*>(storage_->data) + offset_ * dtype_size(dtype_);
  }
  template <class T>
  T* data() const {
    MOECORE_CHECK(dtype_of<T>() == dtype_, "tensor of dtype ", dtype_name(dtype_), " read as ",
                  dtype_name(dtype_of<T>()));
    return static_cast<T*>(raw());
  }

  Tensor view(const Shape& shape) const;                    // contiguous only; same numel
  Tensor slice(int dim, int64_t start, int64_t end) const;  // [start, end) along dim
  Tensor select(int dim, int64_t index) const;              // drops dim
  Tensor flatten_to_2d() const;                             // [prod(leading), last], contiguous only

  // Fill, convert and copy run on the tensor's device (device kernels on cuda and sim; core/tensor.cpp states the
  // rule): any strides, any dtypes. Between devices, copy_from is a transfer: contiguous tensors of one dtype.
  void zero_();                       // any dtype
  void fill_(float value);            // float dtypes only
  void copy_from(const Tensor& src);  // same shape; converts dtype
  Tensor clone(MemCategory category = MemCategory::other) const;
  Tensor to(DType dtype, MemCategory category = MemCategory::other) const;
  // A contiguous copy on `device` (this tensor itself when it is already there and contiguous): the explicit
  // transfer between host and device memory.
  Tensor to_device(Device device, MemCategory category = MemCategory::other) const;
  // The explicit device-to-host transfer of a contiguous tensor's n = numel() elements of type T (its dtype)
  // into dst[0, n): every host synchronisation on device data goes through here (or to_device).
  template <class T>
  void copy_to_host(T* dst, int64_t n) const {
    MOECORE_CHECK(dtype_of<T>() == dtype_, "tensor.copy_to_host: tensor of dtype ", dtype_name(dtype_), " read as ",
                  dtype_name(dtype_of<T>()));
    copy_to_host_bytes(dst, n * static_cast<int64_t>(sizeof(T)));
  }

  std::string str() const;  // "[2, 3] f32"

  // The storage's memory given back (every view of it alike; the handles stay valid) and taken again, contents
  // undefined: Megatron-FSDP's parameters and gradients between their uses. Reading or writing the data of a released
  // tensor raises Error. resident(): defined and not released. Local; not thread-safe against users of the storage.
  void release_storage() const;
  void reacquire_storage() const;
  bool resident() const { return storage_ && !storage_->released; }
  // This tensor's released storage takes the memory of `from`'s resident one (equal bytes, device and category;
  // contents carried, the accounting unchanged), which is left released: memory passed on without the allocator,
  // whose fresh pages fault in again on first touch (Megatron-FSDP's units, FsdpOptimizer). Local.
  void take_storage_of(const Tensor& from) const;

 private:
  static Tensor make(const Shape& shape, DType dtype, MemCategory category, Device device, bool allocate);
  [[noreturn]] void released_error() const;
  void set_contiguous_shape(const Shape& shape);  // shape with row-major strides
  DeviceView device_view() const;                 // a cuda tensor as the device kernels see it
  void fill_bits(const void* value);              // every element := value (one element of this dtype)
  void check_device_access() const;               // Error unless device memory may be addressed here
  void copy_to_host_bytes(void* dst, int64_t bytes) const;
  int axis(int i) const {  // negative axes count from the end
    const int k = i < 0 ? i + shape_.ndim : i;
    MOECORE_CHECK(k >= 0 && k < shape_.ndim, "axis ", i, " out of range for tensor ", str());
    return k;
  }
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  int64_t strides_[kMaxDims] = {};
  DType dtype_ = DType::f32;
};

}  // namespace moecore
