// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of checkpoint manifests and of
// TensorBoard's TFRecord framing, plus TFRecord's masking. Check value: crc32c("123456789") = 0xE3069283.
// Uses the SSE4.2 crc32 instruction when the build targets it, slicing-by-8 tables otherwise.
// Not here: any file handling (checkpoint.h, metrics.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moecore::io {

// CRC32C of `data` appended to a stream whose CRC32C so far is `crc` (0 for an empty stream), so
// crc32c_extend(crc32c(a), b) == crc32c(a + b). Thread-safe (the tables are built at compile time).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(std::string_view s) {
  return crc32c_extend(0, s.data(), s.size());
}

// The table-driven path, always available; tests compare it with crc32c_extend.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);

// TFRecord masking: rotate right by 15 and add 0xA282EAD8 (docs/formats.md §5.1).
inline uint32_t crc32c_mask(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}
inline uint32_t crc32c_unmask(uint32_t masked) {
  const uint32_t rot = masked - 0xA282EAD8u;
  return (rot >> 17) | (rot << 15);
}

}  // namespace moecore::io
