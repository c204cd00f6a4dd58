#include "moecore/model/layer_pattern.h"

#include <cctype>

#include "moecore/core/error.h"

namespace moecore::model {
namespace {

// Recursive descent over the expression with whitespace removed; lists stay short (layer counts), so
// repetition simply copies.
class PatternParser {
 public:
  PatternParser(std::string text, const std::string& original, const char* flag)
      : s_(std::move(text)), original_(original), flag_(flag) {}

  std::vector<int> parse() {
    std::vector<int> v = expr();
    if (pos_ != s_.size()) fail("unexpected '" + std::string(1, s_[pos_]) + "'");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    MOECORE_FAIL(flag_, " '", original_, "': ", what, " at character ", pos_ + 1,
                 " (expected an integer N or a list expression such as [0]*3+[1]*58)");
  }
  bool eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) return ++pos_, true;
    return false;
  }
  bool at_digit() const { return pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_])); }
  int64_t integer() {
    if (!at_digit()) fail("expected an integer");
    int64_t v = 0;
    while (at_digit()) {
      v = v * 10 + (s_[pos_++] - '0');
      if (v > 1'000'000) fail("integer too large");
    }
    return v;
  }
  static std::vector<int> repeat(const std::vector<int>& v, int64_t n) {
    std::vector<int> out;
    for (int64_t i = 0; i < n; ++i) out.insert(out.end(), v.begin(), v.end());
    return out;
  }
  std::vector<int> expr() {
    std::vector<int> v = term();
    while (eat('+')) {
      const std::vector<int> t = term();
      v.insert(v.end(), t.begin(), t.end());
    }
    return v;
  }
  std::vector<int> term() {
    std::vector<int> v;
    if (at_digit()) {  // INT '*' factor
      const int64_t n = integer();
      if (!eat('*')) fail("a number must multiply a list");
      v = repeat(factor(), n);
    } else {
      v = factor();
    }
    while (eat('*')) v = repeat(v, integer());
    if (v.size() > 100'000) fail("list too long");
    return v;
  }
  std::vector<int> factor() {
    if (eat('(')) {
      std::vector<int> v = expr();
      if (!eat(')')) fail("missing ')'");
      return v;
    }
    if (!eat('[')) fail("expected '[' or '('");
    std::vector<int> v;
    if (eat(']')) return v;
    do {
      const int64_t x = integer();
      if (x != 0 && x != 1) fail("entries must be 0 or 1, got " + std::to_string(x));
      v.push_back(static_cast<int>(x));
    } while (eat(','));
    if (!eat(']')) fail("missing ']'");
    return v;
  }

  std::string s_;
  const std::string& original_;
  const char* flag_;
  size_t pos_ = 0;
};

}  // namespace

std::vector<bool> parse_layer_pattern(const std::string& expr, int64_t num_layers, const char* flag) {
  std::string s;
  for (char ch : expr)
    if (!std::isspace(static_cast<unsigned char>(ch)) && ch != '"' && ch != '\'') s.push_back(ch);
  if (s.empty()) MOECORE_FAIL(flag, " is empty (expected an integer N or a list expression such as [0]*3+[1]*58)");
  // A YAML/JSON list arrives as "0,1,1" (entries joined by commas): read it as "[0,1,1]".
  if (s.find(',') != std::string::npos && s.find_first_of("[(") == std::string::npos) s = "[" + s + "]";
  std::vector<bool> out;
  if (std::isdigit(static_cast<unsigned char>(s[0])) && s.find_first_of("[(*+") == std::string::npos) {
    char* end = nullptr;
    const long n = std::strtol(s.c_str(), &end, 10);
    if (*end || n <= 0) MOECORE_FAIL(flag, " '", expr, "' must be a positive integer or a list expression");
    for (int64_t i = 0; i < num_layers; ++i) out.push_back(i % n == 0);
    return out;
  }
  const std::vector<int> v = PatternParser(s, expr, flag).parse();
  if (static_cast<int64_t>(v.size()) != num_layers)
    MOECORE_FAIL(flag, " '", expr, "' lists ", v.size(), " layers but --num-layers is ", num_layers);
  for (int x : v) out.push_back(x == 1);
  return out;
}

}  // namespace moecore::model
