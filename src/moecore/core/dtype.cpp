// Dtype names and sizes, and the host's conversions; the element arithmetic is core/dtype_convert.h's, which the
// CUDA device copy runs too.
#include "moecore/core/dtype.h"

#include <cstring>

#include "moecore/core/dtype_convert.h"
#include "moecore/core/error.h"

namespace moecore {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::boolean:
      return 1;
    case DType::i64:
    case DType::f64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::f8e4m3:
      return "f8e4m3";
    case DType::f8e5m2:
      return "f8e5m2";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::boolean:
      return "bool";
    case DType::f64:
      return "f64";
  }
  return "?";
}

bool dtype_is_float(DType t) {
  return t <= DType::f8e5m2 || t == DType::f64;
}

float f8e4m3_to_float(f8e4m3 v) {
  return dtype_convert::f8e4m3_to_float(v.bits);
}
f8e4m3 float_to_f8e4m3(float f) {
  return f8e4m3{dtype_convert::float_to_f8e4m3(f)};
}
float f8e5m2_to_float(f8e5m2 v) {
  return dtype_convert::f8e5m2_to_float(v.bits);
}
f8e5m2 float_to_f8e5m2(float f) {
  return f8e5m2{dtype_convert::float_to_f8e5m2(f)};
}

void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  if (n == 0) return;  // empty tensors may carry null pointers
  if (dst_type == src_type) {
    std::memcpy(dst, src, n * dtype_size(dst_type));
    return;
  }
  if (dst_type == DType::bf16 && src_type == DType::f32) {
    auto* d = static_cast<bf16*>(dst);
    auto* s = static_cast<const float*>(src);
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
    return;
  }
  if (dst_type == DType::f32 && src_type == DType::bf16) {
    auto* d = static_cast<float*>(dst);
    auto* s = static_cast<const bf16*>(src);
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
    return;
  }
  if (dst_type == DType::f16 && src_type == DType::f32) {
    auto* d = static_cast<f16*>(dst);
    auto* s = static_cast<const float*>(src);
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; ++i) d[i] = float_to_f16(s[i]);
    return;
  }
  if (dst_type == DType::f32 && src_type == DType::f16) {
    auto* d = static_cast<float*>(dst);
    auto* s = static_cast<const f16*>(src);
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; ++i) d[i] = f16_to_float(s[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i)
    dtype_convert::convert_element(dst, dst_type, static_cast<int64_t>(i), src, src_type, static_cast<int64_t>(i));
}

}  // namespace moecore
