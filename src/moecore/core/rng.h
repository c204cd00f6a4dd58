// Counter-based random numbers (Philox-4x32-10, Salmon et al. 2011).
// A parameter's initial value depends only on (seed, parameter name, element index): the key is a hash
// of (seed, name) and the counter is the element index. So every parallel layout and every device
// initialises the same global parameter to the same values, and a shard fills only its own range.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace moecore {

class Tensor;

using PhiloxKey = std::array<uint32_t, 2>;
using PhiloxCounter = std::array<uint32_t, 4>;

std::array<uint32_t, 4> philox4x32_10(PhiloxCounter counter, PhiloxKey key);
PhiloxKey philox_key(uint64_t seed, std::string_view stream_name);

// Element i of a stream: uniform in (0, 1) and standard normal (Box-Muller on counter block i / 4).
float philox_uniform(PhiloxKey key, uint64_t index);
float philox_normal(PhiloxKey key, uint64_t index);

// Fills a contiguous float tensor holding global elements [first_index, first_index + numel) of the
// named stream with N(mean, std^2), or U(lo, hi). Threaded; the result does not depend on threads.
void rng_fill_normal(Tensor& t, uint64_t seed, std::string_view name, float mean, float std, uint64_t first_index = 0);
void rng_fill_uniform(Tensor& t, uint64_t seed, std::string_view name, float lo, float hi, uint64_t first_index = 0);

}  // namespace moecore
