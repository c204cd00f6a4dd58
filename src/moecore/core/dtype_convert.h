// Element conversions between every pair of dtypes as inline host/device functions: core's convert() (dtype.cpp)
// and the CUDA backend's device copy (kernels/cuda/device_copy.cu) both run these, so a conversion gives the same
// bits on every device. Floats go through double (narrowing rounds to nearest even; fp8 saturates, dtype.h), ints
// and bools convert exactly between themselves, floats into ints saturate (NaN gives 0). NaNs never meet the
// hardware's conversions or negation (x86 keeps a NaN's sign and payload, CUDA returns a canonical NaN): they are
// built bit by bit, as x86 converts them. Only plain arithmetic and bit operations: no tensors, no std calls that
// device code lacks.
#pragma once
#include <math.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "moecore/core/dtype.h"

// MOECORE_HD (host and device functions under nvcc) comes from core/dtype.h.

namespace moecore::dtype_convert {

MOECORE_HD inline uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
MOECORE_HD inline float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
MOECORE_HD inline bool is_nan(float f) {
  return (bits_of(f) & 0x7fffffffu) > 0x7f800000u;
}
MOECORE_HD inline bool is_inf(float f) {
  return (bits_of(f) & 0x7fffffffu) == 0x7f800000u;
}
// v with its sign bit set when `negative` (v >= 0 or a positive NaN): a bit operation, exact on every device.
MOECORE_HD inline float with_sign(float v, bool negative) {
  return negative ? float_of(bits_of(v) | 0x80000000u) : v;
}
// float -> double and back; a NaN keeps its sign and payload and comes out quiet (x86's cvtss2sd / cvtsd2ss).
MOECORE_HD inline double to_double(float f) {
  if (!is_nan(f)) return static_cast<double>(f);
  const uint32_t u = bits_of(f);
  const uint64_t b =
      (static_cast<uint64_t>(u >> 31) << 63) | 0x7ff8000000000000ull | (static_cast<uint64_t>(u & 0x3fffffu) << 29);
  double d;
  memcpy(&d, &b, sizeof d);
  return d;
}
MOECORE_HD inline float to_float(double d) {
  uint64_t b;
  memcpy(&b, &d, sizeof b);
  if ((b & 0x7fffffffffffffffull) <= 0x7ff0000000000000ull) return static_cast<float>(d);
  return float_of((static_cast<uint32_t>(b >> 63) << 31) | 0x7fc00000u | static_cast<uint32_t>((b >> 29) & 0x3fffffu));
}
// Saturating float -> int (NaN gives 0): the same on every device (a plain cast of NaN or an out-of-range value is
// undefined behaviour in C++ and differs between x86 and CUDA).
MOECORE_HD inline int32_t to_i32(double d) {
  if (d != d) return 0;
  if (d >= 2147483647.0) return INT32_MAX;
  if (d <= -2147483648.0) return INT32_MIN;
  return static_cast<int32_t>(d);
}
MOECORE_HD inline int64_t to_i64(double d) {
  if (d != d) return 0;
  if (d >= 9223372036854775807.0) return INT64_MAX;  // 2^63
  if (d <= -9223372036854775808.0) return INT64_MIN;
  return static_cast<int64_t>(d);
}

// bf16: dtype.h's float_to_bf16 / bf16_to_float, bit for bit.
MOECORE_HD inline float bf16_to_float(uint16_t h) {
  return float_of(static_cast<uint32_t>(h) << 16);
}
MOECORE_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// Encodes |a| (finite, >= 0) into a format with EB exponent bits, MB mantissa bits and bias BIAS: round to nearest
// even on the exact value, gradual underflow. Returns the magnitude code, or ~0u beyond the exponent range; the
// caller applies the format's overflow rule when the code exceeds its largest finite one.
template <int EB, int MB, int BIAS>
MOECORE_HD uint32_t encode_magnitude(float a) {
  if (a == 0.0f) return 0;
  constexpr int emin = 1 - BIAS;
  int e2;
  frexpf(a, &e2);
  int exp = e2 - 1;                                                                // a = m * 2^exp, m in [1, 2)
  if (exp < emin) return static_cast<uint32_t>(nearbyintf(ldexpf(a, MB - emin)));  // 2^MB rolls into the min normal
  float q = nearbyintf(ldexpf(a, MB - exp));
  if (q >= static_cast<float>(1u << (MB + 1))) {
    ++exp;
    q = ldexpf(q, -1);
  }
  const uint32_t biased = static_cast<uint32_t>(exp + BIAS);
  if (biased >= (1u << EB)) return ~0u;
  return (biased << MB) | (static_cast<uint32_t>(q) - (1u << MB));
}

template <int EB, int MB, int BIAS>
MOECORE_HD float decode_magnitude(uint32_t code) {
  const uint32_t e = code >> MB, m = code & ((1u << MB) - 1);
  if (e == 0) return ldexpf(static_cast<float>(m), 1 - BIAS - MB);
  return ldexpf(static_cast<float>(m | (1u << MB)), static_cast<int>(e) - BIAS - MB);
}

// The f16 reference, by frexp/ldexp: dtype.h's fast f16_bits_to_float / float_to_f16_bits equal it bit for bit
// (tests/core checks every half and the float boundaries); the kernels and copies run the fast ones.
MOECORE_HD inline float f16_to_float_reference(uint16_t h) {
  const uint32_t mag = h & 0x7fffu;
  float v;
  if ((mag >> 10) == 0x1f)
    v = (mag & 0x3ff) ? float_of(0x7fc00000u) : float_of(0x7f800000u);
  else
    v = decode_magnitude<5, 10, 15>(mag);
  return with_sign(v, h >> 15);
}
MOECORE_HD inline uint16_t float_to_f16_reference(float f) {
  const uint16_t s = (bits_of(f) >> 31) ? 0x8000 : 0;
  if (is_nan(f)) return static_cast<uint16_t>(s | 0x7e00);
  const float a = fabsf(f);
  uint32_t code = is_inf(a) ? 0x7c00 : encode_magnitude<5, 10, 15>(a);
  if (code >= 0x7c00) code = 0x7c00;  // IEEE half overflows to infinity
  return static_cast<uint16_t>(s | code);
}

MOECORE_HD inline float f16_to_float(uint16_t h) {
  return f16_bits_to_float(h);
}
MOECORE_HD inline uint16_t float_to_f16(float f) {
  return float_to_f16_bits(f);
}

MOECORE_HD inline float f8e4m3_to_float(uint8_t v) {
  const uint32_t mag = v & 0x7fu;
  if (mag == 0x7f) return float_of(0x7fc00000u);  // NaN (unsigned, as dtype.h has always decoded it)
  const float x = decode_magnitude<4, 3, 7>(mag);
  return with_sign(x, v & 0x80);
}
MOECORE_HD inline uint8_t float_to_f8e4m3(float f) {
  const uint8_t s = (bits_of(f) >> 31) ? 0x80 : 0;
  if (is_nan(f)) return static_cast<uint8_t>(s | 0x7f);
  const float a = fabsf(f);
  uint32_t code = is_inf(a) ? ~0u : encode_magnitude<4, 3, 7>(a);
  if (code > 0x7e) code = 0x7e;  // saturate to 448 (e4m3fn has no infinity)
  return static_cast<uint8_t>(s | code);
}

MOECORE_HD inline float f8e5m2_to_float(uint8_t v) {
  const uint32_t mag = v & 0x7fu;
  float x;
  if (mag == 0x7c)
    x = float_of(0x7f800000u);
  else if (mag > 0x7c)
    return float_of(0x7fc00000u);  // NaN (unsigned, as dtype.h has always decoded it)
  else
    x = decode_magnitude<5, 2, 15>(mag);
  return with_sign(x, v & 0x80);
}
MOECORE_HD inline uint8_t float_to_f8e5m2(float f) {
  const uint8_t s = (bits_of(f) >> 31) ? 0x80 : 0;
  if (is_nan(f)) return static_cast<uint8_t>(s | 0x7f);
  const float a = fabsf(f);
  if (is_inf(a)) return static_cast<uint8_t>(s | 0x7c);
  uint32_t code = encode_magnitude<5, 2, 15>(a);
  if (code > 0x7b) code = 0x7b;  // saturate finite values to 57344
  return static_cast<uint8_t>(s | code);
}

// Element i of p (dtype t) as a double.
MOECORE_HD inline double load_as_double(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f64:
      return static_cast<const double*>(p)[i];
    case DType::f32:
      return to_double(static_cast<const float*>(p)[i]);
    case DType::bf16:
      return to_double(bf16_to_float(static_cast<const uint16_t*>(p)[i]));
    case DType::f16:
      return to_double(f16_to_float(static_cast<const uint16_t*>(p)[i]));
    case DType::f8e4m3:
      return to_double(f8e4m3_to_float(static_cast<const uint8_t*>(p)[i]));
    case DType::f8e5m2:
      return to_double(f8e5m2_to_float(static_cast<const uint8_t*>(p)[i]));
    case DType::i32:
      return static_cast<const int32_t*>(p)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::boolean:
      return static_cast<const bool*>(p)[i] ? 1.0 : 0.0;
  }
  return 0.0;
}

// Stores d into element i of p (dtype t); 16- and 8-bit floats round from float.
MOECORE_HD inline void store_double(void* p, DType t, int64_t i, double d) {
  const float v = to_float(d);
  switch (t) {
    case DType::f64:
      static_cast<double*>(p)[i] = d;
      break;
    case DType::f32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
      break;
    case DType::f16:
      static_cast<uint16_t*>(p)[i] = float_to_f16(v);
      break;
    case DType::f8e4m3:
      static_cast<uint8_t*>(p)[i] = float_to_f8e4m3(v);
      break;
    case DType::f8e5m2:
      static_cast<uint8_t*>(p)[i] = float_to_f8e5m2(v);
      break;
    case DType::i32:
      static_cast<int32_t*>(p)[i] = to_i32(d);
      break;
    case DType::i64:
      static_cast<int64_t*>(p)[i] = to_i64(d);
      break;
    case DType::boolean:
      static_cast<bool*>(p)[i] = d != 0.0;
      break;
  }
}

MOECORE_HD inline bool is_integer_or_bool(DType t) {
  return t == DType::i32 || t == DType::i64 || t == DType::boolean;
}

// dst[di] = src[si] converted from st to dt: ints and bools exactly into ints, everything else through double.
MOECORE_HD inline void convert_element(void* dst, DType dt, int64_t di, const void* src, DType st, int64_t si) {
  if (is_integer_or_bool(st) && (dt == DType::i32 || dt == DType::i64)) {
    const int64_t v = st == DType::i32   ? static_cast<const int32_t*>(src)[si]
                      : st == DType::i64 ? static_cast<const int64_t*>(src)[si]
                                         : static_cast<const bool*>(src)[si];
    if (dt == DType::i32)
      static_cast<int32_t*>(dst)[di] = static_cast<int32_t>(v);
    else
      static_cast<int64_t*>(dst)[di] = v;
    return;
  }
  store_double(dst, dt, di, load_as_double(src, st, si));
}

}  // namespace moecore::dtype_convert
