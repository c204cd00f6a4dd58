// CRC32C: slicing-by-8 tables built at compile time, and the SSE4.2 instruction when available.
// Both process little-endian words; the hardware path is ~5x faster on multi-GB checkpoint shards.
#include "moecore/io/crc32c.h"

#include <array>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace moecore::io {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (int s = 1; s < 8; ++s)
    for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}

constexpr Tables kTables = make_tables();

uint32_t update_portable(uint32_t l, const unsigned char* p, size_t n) {
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= l;
    l = kTables[7][lo & 0xFF] ^ kTables[6][(lo >> 8) & 0xFF] ^ kTables[5][(lo >> 16) & 0xFF] ^ kTables[4][lo >> 24] ^
        kTables[3][hi & 0xFF] ^ kTables[2][(hi >> 8) & 0xFF] ^ kTables[1][(hi >> 16) & 0xFF] ^ kTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) l = (l >> 8) ^ kTables[0][(l ^ *p++) & 0xFF];
  return l;
}

}  // namespace

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  return ~update_portable(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
#if defined(__SSE4_2__) && defined(__x86_64__)
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t l = ~crc;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    l = _mm_crc32_u64(l, w);
  }
  uint32_t l32 = static_cast<uint32_t>(l);
  while (n--) l32 = _mm_crc32_u8(l32, *p++);
  return ~l32;
#else
  return crc32c_extend_portable(crc, data, n);
#endif
}

}  // namespace moecore::io
