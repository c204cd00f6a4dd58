// Element types and their conversions: fp32, bf16, fp16, fp8 (e4m3fn, e5m2), fp64, int32, int64, bool.
// Narrowing float conversions round to nearest even; fp8 saturates to the largest finite value as the
// OCP FP8 spec allows for training (NaN stays NaN; e5m2 keeps its infinities only for inf inputs).
// No tensor code here: this header is included by every kernel.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#ifndef MOECORE_HD
#ifdef __CUDACC__
#define MOECORE_HD __host__ __device__
#else
#define MOECORE_HD
#endif
#endif

namespace moecore {

enum class DType : uint8_t { f32, bf16, f16, f8e4m3, f8e5m2, i32, i64, boolean, f64 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "f32", "bf16", ...
bool dtype_is_float(DType t);

// Storage types: 16/8-bit floats are plain bit containers; arithmetic converts through float.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
struct f8e4m3 {
  uint8_t bits;
};
struct f8e5m2 {
  uint8_t bits;
};

inline float bf16_to_float(bf16 h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16);
}
inline bf16 float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                            // round to nearest even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// IEEE half from its bits and back, by bit manipulation (host and device; branch-free, so GCC vectorises loops
// over them). float -> half rounds to nearest even with gradual underflow, |f| >= 65520 becomes ±inf (no
// saturation: loss scaling watches for the overflow), NaN becomes the quiet NaN 0x7e00 with f's sign. half ->
// float is exact; a NaN becomes 0x7fc00000 with h's sign. Bit for bit the frexp-based reference of
// core/dtype_convert.h (f16_to_float_reference, float_to_f16_reference), which tests/core checks exhaustively.
MOECORE_HD inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, mag = h & 0x7fffu;
  // A subnormal is mag * 2^-24 exactly (the product is a normal float).
  const float sub = static_cast<float>(mag) * 5.9604644775390625e-8f;
  uint32_t sub_bits;
  memcpy(&sub_bits, &sub, sizeof sub_bits);
  const uint32_t special = (mag & 0x3ffu) ? 0x7fc00000u : 0x7f800000u;  // NaN or inf
  const uint32_t normal = (mag << 13) + 0x38000000u;                    // rebias 15 -> 127
  const uint32_t u = sign | (mag < 0x400u ? sub_bits : (mag >= 0x7c00u ? special : normal));
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
MOECORE_HD inline uint16_t float_to_f16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  // Normal halves: rebias 127 -> 15 and round the 13 dropped bits to nearest even; a carry rolls into the
  // exponent, and everything from 65520 up (inf included) lands at or beyond 0x7c00.
  const uint32_t n = a - 0x38000000u;
  const uint32_t rounded = (n + 0xfffu + ((n >> 13) & 1u)) >> 13;
  const uint32_t normal = rounded < 0x7c00u ? rounded : 0x7c00u;
  // Subnormal halves (|f| < 2^-14): adding 0.5 (ulp 2^-24) rounds |f| to a multiple of 2^-24, to nearest even.
  float af;
  memcpy(&af, &a, sizeof af);
  const float shifted = af + 0.5f;
  uint32_t shifted_bits;
  memcpy(&shifted_bits, &shifted, sizeof shifted_bits);
  const uint32_t sub = shifted_bits - 0x3f000000u;
  const uint32_t code = a > 0x7f800000u ? 0x7e00u : (a < 0x38800000u ? sub : normal);
  return static_cast<uint16_t>(sign | code);
}
inline float f16_to_float(f16 h) {
  return f16_bits_to_float(h.bits);
}
inline f16 float_to_f16(float f) {
  return f16{float_to_f16_bits(f)};
}

// Overloads for code templated on the element type (f32, bf16 or f16 storage, f32 math).
inline float to_float(float v) {
  return v;
}
inline float to_float(bf16 v) {
  return bf16_to_float(v);
}
inline float to_float(f16 v) {
  return f16_to_float(v);
}
inline void from_float(float& d, float v) {
  d = v;
}
inline void from_float(bf16& d, float v) {
  d = float_to_bf16(v);
}
inline void from_float(f16& d, float v) {
  d = float_to_f16(v);
}

float f8e4m3_to_float(f8e4m3 v);
f8e4m3 float_to_f8e4m3(float f);  // saturating: |f| > 448 -> ±448
float f8e5m2_to_float(f8e5m2 v);
f8e5m2 float_to_f8e5m2(float f);  // saturating: finite |f| > 57344 -> ±57344

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<f8e4m3>() {
  return DType::f8e4m3;
}
template <>
constexpr DType dtype_of<f8e5m2>() {
  return DType::f8e5m2;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<bool>() {
  return DType::boolean;
}

// Converts n elements between any two dtypes (floats through double; ints exactly).
void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n);

}  // namespace moecore
