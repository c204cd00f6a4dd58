#include "moecore/core/error.h"

namespace moecore::detail {
void throw_check(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error(str_cat(file, ":", line, ": check `", cond, "` failed: ", msg));
}
}  // namespace moecore::detail
