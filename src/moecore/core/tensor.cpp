// Tensor views and the few whole-tensor helpers (fill, copy with conversion). Heavy math lives in
// kernels/; these helpers exist so that tests, I/O and set-up code need no kernel calls.
#include "moecore/core/tensor.h"

#include <omp.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/dtype_convert.h"
#include "moecore/core/memory_limit.h"

namespace moecore {
namespace {
thread_local int t_device_access = 0;  // open DeviceAccess scopes on this thread
std::atomic<int> g_device_access{0};   // open DeviceAccess scopes on every thread
bool host_memory(Device d) {           // memory the CPU kernels address: the host's and the simulated device's
  return d == Device::cpu || d == Device::sim;
}
// Host tensors from 1 GiB up are mapped with MAP_NORESERVE: their pages are taken when first written, as malloc's
// would be, but the kernel's overcommit heuristic does not refuse one mapping larger than the machine at once, so
// that the start-up memory plan (apps/train_cmd.cpp), not a model's constructor that only reserves its activation
// buffers, decides whether a run fits. (Smaller ones keep malloc, and the sanitizers' checks of them.)
constexpr int64_t kHostMapBytes = int64_t{1} << 30;
// A transfer between two devices: the one thing host code does with device memory besides launching device work.
bool is_transfer(const Tensor& dst, const Tensor& src) {
  return dst.device() != src.device();
}
// Row-major stride products: only a tensor with a zero dim can exceed int64 here (numel() bounds the rest), and
// its strides are never used to address memory, so saturating keeps them defined.
bool is_zero_bits(const void* value, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(value);
  for (size_t i = 0; i < bytes; ++i)
    if (b[i]) return false;
  return true;
}
int64_t mul_saturating(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}
}  // namespace

Shape::Shape(std::initializer_list<int64_t> dims) {
  MOECORE_CHECK(dims.size() <= kMaxDims, "tensor rank ", dims.size(), " exceeds ", kMaxDims);
  for (int64_t v : dims) d[ndim++] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  bool overflow = false;
  for (int i = 0; i < ndim; ++i) {
    if (d[i] == 0) return 0;
    overflow |= __builtin_mul_overflow(n, d[i], &n);
  }
  if (overflow)
    MOECORE_FAIL("tensor: shape ", str(), " has more elements than a 64-bit count can hold; ",
                 "hint: the shape comes from a corrupt file or a wrong size flag");
  return n;
}

int64_t Shape::bytes(DType t) const {
  int64_t b = 0;
  if (__builtin_mul_overflow(numel(), static_cast<int64_t>(dtype_size(t)), &b))
    MOECORE_FAIL("tensor: shape ", str(), " of ", dtype_name(t), " needs more bytes than a 64-bit size can hold; ",
                 "hint: the shape comes from a corrupt file or a wrong size flag");
  return b;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (d[i] != o.d[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

const char* device_name(Device d) {
  switch (d) {
    case Device::cpu:
      return "cpu";
    case Device::cuda:
      return "cuda";
    case Device::sim:
      return "sim";
    case Device::meta:
      return "meta";
  }
  return "?";
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu;
  if (s == "cuda") return Device::cuda;
  if (s == "sim") return Device::sim;
  MOECORE_FAIL("unknown device '", s, "' (expected cpu, cuda or sim)");
}

DeviceAccess::DeviceAccess() {
  ++t_device_access;
  g_device_access.fetch_add(1, std::memory_order_relaxed);
}
DeviceAccess::~DeviceAccess() {
  --t_device_access;
  g_device_access.fetch_sub(1, std::memory_order_relaxed);
}

namespace {
// An allocation that failed: what moecore holds by category, the limit it ran into and the run's memory plan, so that
// the message says what to change. Tensor::empty puts the tensor's shape and dtype in front.
[[noreturn]] void out_of_memory(int64_t bytes, MemCategory cat, Device device) {
  std::string where;
  if (host_memory(device)) {
    where = "; " + memory_limit().describe();
  } else {
    int64_t free_bytes = 0, total_bytes = 0;
    where = " on " + device_description(&free_bytes, &total_bytes);
  }
  const MemoryStats m = memory_stats();
  std::string held;
  for (int c = 0; c < kNumMemCategories; ++c)
    if (m.current[c])
      held += (held.empty() ? "" : ", ") + std::string(mem_category_name(static_cast<MemCategory>(c))) + " " +
              memory_format_bytes(m.current[c]);
  const std::string plan = memory_plan_text();
  MOECORE_FAIL("out of ", host_memory(device) ? "host" : "cuda", " memory allocating ", memory_format_bytes(bytes),
               " of ", mem_category_name(cat), where, "; moecore holds ", memory_format_bytes(m.total_current),
               held.empty() ? "" : " (", held, held.empty() ? "" : ")",
               plan.empty() ? "" : "; the memory plan of this run:\n", plan, plan.empty() ? "\n" : "",
               "hint: a smaller --micro-batch-size, activation recompute (--recompute-granularity), "
               "--use-distributed-optimizer or more model parallelism lowers the need");
}
}  // namespace

void Tensor::check_device_access() const {
  if (device() == Device::meta)
    MOECORE_FAIL("tensor ", str(), " is on the meta device: it has a shape, not data (a memory plan's model)");
  // An op body's OpenMP workers run on threads without the scope: inside a parallel region the scope of the thread
  // that started it counts (some scope is open), so host code's own parallel loops are still refused.
  if (t_device_access > 0 || (omp_in_parallel() && g_device_access.load(std::memory_order_relaxed) > 0)) return;
  MOECORE_FAIL("host code addressed the data of a ", device_name(device()), " tensor ", str(),
               ": device tensors are read and written by ops (kernels/ops.h), collectives and explicit transfers "
               "(Tensor::to_device) only");
}

Storage::Storage(int64_t nbytes, Device dev, MemCategory cat, bool allocate)
    : bytes(nbytes), device(dev), category(cat) {
  MOECORE_CHECK(nbytes >= 0, "negative allocation ", nbytes);
  if (dev == Device::meta) return;  // (no memory, nothing recorded)
  released = true;
  if (allocate) acquire();
}

void Storage::acquire() {
  if (!released || device == Device::meta) return;
  if (host_memory(device) && bytes >= kHostMapBytes) {
    void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data = p == MAP_FAILED ? nullptr : p;
  } else if (host_memory(device)) {
    const size_t rounded = (static_cast<size_t>(bytes) + 63) / 64 * 64;
    data = std::aligned_alloc(64, rounded ? rounded : 64);
  } else {
    data = device_alloc(bytes);
  }
  if (!data) out_of_memory(bytes, category, device);
  released = false;
  memory_record_alloc(category, bytes, device);
}

void Storage::release() {
  if (released || device == Device::meta) return;
  memory_record_free(category, bytes, device);
  if (host_memory(device) && bytes >= kHostMapBytes)
    ::munmap(data, static_cast<size_t>(bytes));
  else if (host_memory(device))
    std::free(data);
  else
    device_free(data);
  data = nullptr;
  released = true;
}

Storage::~Storage() {
  release();
}

void Tensor::release_storage() const {
  MOECORE_CHECK(storage_, "tensor.release_storage: undefined tensor");
  storage_->release();
}

void Tensor::reacquire_storage() const {
  MOECORE_CHECK(storage_, "tensor.reacquire_storage: undefined tensor");
  storage_->acquire();
}

void Tensor::take_storage_of(const Tensor& from) const {
  MOECORE_CHECK(storage_ && from.storage_, "tensor.take_storage_of: undefined tensor");
  Storage &to = *storage_, &src = *from.storage_;
  if (to.device == Device::meta && src.device == Device::meta) return;  // (no memory)
  MOECORE_CHECK(to.released && !src.released, "tensor.take_storage_of: ", str(), " must be released and ", from.str(),
                " resident");
  MOECORE_CHECK(to.bytes == src.bytes && to.device == src.device && to.category == src.category,
                "tensor.take_storage_of: storages of ", to.bytes, " bytes (", device_name(to.device), ", ",
                mem_category_name(to.category), ") and ", src.bytes, " bytes (", device_name(src.device), ", ",
                mem_category_name(src.category), ") differ");
  to.data = std::exchange(src.data, nullptr);
  to.released = false;
  src.released = true;
}

void Tensor::released_error() const {
  MOECORE_FAIL("tensor ", str(), " is released (its memory given back between uses, Megatron-FSDP): its data was ",
               "addressed before the storage was taken again");
}

Tensor Tensor::empty(const Shape& shape, DType dtype, MemCategory category, Device device) {
  return make(shape, dtype, category, device, /*allocate=*/true);
}

Tensor Tensor::released(const Shape& shape, DType dtype, MemCategory category, Device device) {
  return make(shape, dtype, category, device, /*allocate=*/false);
}

Tensor Tensor::make(const Shape& shape, DType dtype, MemCategory category, Device device, bool allocate) {
  for (int i = 0; i < shape.ndim; ++i)
    MOECORE_CHECK(shape[i] >= 0, "tensor: negative dimension in shape ", shape.str());
  Tensor t;
  try {
    t.storage_ = std::make_shared<Storage>(shape.bytes(dtype), device, category, allocate);
  } catch (const Error& e) {  // (out of memory) which tensor
    MOECORE_FAIL("tensor ", shape.str(), " ", dtype_name(dtype), ": ", e.what());
  } catch (const std::bad_alloc&) {  // (the shared_ptr's control block: the heap is exhausted)
    MOECORE_FAIL("tensor ", shape.str(), " ", dtype_name(dtype), ": out of host memory allocating its header; ",
                 memory_limit().describe());
  }
  t.dtype_ = dtype;
  t.set_contiguous_shape(shape);
  return t;
}

void Tensor::set_contiguous_shape(const Shape& shape) {
  shape_ = shape;
  int64_t s = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    strides_[i] = s;
    s = mul_saturating(s, shape[i]);
  }
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemCategory category, Device device) {
  Tensor t = empty(shape, dtype, category, device);
  t.zero_();
  return t;
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (int i = shape_.ndim - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != s) return false;
    s = mul_saturating(s, shape_[i]);
  }
  return true;
}

Tensor Tensor::view(const Shape& shape) const {
  MOECORE_CHECK(is_contiguous(), "tensor.view: tensor ", str(), " is not contiguous");
  MOECORE_CHECK(shape.numel() == numel(), "tensor.view: cannot view ", str(), " as ", shape.str());
  Tensor t = *this;
  t.set_contiguous_shape(shape);
  return t;
}

Tensor Tensor::slice(int d, int64_t start, int64_t end) const {
  if (d < 0) d += shape_.ndim;
  MOECORE_CHECK(d >= 0 && d < shape_.ndim, "tensor.slice: dim ", d, " out of range for ", str());
  MOECORE_CHECK(0 <= start && start <= end && end <= shape_[d], "tensor.slice: [", start, ", ", end,
                ") out of range for dim ", d, " of ", str());
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::select(int d, int64_t index) const {
  if (d < 0) d += shape_.ndim;
  Tensor t = slice(d, index, index + 1);
  for (int i = d; i + 1 < t.shape_.ndim; ++i) {
    t.shape_[i] = t.shape_[i + 1];
    t.strides_[i] = t.strides_[i + 1];
  }
  --t.shape_.ndim;
  return t;
}

Tensor Tensor::flatten_to_2d() const {
  MOECORE_CHECK(shape_.ndim >= 1, "tensor.flatten_to_2d: scalar tensor");
  const int64_t last = shape_[shape_.ndim - 1];
  return view(Shape{last ? numel() / last : 0, last});
}

namespace {
// Calls fn(k, element_offset) for every element k of a strided tensor, in row-major order.
template <class Fn>
void for_each_offset(const Shape& shape, const int64_t* strides, Fn&& fn) {
  int64_t idx[kMaxDims] = {};
  const int64_t n = shape.numel();
  for (int64_t k = 0; k < n; ++k) {
    int64_t off = 0;
    for (int i = 0; i < shape.ndim; ++i) off += idx[i] * strides[i];
    fn(k, off);
    for (int i = shape.ndim - 1; i >= 0; --i) {
      if (++idx[i] < shape[i]) break;
      idx[i] = 0;
    }
  }
}
}  // namespace

// The one rule for host code and device memory, the same for cuda and sim (sim exists to fail wherever cuda would):
// host code addresses the memory of cpu tensors only. Within a device, a tensor is filled, converted and copied by
// that device's kernels: device_fill / device_convert (CUDA kernels) on cuda, and on sim the host loops below, run as
// the simulated device's kernels inside a DeviceAccess scope. Between devices, the only move is a transfer of a
// contiguous tensor in one dtype (device_copy on cuda); anything else is refused on every device alike. A meta tensor
// takes every write (fill, copy, transfer into it) and does nothing; its data is never read.
static_assert(DeviceView::kMaxDims == kMaxDims);

DeviceView Tensor::device_view() const {
  DeviceView v;
  v.data = numel() ? device_ptr() : nullptr;
  v.dtype = dtype_;
  v.ndim = shape_.ndim;
  for (int i = 0; i < shape_.ndim; ++i) {
    v.shape[i] = shape_[i];
    v.strides[i] = strides_[i];
  }
  return v;
}

void Tensor::fill_bits(const void* value) {
  if (!defined() || numel() == 0 || device() == Device::meta) return;
  if (device() == Device::cuda) {
    if (is_contiguous() && is_zero_bits(value, dtype_size(dtype_)))
      device_memset(device_ptr(), 0, nbytes());
    else
      device_fill(device_view(), value);
    return;
  }
  std::optional<DeviceAccess> kernel;  // sim: this loop is the simulated device's fill kernel
  if (device() == Device::sim) kernel.emplace();
  const size_t es = dtype_size(dtype_);
  char* base = static_cast<char*>(raw());
  if (is_contiguous() && is_zero_bits(value, es)) {
    std::memset(base, 0, static_cast<size_t>(nbytes()));
    return;
  }
  for_each_offset(shape_, strides_, [&](int64_t, int64_t off) { std::memcpy(base + off * es, value, es); });
}

void Tensor::zero_() {
  const uint64_t zero = 0;
  fill_bits(&zero);
}

void Tensor::fill_(float value) {
  MOECORE_CHECK(dtype_is_float(dtype_), "tensor.fill_: needs a float tensor, got ", str());
  uint64_t bits = 0;
  convert(&bits, dtype_, &value, DType::f32, 1);
  fill_bits(&bits);
}

void Tensor::copy_from(const Tensor& src) {
  MOECORE_CHECK(src.shape() == shape_, "tensor.copy_from: shape ", src.str(), " into ", str());
  if (device() == Device::meta) return;
  if (is_transfer(*this, src)) {
    MOECORE_CHECK(is_contiguous() && src.is_contiguous() && dtype_ == src.dtype_,
                  "tensor.copy_from: a copy between devices is a transfer of a contiguous tensor in one dtype, got ",
                  src.str(), (src.is_contiguous() ? "" : " (strided)"), " on ", device_name(src.device()), " into ",
                  str(), (is_contiguous() ? "" : " (strided)"), " on ", device_name(device()),
                  "; hint: convert or make it contiguous on one side first (Tensor::to, clone)");
    if (numel() == 0) return;
    const DeviceAccess transfer;
    if (device() == Device::cuda || src.device() == Device::cuda)
      device_copy(raw(), device() == Device::cuda, src.raw(), src.device() == Device::cuda, nbytes());
    else
      std::memcpy(raw(), src.raw(), static_cast<size_t>(nbytes()));
    return;
  }
  if (numel() == 0) return;
  if (device() == Device::cuda) {
    device_convert(device_view(), src.device_view());
    return;
  }
  std::optional<DeviceAccess> kernel;  // sim: the host loops below are the simulated device's copy kernel
  if (device() == Device::sim) kernel.emplace();
  if (is_contiguous() && src.is_contiguous()) {
    convert(raw(), dtype_, src.raw(), src.dtype_, static_cast<size_t>(numel()));
    return;
  }
  if (dim() >= 1 && stride(-1) == 1 && src.stride(-1) == 1) {  // row-wise: rows are contiguous on both sides
    const int64_t cols = size(-1), rows = cols ? numel() / cols : 0;
    const size_t des = dtype_size(dtype_), ses = dtype_size(src.dtype_);
    Shape outer = shape_;
    outer[outer.ndim - 1] = 1;
    std::vector<int64_t> doff, soff;
    doff.reserve(static_cast<size_t>(rows));
    soff.reserve(static_cast<size_t>(rows));
    for_each_offset(outer, strides_, [&](int64_t, int64_t off) { doff.push_back(off); });
    for_each_offset(outer, src.strides_, [&](int64_t, int64_t off) { soff.push_back(off); });
    char* d = static_cast<char*>(raw());
    const char* s = static_cast<const char*>(src.raw());
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; ++r)
      convert(d + doff[r] * des, dtype_, s + soff[r] * ses, src.dtype_, static_cast<size_t>(cols));
    return;
  }
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(raw());
  std::vector<int64_t> soff;
  soff.reserve(static_cast<size_t>(numel()));
  for_each_offset(shape_, src.strides_, [&](int64_t, int64_t off) { soff.push_back(off); });
  for_each_offset(shape_, strides_, [&](int64_t k, int64_t off) {
    dtype_convert::convert_element(d, dtype_, off, s, src.dtype_, soff[static_cast<size_t>(k)]);
  });
}

Tensor Tensor::clone(MemCategory category) const {
  return to(dtype_, category);
}

Tensor Tensor::to(DType dtype, MemCategory category) const {
  Tensor t = empty(shape_, dtype, category, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to_device(Device dev, MemCategory category) const {
  if (dev == device() && is_contiguous()) return *this;
  const Tensor src = is_contiguous() ? *this : clone(category);
  if (dev == src.device()) return src;
  Tensor t = empty(shape_, dtype_, category, dev);
  t.copy_from(src);
  return t;
}

void Tensor::copy_to_host_bytes(void* dst, int64_t bytes) const {
  MOECORE_CHECK(is_contiguous() && bytes == nbytes(), "tensor.copy_to_host: ", str(),
                " must be contiguous and the destination must hold all of its ", nbytes(), " bytes, got ", bytes);
  const DeviceAccess access;
  if (device() == Device::cuda)
    device_copy(dst, false, raw(), true, bytes);
  else if (bytes > 0)
    std::memcpy(dst, raw(), static_cast<size_t>(bytes));
}

std::string Tensor::str() const {
  return shape_.str() + " " + std::string(dtype_name(dtype_));
}

}  // namespace moecore
