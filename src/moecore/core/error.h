// moecore::Error and the always-on check macro.
// Bad input (flags, files, shapes) raises Error with a message naming the component, the values and a
// hint. Broken internal contracts use MOECORE_CHECK, which adds file/line and the failed condition.
// Library code never calls exit().
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace moecore {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void throw_check(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace moecore

// MOECORE_CHECK(cond, "op: ", value, ...) throws moecore::Error("file:line: check `cond` failed: op: value").
#define MOECORE_CHECK(cond, ...)                                                                          \
  do {                                                                                                    \
    if (!(cond)) [[unlikely]]                                                                             \
      ::moecore::detail::throw_check(__FILE__, __LINE__, #cond, ::moecore::detail::str_cat(__VA_ARGS__)); \
  } while (0)

// MOECORE_FAIL("component: message", values...) throws moecore::Error with the given message.
#define MOECORE_FAIL(...) throw ::moecore::Error(::moecore::detail::str_cat(__VA_ARGS__))
