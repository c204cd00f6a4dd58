// moecore's environment variables (MOECORE_COMM_TIMEOUT_S, MOECORE_CUDA_SYNC, ...) read as strictly as flags: a
// number outside its domain, NaN, an infinity, an overflow or junk, and a switch that is not a boolean, raise an
// Error naming the variable, its value and what it accepts; nothing is silently ignored. Header-only, so the device
// seam (kernels/cuda/device_copy.cu, linked below core) and the tests use the same rules.
// Not here: what a variable means (its reader documents that) or reading it once per process (the caller caches).
#pragma once
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "moecore/core/error.h"

namespace moecore {

// The number in `name`, nullopt when unset. Accepted: a decimal number (600, 0.5, 1e3) in [lo, hi]; refused, naming
// the variable and "a number in [lo, hi]" plus `meaning` (e.g. "seconds; 0 waits forever"): an empty value,
// leading or trailing junk, NaN, infinities, overflow, and anything outside [lo, hi].
inline std::optional<double> env_number(const char* name, double lo, double hi, const char* meaning) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double x = *v && !std::isspace(static_cast<unsigned char>(*v)) ? std::strtod(v, &end) : std::nan("");
  const bool ok = end && end != v && *end == '\0' && errno != ERANGE && std::isfinite(x) && x >= lo && x <= hi;
  if (!ok) {
    char range[80];
    std::snprintf(range, sizeof range, "[%.15g, %.15g]", lo, hi);
    MOECORE_FAIL("environment variable ", name, "='", v, "' is not a number in ", range, " (", meaning,
                 "); hint: fix or unset it");
  }
  return x;
}

// The switch in `name`: 1, true, on, yes -> true; 0, false, off, no and the empty value -> false (any case);
// `unset` when the variable is not set. Anything else raises naming the variable and `meaning` (what 1 does).
inline bool env_switch(const char* name, bool unset, const char* meaning) {
  const char* v = std::getenv(name);
  if (!v) return unset;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s.empty() || s == "0" || s == "false" || s == "off" || s == "no") return false;
  MOECORE_FAIL("environment variable ", name, "='", v, "' is not a switch: set 1 (", meaning,
               ") or 0; hint: fix or unset it");
}

// The value of `name` when it is one of `choices`, nullopt when unset. Anything else (the empty value too) raises
// naming the variable, the choices and `meaning`.
inline std::optional<std::string> env_choice(const char* name, std::initializer_list<const char*> choices,
                                             const char* meaning) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  std::string listed;
  size_t i = 0;
  for (const char* c : choices) {
    if (std::string_view(v) == c) return std::string(v);
    if (i > 0) listed += i + 1 == choices.size() ? " or " : ", ";
    listed += c;
    ++i;
  }
  MOECORE_FAIL("environment variable ", name, "='", v, "' is not ", listed, " (", meaning, "); hint: fix or unset it");
}

}  // namespace moecore
