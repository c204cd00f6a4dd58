// Megatron's per-layer patterns such as --moe-layer-freq: an integer N (layer i is on when i % N == 0) or a
// Python list expression that Megatron evaluates, e.g. "[0]*3+[1]*58" or "([1]*3+[0]*1)*3". Parsed here by
// a small grammar (no eval):
//   expr := term ('+' term)*      term := factor ('*' INT)* | INT '*' factor
//   factor := '[' INT (',' INT)* ']' | '(' expr ')'
// Entries must be 0 or 1 and the list must have exactly num_layers entries.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moecore::model {

// Throws Error naming `flag`, the expression, the position of a syntax error, or the two lengths.
std::vector<bool> parse_layer_pattern(const std::string& expr, int64_t num_layers, const char* flag);

}  // namespace moecore::model
