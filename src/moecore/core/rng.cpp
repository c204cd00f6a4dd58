// Philox-4x32-10 and the named-stream fillers. Normals come from Box-Muller in double precision so that
// the values are reproducible to the last bit on any host with an IEEE libm.
#include "moecore/core/rng.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore {
namespace {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::array<float, 4> normals_of_block(PhiloxKey key, uint64_t block) {
  const auto r = philox4x32_10({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0, 0}, key);
  std::array<float, 4> out;
  for (int p = 0; p < 2; ++p) {
    const double u1 = (static_cast<double>(r[2 * p]) + 0.5) * 0x1p-32;
    const double u2 = (static_cast<double>(r[2 * p + 1]) + 0.5) * 0x1p-32;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 6.283185307179586 * u2;
    out[2 * p] = static_cast<float>(radius * std::cos(angle));
    out[2 * p + 1] = static_cast<float>(radius * std::sin(angle));
  }
  return out;
}
}  // namespace

std::array<uint32_t, 4> philox4x32_10(PhiloxCounter c, PhiloxKey k) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    k = {k[0] + kWeyl0, k[1] + kWeyl1};
  }
  return c;
}

PhiloxKey philox_key(uint64_t seed, std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the name, then mixed with the seed
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001B3ull;
  const uint64_t k = splitmix64(h ^ splitmix64(seed));
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

float philox_uniform(PhiloxKey key, uint64_t index) {
  const uint64_t block = index / 4;
  const auto r = philox4x32_10({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 1, 0}, key);
  // Words within 2^7 of 2^32 would round up to 1.0f; clamp to the largest float below 1 so the interval
  // stays open as rng.h promises.
  return std::min(static_cast<float>((static_cast<double>(r[index % 4]) + 0.5) * 0x1p-32), 0x1.fffffep-1f);
}

float philox_normal(PhiloxKey key, uint64_t index) {
  return normals_of_block(key, index / 4)[index % 4];
}

namespace {
// Writes the drawn f32 values into t: converted in place on the host, or through a host tensor and one
// transfer for a device tensor (initialisation happens once; the values never depend on the device).
void store(Tensor& t, const std::vector<float>& vals) {
  if (t.device() == Device::cpu) {
    convert(t.raw(), t.dtype(), vals.data(), DType::f32, vals.size());
    return;
  }
  Tensor h = Tensor::empty(t.shape(), t.dtype(), MemCategory::other);
  convert(h.raw(), h.dtype(), vals.data(), DType::f32, vals.size());
  t.copy_from(h);
}
}  // namespace

void rng_fill_normal(Tensor& t, uint64_t seed, std::string_view name, float mean, float std, uint64_t first_index) {
  MOECORE_CHECK(t.is_contiguous() && dtype_is_float(t.dtype()),
                "rng_fill_normal: needs a contiguous float tensor, got ", t.str());
  const PhiloxKey key = philox_key(seed, name);
  const int64_t n = t.numel();
  std::vector<float> vals(static_cast<size_t>(n));
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) vals[i] = mean + std * philox_normal(key, first_index + i);
  store(t, vals);
}

void rng_fill_uniform(Tensor& t, uint64_t seed, std::string_view name, float lo, float hi, uint64_t first_index) {
  MOECORE_CHECK(t.is_contiguous() && dtype_is_float(t.dtype()),
                "rng_fill_uniform: needs a contiguous float tensor, got ", t.str());
  const PhiloxKey key = philox_key(seed, name);
  const int64_t n = t.numel();
  std::vector<float> vals(static_cast<size_t>(n));
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) vals[i] = lo + (hi - lo) * philox_uniform(key, first_index + i);
  store(t, vals);
}

}  // namespace moecore
