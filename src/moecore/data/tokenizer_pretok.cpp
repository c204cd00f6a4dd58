// Pre-tokenizer regexes through PCRE2 (8-bit, UTF + UCP, JIT when available): the GPT-2 pattern of ByteLevel and
// any Split pattern of a tokenizer.json (Llama-3, Qwen2/3, DeepSeek-V3, ...), with HF tokenizers' match iteration
// and split behaviours. Not here: the Unicode tables themselves (PCRE2's own, Unicode 14 in Debian 12's 10.42).
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/data/tokenizer_bpe.h"

namespace moecore::data::detail {

const std::string_view kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace {

// Unicode White_Space, the set Oniguruma's \s matches (PCRE2 10.42's \s under UCP adds U+180E).
constexpr std::string_view kWhiteSpace =
    R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// The pattern with \s (and \S outside a character class) spelled as the White_Space set. \S inside a class
// stays PCRE2's (it differs from Oniguruma's on U+180E only).
std::string rewrite_whitespace(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 'Q') {  // \Q...\E quotes everything up to \E
        const size_t end = p.find("\\E", i + 1);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i - 1, stop - (i - 1)));
        i = stop - 1;
      } else if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpace) + "]";
      } else {
        out += c;
        out += e;
      }
    } else if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ] is a literal
    } else if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      const size_t end = p.find(":]", i + 2);  // POSIX class [:alpha:]
      const size_t stop = end == std::string_view::npos ? i + 1 : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop - 1;
    } else {
      if (in_class && c == ']') in_class = false;
      out += c;
    }
  }
  return out;
}

// A regex matching `s` literally (PCRE2_LITERAL does not combine with PCRE2_MATCH_INVALID_UTF): a backslash
// before every ASCII punctuation character.
std::string quote_literal(std::string_view s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

// One ovector pair is all the splitter reads; one per thread, shared by every pattern.
pcre2_match_data* thread_match_data() {
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> md(pcre2_match_data_create(1, nullptr));
  return md.get();
}

// Byte offset just past the character at i (an invalid byte counts as one character).
size_t next_char(std::string_view s, size_t i) {
  ++i;
  while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
  return i;
}

struct Span {
  size_t begin, end;
  bool match;
};

// HF's SplitDelimiterBehavior applied to the (match / gap) spans covering a text; returns the pieces to keep.
std::vector<Span> apply_behavior(std::vector<Span> spans, SplitBehavior behavior) {
  std::vector<Span> out;
  out.reserve(spans.size());
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      return spans;
    case SplitBehavior::removed:
      for (const Span& s : spans) {
        if (!s.match) out.push_back(s);
      }
      return out;
    case SplitBehavior::merged_with_previous:
      for (const Span& s : spans) {
        if (s.match && !prev_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        prev_match = s.match;
      }
      return out;
    case SplitBehavior::merged_with_next:
      for (size_t k = spans.size(); k-- > 0;) {
        const Span& s = spans[k];
        if (s.match && !prev_match && !out.empty())
          out.back().begin = s.begin;
        else
          out.push_back(s);
        prev_match = s.match;
      }
      return {out.rbegin(), out.rend()};
    case SplitBehavior::contiguous:
      for (const Span& s : spans) {
        if (s.match == prev_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        prev_match = s.match;
      }
      return out;
  }
  return out;
}

}  // namespace

struct SplitRegex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;     // JIT-compiled (the library has JIT and the pattern compiled)
  std::string pattern;  // as given, for error messages

  ~Impl() { pcre2_code_free(code); }

  // Start and end of the next match at or after `start`, or false.
  bool find(std::string_view text, size_t start, size_t* mb, size_t* me) const {
    pcre2_match_data* md = thread_match_data();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    // pcre2_jit_match skips pcre2_match's per-call checks, a fifth of the time for the GPT-2 pattern.
    int rc = jit ? pcre2_jit_match(code, subject, text.size(), start, 0, md, nullptr)
                 : pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // the interpreter keeps its backtracking on the heap
      rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      MOECORE_FAIL("pre-tokenizer regex '", pattern, "': matching a text of ", text.size(), " bytes failed at offset ",
                   start, ": ", reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    *mb = ov[0];
    *me = ov[1];
    return true;
  }
};

SplitRegex::SplitRegex(std::string_view pattern, bool literal, const std::string& source)
    : impl_(std::make_unique<Impl>()) {
  impl_->pattern = std::string(pattern);
  const std::string compiled = literal ? quote_literal(pattern) : rewrite_whitespace(pattern);
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), options, &err,
                              &err_offset, nullptr);
  if (impl_->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    MOECORE_FAIL(source, ": pre-tokenizer regex '", pattern,
                 "' does not compile (PCRE2: ", reinterpret_cast<const char*>(msg), " at offset ", err_offset, " of '",
                 compiled, "'); only PCRE2/Oniguruma-compatible syntax is supported");
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;  // else pcre2_match interprets
}

SplitRegex::~SplitRegex() = default;

const SplitRegex& SplitRegex::gpt2() {
  static const SplitRegex re(kGpt2Regex, false, "GPT-2 pre-tokenizer");
  return re;
}

void SplitRegex::split(std::string_view text, SplitBehavior behavior, bool invert,
                       std::vector<std::string_view>& out) const {
  if (text.empty()) return;
  // Oniguruma's find_iter as HF tokenizers uses it: after an empty match the search moves one character on, and
  // an empty match right where the previous match ended is skipped.
  const bool fast = behavior == SplitBehavior::isolated && !invert;
  std::vector<Span> spans;
  auto emit = [&](size_t b, size_t e, bool match) {
    if (fast) {
      if (e > b) out.push_back(text.substr(b, e - b));
    } else {
      spans.push_back({b, e, match != invert});
    }
  };
  size_t prev = 0, start = 0;
  bool any = false;
  size_t mb, me;
  while (start <= text.size() && impl_->find(text, start, &mb, &me)) {
    if (mb == me) {
      const bool skip = any && me == prev;
      start = me < text.size() ? next_char(text, me) : text.size() + 1;
      if (skip) continue;
    } else {
      start = me;
    }
    if (prev != mb) emit(prev, mb, false);
    emit(mb, me, true);
    prev = me;
    any = true;
  }
  if (prev != text.size()) emit(prev, text.size(), false);
  if (fast) return;
  for (const Span& s : apply_behavior(std::move(spans), behavior)) {
    if (s.end > s.begin) out.push_back(text.substr(s.begin, s.end - s.begin));
  }
}

}  // namespace moecore::data::detail
