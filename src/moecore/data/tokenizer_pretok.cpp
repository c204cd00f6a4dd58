// The pre-tokenizer regexes of GPT-2, Llama-3 and Qwen2 written out as hand matchers over Unicode classes
// (tokenizer_bpe.h lists them). Each matcher tries the regex's alternatives in order at the current
// position, including the backtracking of \s+(?!\S) and \s*[\r\n]+, so pieces equal the regex engine's.
#include <cstdint>
#include <string_view>
#include <vector>

#include "moecore/data/tokenizer_bpe.h"
#include "moecore/data/unicode_text.h"

namespace moecore::data::detail {
namespace {

enum : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 4 };

struct Cp {
  size_t offset;  // byte offset of the code point in the text
  char32_t cp;
  uint8_t cls;
};

// Code points of `text` plus an end sentinel (offset = text.size(), class kOther).
std::vector<Cp> decode_classes(std::string_view text) {
  std::vector<Cp> cps;
  cps.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    char32_t cp;
    const int len = unicode::utf8_decode(text, i, &cp);
    uint8_t cls = static_cast<uint8_t>(unicode::char_class(cp));
    if (cls == kOther && unicode::is_whitespace(cp)) cls = kSpace;
    cps.push_back({i, cp, cls});
    i += len;
  }
  cps.push_back({text.size(), 0, kOther});
  return cps;
}

size_t run_of(const std::vector<Cp>& c, size_t i, size_t n, uint8_t cls) {
  while (i < n && c[i].cls == cls) ++i;
  return i;
}

char32_t lower_ascii(char32_t c) {
  return (c >= 'A' && c <= 'Z') ? c + 32 : c;
}

// Length (in code points) of a contraction 's 't 're 've 'm 'll 'd at i, or 0.
size_t contraction(const std::vector<Cp>& c, size_t i, size_t n, bool ignore_case) {
  if (c[i].cp != '\'' || i + 1 >= n) return 0;
  auto fold = [&](char32_t x) {
    if (!ignore_case) return x;
    return x == 0x17F ? char32_t{'s'} : lower_ascii(x);  // U+017F LONG S case-folds to 's'
  };
  const char32_t a = fold(c[i + 1].cp);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= n) return 0;
  const char32_t b = fold(c[i + 2].cp);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s+(?!\S)|\s+ at i (a whitespace character): the run, less its last character when a non-space
// follows and the run is longer than one.
size_t whitespace_piece(const std::vector<Cp>& c, size_t i, size_t n) {
  const size_t j = run_of(c, i, n, kSpace);
  return (j < n && j - i >= 2) ? j - 1 : j;
}

size_t gpt2_match(const std::vector<Cp>& c, size_t i, size_t n) {
  if (const size_t k = contraction(c, i, n, false)) return i + k;
  size_t s = i;
  if (c[i].cp == ' ' && i + 1 < n && c[i + 1].cls != kSpace) s = i + 1;  //  ?X+ with X the class after it
  if (c[s].cls != kSpace) return run_of(c, s, n, c[s].cls);
  return whitespace_piece(c, i, n);
}

size_t llama3_match(const std::vector<Cp>& c, size_t i, size_t n, size_t max_digits) {
  if (const size_t k = contraction(c, i, n, true)) return i + k;
  const uint8_t cls = c[i].cls;
  const char32_t cp = c[i].cp;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (cls == kLetter) return run_of(c, i, n, kLetter);
  if (cls != kNumber && cp != '\r' && cp != '\n' && i + 1 < n && c[i + 1].cls == kLetter)
    return run_of(c, i + 1, n, kLetter);
  // \p{N}{1,max_digits}
  if (cls == kNumber) {
    size_t j = i;
    while (j < n && j - i < max_digits && c[j].cls == kNumber) ++j;
    return j;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  const size_t s = (cp == ' ' && i + 1 < n && c[i + 1].cls == kOther) ? i + 1 : i;
  if (c[s].cls == kOther) {
    size_t j = run_of(c, s, n, kOther);
    while (j < n && (c[j].cp == '\r' || c[j].cp == '\n')) ++j;
    return j;
  }
  // \s*[\r\n]+ : through the last line break of the whitespace run
  const size_t j = run_of(c, i, n, kSpace);
  for (size_t k = j; k > i; --k) {
    if (c[k - 1].cp == '\r' || c[k - 1].cp == '\n') return k;
  }
  return whitespace_piece(c, i, n);
}

}  // namespace

void pretokenize(Pattern pattern, std::string_view text, std::vector<std::string_view>& out) {
  if (text.empty()) return;
  const std::vector<Cp> c = decode_classes(text);
  const size_t n = c.size() - 1;
  for (size_t i = 0; i < n;) {
    size_t j;
    switch (pattern) {
      case Pattern::gpt2:
        j = gpt2_match(c, i, n);
        break;
      case Pattern::llama3:
        j = llama3_match(c, i, n, 3);
        break;
      default:
        j = llama3_match(c, i, n, 1);
        break;
    }
    out.push_back(text.substr(c[i].offset, c[j].offset - c[i].offset));
    i = j;
  }
}

bool pattern_from_regex(std::string_view regex, Pattern* pattern) {
  static constexpr std::string_view kGpt2 =
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  static constexpr std::string_view kLlama3 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
                                              R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr std::string_view kQwen2 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|)"
                                             R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  if (regex == kGpt2)
    *pattern = Pattern::gpt2;
  else if (regex == kLlama3)
    *pattern = Pattern::llama3;
  else if (regex == kQwen2)
    *pattern = Pattern::qwen2;
  else
    return false;
  return true;
}

}  // namespace moecore::data::detail
