// Lookups over the generated Unicode tables, tolerant UTF-8 coding, and the NFC algorithm (UAX #15:
// full canonical decomposition, canonical ordering, canonical composition; Hangul done arithmetically).
#include "moecore/data/unicode_text.h"

#include <algorithm>
#include <vector>

#include "moecore/data/unicode_tables.h"

namespace moecore::data::unicode {
namespace {

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

uint8_t range_lookup(const tables::ClassRange* r, int n, char32_t cp) {
  const tables::ClassRange* end = r + n;
  const auto* it = std::upper_bound(r, end, cp, [](char32_t c, const tables::ClassRange& x) { return c < x.lo; });
  if (it == r) return 0;
  --it;
  return cp <= it->hi ? it->v : 0;
}

void decompose_into(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* begin = tables::kDecompositions;
  const auto* end = begin + tables::kNumDecompositions;
  const auto* it =
      std::lower_bound(begin, end, cp, [](const tables::Decomposition& d, char32_t c) { return d.cp < c; });
  if (it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  out.insert(out.end(), tables::kDecompositionPool + it->offset, tables::kDecompositionPool + it->offset + it->length);
}

// The primary composite of (a, b), or 0.
char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* begin = tables::kCompositions;
  const auto* end = begin + tables::kNumCompositions;
  const auto* it =
      std::lower_bound(begin, end, std::pair{a, b}, [](const tables::Composition& c, std::pair<char32_t, char32_t> k) {
        return c.a < k.first || (c.a == k.first && c.b < k.second);
      });
  return (it != end && it->a == a && it->b == b) ? it->c : 0;
}

}  // namespace

int utf8_decode(std::string_view s, size_t i, char32_t* cp) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  int len;
  char32_t v, min;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, v = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, v = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, v = b0 & 0x07, min = 0x10000;
  } else {
    *cp = kInvalidBase + b0;
    return 1;
  }
  if (i + len > s.size()) {
    *cp = kInvalidBase + b0;
    return 1;
  }
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) {
      *cp = kInvalidBase + b0;
      return 1;
    }
    v = (v << 6) | (b & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v < 0xE000)) {
    *cp = kInvalidBase + b0;
    return 1;
  }
  *cp = v;
  return len;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < kInvalidBase) {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(cp - kInvalidBase));
  }
}

CharClass char_class(char32_t cp) {
  if (cp < 0x80) {
    if (cp >= '0' && cp <= '9') return CharClass::number;
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CharClass::letter;
    return CharClass::other;
  }
  if (cp >= kInvalidBase) return CharClass::other;
  const uint8_t v = range_lookup(tables::kClassRanges, tables::kNumClassRanges, cp);
  return v == 1 ? CharClass::letter : (v == 2 || v == 3) ? CharClass::number : CharClass::other;
}

bool is_word_char(char32_t cp) {
  if (cp < 0x80) return cp == '_' || char_class(cp) != CharClass::other;
  if (cp >= kInvalidBase) return false;
  if (cp == 0x200C || cp == 0x200D) return true;
  const uint8_t v = range_lookup(tables::kClassRanges, tables::kNumClassRanges, cp);
  return v == 1 || v == 2 || v == 4 || v == 5;
}

bool is_whitespace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300 || cp >= kInvalidBase) return 0;
  return range_lookup(tables::kCombiningRanges, tables::kNumCombiningRanges, cp);
}

std::string nfc(std::string_view s) {
  // Code points below U+0300 are all NFC-stable and never compose: their lead bytes are below 0xCC.
  if (std::none_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) >= 0xCC; }))
    return std::string(s);
  std::vector<char32_t> d;
  d.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    char32_t cp;
    i += utf8_decode(s, i, &cp);
    decompose_into(cp, d);
  }
  // Canonical ordering: a stable sort by combining class within each run of non-starters.
  for (size_t i = 1; i < d.size(); ++i) {
    const uint8_t cc = combining_class(d[i]);
    if (cc == 0) continue;
    for (size_t j = i; j > 0 && combining_class(d[j - 1]) > cc; --j) std::swap(d[j], d[j - 1]);
  }
  // Canonical composition (the UAX #15 reference loop): a character joins the last starter unless a
  // character of equal or higher class, or any starter, sits between them.
  size_t starter = 0, out = d.empty() ? 0 : 1;
  int last_class = d.empty() || combining_class(d[0]) == 0 ? 0 : 256;
  for (size_t i = 1; i < d.size(); ++i) {
    const char32_t ch = d[i];
    const int cc = combining_class(ch);
    if (const char32_t c = compose_pair(d[starter], ch); c != 0 && (last_class < cc || last_class == 0)) {
      d[starter] = c;
      continue;
    }
    if (cc == 0) starter = out;
    last_class = cc;
    d[out++] = ch;
  }
  d.resize(out);
  std::string r;
  r.reserve(s.size() + 8);
  for (char32_t cp : d) utf8_append(r, cp);
  return r;
}

const char* version() {
  return tables::kUnicodeVersion;
}

}  // namespace moecore::data::unicode
