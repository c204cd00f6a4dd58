#include "bench/bench_util.h"

#include <cmath>
#include <cstdio>

#include "moecore/kernels/cpu_isa.h"

namespace moecore::bench {

void JsonLine::key(const char* k) {
  if (body_.size() > 1) body_ += ",";
  body_ += "\"";
  body_ += k;
  body_ += "\":";
}

JsonLine& JsonLine::add(const char* k, const std::string& v) {
  key(k);
  body_ += "\"" + v + "\"";
  return *this;
}

JsonLine& JsonLine::add(const char* k, double v) {
  key(k);
  if (!std::isfinite(v)) {  // JSON has no inf or nan (a zero-length interval, a failed peak)
    body_ += "null";
    return *this;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  body_ += buf;
  return *this;
}

JsonLine& JsonLine::add(const char* k, int64_t v) {
  key(k);
  body_ += std::to_string(v);
  return *this;
}

JsonLine moe_line_head(const char* name, DType dtype, int64_t N, int64_t H, int64_t F, int64_t E, int64_t K) {
  JsonLine line;
  line.add("name", name)
      .add("dtype", std::string(dtype_name(dtype)))
      .add("N", N)
      .add("H", H)
      .add("F", F)
      .add("E", E)
      .add("K", K);
  return line;
}

JsonLine& add_bf16_gemm(JsonLine& line, DType dtype) {
  if (dtype != DType::bf16) return line;
  return line.add("bf16_gemm", std::string(ops::bf16_gemm_name(ops::cpu_bf16_gemm())))
      .add("bf16_dot_flop_ratio", ops::cpu_bf16_dot_flop_ratio());
}

}  // namespace moecore::bench
