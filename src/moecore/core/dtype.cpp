// Float-format conversions. The generic encoder handles every small binary float format: round to
// nearest even on the exact value, gradual underflow, then the format's overflow rule.
#include "moecore/core/dtype.h"

#include <cmath>
#include <cstring>

#include "moecore/core/error.h"

namespace moecore {
namespace {

// Encodes |a| (finite, >= 0) into a format with EB exponent bits, MB mantissa bits and bias BIAS.
// Returns the magnitude code; the caller applies the overflow rule when the code exceeds max_code.
template <int EB, int MB, int BIAS>
uint32_t encode_magnitude(float a) {
  if (a == 0.0f) return 0;
  constexpr int emin = 1 - BIAS;
  int e2;
  std::frexp(a, &e2);
  int exp = e2 - 1;  // a = m * 2^exp, m in [1, 2)
  if (exp < emin) {
    const float q = std::nearbyint(std::ldexp(a, MB - emin));
    return static_cast<uint32_t>(q);  // q == 2^MB rolls into the smallest normal, as it should
  }
  float q = std::nearbyint(std::ldexp(a, MB - exp));
  if (q >= static_cast<float>(1u << (MB + 1))) {
    ++exp;
    q = std::ldexp(q, -1);
  }
  const uint32_t biased = static_cast<uint32_t>(exp + BIAS);
  if (biased >= (1u << EB)) return ~0u;  // beyond the exponent range
  return (biased << MB) | (static_cast<uint32_t>(q) - (1u << MB));
}

template <int EB, int MB, int BIAS>
float decode_magnitude(uint32_t code) {
  const uint32_t e = code >> MB, m = code & ((1u << MB) - 1);
  if (e == 0) return std::ldexp(static_cast<float>(m), 1 - BIAS - MB);
  return std::ldexp(static_cast<float>(m | (1u << MB)), static_cast<int>(e) - BIAS - MB);
}

}  // namespace

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

float f16_to_float(f16 h) {
  const uint32_t s = h.bits >> 15, mag = h.bits & 0x7fff;
  float v;
  if ((mag >> 10) == 0x1f)
    v = (mag & 0x3ff) ? NAN : INFINITY;
  else
    v = decode_magnitude<5, 10, 15>(mag);
  return s ? -v : v;
}

f16 float_to_f16(float f) {
  const uint16_t s = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return f16{static_cast<uint16_t>(s | 0x7e00)};
  const float a = std::fabs(f);
  uint32_t code = std::isinf(a) ? 0x7c00 : encode_magnitude<5, 10, 15>(a);
  if (code >= 0x7c00) code = 0x7c00;  // IEEE half overflows to infinity
  return f16{static_cast<uint16_t>(s | code)};
}

float f8e4m3_to_float(f8e4m3 v) {
  const uint32_t mag = v.bits & 0x7f;
  if (mag == 0x7f) return NAN;
  const float x = decode_magnitude<4, 3, 7>(mag);
  return (v.bits & 0x80) ? -x : x;
}

f8e4m3 float_to_f8e4m3(float f) {
  const uint8_t s = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return f8e4m3{static_cast<uint8_t>(s | 0x7f)};
  const float a = std::fabs(f);
  uint32_t code = std::isinf(a) ? ~0u : encode_magnitude<4, 3, 7>(a);
  if (code > 0x7e) code = 0x7e;  // saturate to 448 (e4m3fn has no infinity)
  return f8e4m3{static_cast<uint8_t>(s | code)};
}

float f8e5m2_to_float(f8e5m2 v) {
  const uint32_t mag = v.bits & 0x7f;
  float x;
  if (mag == 0x7c)
    x = INFINITY;
  else if (mag > 0x7c)
    return NAN;
  else
    x = decode_magnitude<5, 2, 15>(mag);
  return (v.bits & 0x80) ? -x : x;
}

f8e5m2 float_to_f8e5m2(float f) {
  const uint8_t s = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return f8e5m2{static_cast<uint8_t>(s | 0x7f)};
  const float a = std::fabs(f);
  if (std::isinf(a)) return f8e5m2{static_cast<uint8_t>(s | 0x7c)};
  uint32_t code = encode_magnitude<5, 2, 15>(a);
  if (code > 0x7b) code = 0x7b;  // saturate finite values to 57344
  return f8e5m2{static_cast<uint8_t>(s | code)};
}

namespace {
double load_as_double(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::f64:
      return static_cast<const double*>(p)[i];
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::bf16:
      return bf16_to_float(static_cast<const bf16*>(p)[i]);
    case DType::f16:
      return f16_to_float(static_cast<const f16*>(p)[i]);
    case DType::f8e4m3:
      return f8e4m3_to_float(static_cast<const f8e4m3*>(p)[i]);
    case DType::f8e5m2:
      return f8e5m2_to_float(static_cast<const f8e5m2*>(p)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(p)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::boolean:
      return static_cast<const bool*>(p)[i] ? 1.0 : 0.0;
  }
  return 0.0;
}
void store_double(void* p, DType t, size_t i, double d) {
  const float v = static_cast<float>(d);
  switch (t) {
    case DType::f64:
      static_cast<double*>(p)[i] = d;
      break;
    case DType::f32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::bf16:
      static_cast<bf16*>(p)[i] = float_to_bf16(v);
      break;
    case DType::f16:
      static_cast<f16*>(p)[i] = float_to_f16(v);
      break;
    case DType::f8e4m3:
      static_cast<f8e4m3*>(p)[i] = float_to_f8e4m3(v);
      break;
    case DType::f8e5m2:
      static_cast<f8e5m2*>(p)[i] = float_to_f8e5m2(v);
      break;
    case DType::i32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(d);
      break;
    case DType::i64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(d);
      break;
    case DType::boolean:
      static_cast<bool*>(p)[i] = d != 0.0;
      break;
  }
}
}  // namespace

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
  const bool ints = !dtype_is_float(dst_type) && !dtype_is_float(src_type) && dst_type != DType::boolean;
  for (size_t i = 0; i < n; ++i) {
    if (ints) {
      const int64_t v = src_type == DType::i32   ? static_cast<const int32_t*>(src)[i]
                        : src_type == DType::i64 ? static_cast<const int64_t*>(src)[i]
                                                 : static_cast<const bool*>(src)[i];
      if (dst_type == DType::i32)
        static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
      else
        static_cast<int64_t*>(dst)[i] = v;
    } else {
      store_double(dst, dst_type, i, load_as_double(src, src_type, i));
    }
  }
}

}  // namespace moecore
