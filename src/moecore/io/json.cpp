#include "moecore/io/json.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

namespace moecore::io {

int json_nesting_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

nlohmann::json parse_json(std::string_view text, std::string_view what) {
  if (json_nesting_depth(text) > kMaxJsonDepth)
    MOECORE_FAIL(what, ": JSON nested deeper than ", kMaxJsonDepth, " levels");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOECORE_FAIL(what, ": not valid JSON: ", e.what());
  }
}

}  // namespace moecore::io
