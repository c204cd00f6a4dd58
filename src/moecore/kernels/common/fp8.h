// FP8 quantisation's arithmetic as Transformer Engine's recipes define it (docs/fp8-spec.md §3-4), shared by the CPU
// kernels (cpu/fp8.cpp) and any device kernel: the formats' saturating casts, a block's scale from its amax for each
// scale rule, MXFP8's E8M0 scale, and delayed scaling's update of one quantizer slot (its amax history and scale).
// Not here: which tensors are quantised and with which recipe (the model), or the amax reductions across ranks.
#pragma once

#include <cfloat>
#include <cstdint>

#include "moecore/core/dtype_convert.h"
#include "moecore/kernels/common/hd.h"

namespace moecore::ops::fp8 {

namespace dc = moecore::dtype_convert;

// The largest finite value of each format: E4M3 448 (0x7E), E5M2 57344 (0x7B).
MOECORE_HD_FORCEINLINE float max_of(bool e5m2) {
  return e5m2 ? 57344.0f : 448.0f;
}

// TE's cast (cvt.rn.satfinite): round to nearest even, finite overflow and infinities saturate to +-max, NaN is the
// canonical 0x7F. (dtype.h's float_to_f8e4m3 saturates alike but keeps a NaN's sign; its E5M2 keeps infinities.)
MOECORE_HD_FORCEINLINE uint8_t cast(float x, bool e5m2) {
  if (dc::is_nan(x)) return 0x7f;
  if (dc::is_inf(x)) return static_cast<uint8_t>((x < 0.0f ? 0x80 : 0x00) | (e5m2 ? 0x7b : 0x7e));
  return e5m2 ? dc::float_to_f8e5m2(x) : dc::float_to_f8e4m3(x);
}
MOECORE_HD_FORCEINLINE float value_of(uint8_t q, bool e5m2) {
  return e5m2 ? dc::f8e5m2_to_float(q) : dc::f8e4m3_to_float(q);
}

// value_of(cast(x, e5m2)) without the byte: x rounded to the nearest FP8 value (ties to even, subnormals included),
// saturating to +-max (infinities too), NaN kept -- branch-light, so that loops over it vectorise.
MOECORE_HD_FORCEINLINE float round_to(float x, bool e5m2) {
  const float max = max_of(e5m2);
  const float a = x < 0.0f ? -x : x;
  float r;
  if (!(a < max)) {
    r = dc::is_nan(a) ? a : max;
  } else if (a >= (e5m2 ? 0x1p-14f : 0x1p-6f)) {  // normal: round the f32 mantissa to 2 or 3 bits
    const int shift = e5m2 ? 21 : 20;
    uint32_t bits = dc::bits_of(a);
    bits += (1u << (shift - 1)) - 1u + ((bits >> shift) & 1u);
    r = dc::float_of(bits & ~((1u << shift) - 1u));
  } else {  // subnormal: an addend whose f32 ulp is the FP8 quantum (2^-16, 2^-9) makes the FPU round
    const float magic = e5m2 ? 0x1p7f : 0x1p14f;
    r = (a + magic) - magic;
  }
  return (dc::bits_of(x) >> 31) ? -r : r;
}

// TE's compute_scale_from_amax (common/recipe/recipe_common.cuh): amax below eps becomes eps; an amax of 0, infinity
// or NaN gives 1; else fp8_max / amax rounded to f32, an infinite quotient replaced by inf_scale; pow2 keeps the
// exponent only (rounds down to a power of two). (The blockwise recipe: pow2, inf_scale the input dtype's largest
// finite value; current per-tensor scaling: no pow2, FLT_MAX.)
MOECORE_HD_FORCEINLINE float scale_from_amax(float amax, float fp8_max, bool pow2, float eps, float inf_scale) {
  if (amax < eps) amax = eps;
  if (dc::is_nan(amax) || dc::is_inf(amax) || amax == 0.0f) return 1.0f;
  float scale = fp8_max / amax;
  if (dc::is_inf(scale)) scale = inf_scale;
  if (pow2) scale = dc::float_of(dc::bits_of(scale) & 0xff800000u);
  return scale;
}

// MXFP8's block scale (TE's quantize_mxfp8 and float_to_e8m0, docs/fp8-spec.md §3.4): the E8M0 byte of
// fp32(amax * fp32(1 / fp8_max)) with its exponent rounded up -- NaN 0xFF, infinity 0xFE, 0 and values up to 2^-127
// 0x00, an exponent of 0xFE kept (satfinite).
MOECORE_HD_FORCEINLINE uint8_t e8m0_of_amax(float amax, bool e5m2) {
  const float p = amax * (e5m2 ? 1.0f / 57344.0f : 1.0f / 448.0f);
  if (dc::is_nan(p)) return 0xff;
  if (dc::is_inf(p)) return 0xfe;
  if (p == 0.0f) return 0x00;
  const uint32_t bits = dc::bits_of(p);
  uint32_t exponent = (bits >> 23) & 0xffu;
  const uint32_t mantissa = bits & 0x7fffffu;
  if (mantissa > 0 && exponent != 0xfe && !(exponent == 0 && mantissa <= 0x400000u)) ++exponent;
  return static_cast<uint8_t>(exponent);
}
// 2^(e - 127), the block's scale_inv (NaN for 0xFF); its scale is the exact power 2^(127 - e).
MOECORE_HD_FORCEINLINE float e8m0_value(uint8_t e) {
  if (e == 0xff) return dc::float_of(0x7fc00000u);
  if (e == 0) return dc::float_of(0x00400000u);  // 2^-127, an f32 subnormal
  return dc::float_of(static_cast<uint32_t>(e) << 23);
}
MOECORE_HD_FORCEINLINE float e8m0_scale(uint8_t e) {
  if (e == 0xff) return dc::float_of(0x7fc00000u);
  if (e == 0xfe) return dc::float_of(0x00400000u);  // 2^-127
  return dc::float_of(static_cast<uint32_t>(254 - e) << 23);
}

// fmaxf: the larger, a NaN operand ignored.
MOECORE_HD_FORCEINLINE float fmax_skip_nan(float a, float b) {
  return dc::is_nan(a) ? b : dc::is_nan(b) ? a : (a > b ? a : b);
}
// Delayed scaling's update of one quantizer slot (TE's fused delayed_scaling.cu, docs/fp8-spec.md §3.1 step 4) with
// its reduced amax a. history [L]: row 0 is the accumulator the quantisations max |x| into, rows 1..L-1 the past
// amaxes, oldest first. a == 0 changes nothing (no roll, the scale kept: a cached weight not quantised again). Else
// the used amax is a (most_recent) or the max over the old rows 1..L-1 and a (use_max; NaN ignored), the history
// rolls (row 0 := 0, rows 1..L-2 move one towards the front, row L-1 := a), and the scale becomes
// scaled_max / used (scaled_max = fp8_max * 2^-margin) when used is finite and > 0, FLT_MAX for an infinite quotient,
// else stays. Returns the new scale.
MOECORE_HD_FORCEINLINE float delayed_update(float* history, int64_t length, float a, bool use_max, float scaled_max,
                                            float scale) {
  if (a == 0.0f) return scale;
  float used = a;
  if (use_max)
    for (int64_t i = 1; i < length; ++i) used = fmax_skip_nan(used, history[i]);
  for (int64_t i = 1; i + 1 < length; ++i) history[i] = history[i + 1];
  if (length > 1) history[length - 1] = a;
  history[0] = 0.0f;
  if (!(dc::is_nan(used) || dc::is_inf(used)) && used > 0.0f) {
    const float s = scaled_max / used;
    return dc::is_inf(s) ? FLT_MAX : s;
  }
  return scale;
}

}  // namespace moecore::ops::fp8
