// Element types and their conversions: fp32, bf16, fp16, fp8 (e4m3fn, e5m2), fp64, int32, int64, bool.
// Narrowing float conversions round to nearest even; fp8 saturates to the largest finite value as the
// OCP FP8 spec allows for training (NaN stays NaN; e5m2 keeps its infinities only for inf inputs).
// No tensor code here: this header is included by every kernel.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

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
// Overloads for code templated on the element type (f32 or bf16 storage, f32 math).
inline float to_float(float v) {
  return v;
}
inline float to_float(bf16 v) {
  return bf16_to_float(v);
}
inline void from_float(float& d, float v) {
  d = v;
}
inline void from_float(bf16& d, float v) {
  d = float_to_bf16(v);
}

float f16_to_float(f16 h);
f16 float_to_f16(float f);
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
