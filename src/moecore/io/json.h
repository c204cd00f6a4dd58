// The one way moecore parses JSON from a file or the command line (tokenizer.json, config.json, safetensors
// headers, checkpoint manifests, state.json, moe-layer cases, JSONL documents): bounded nesting, so a hostile
// file cannot overflow the stack (nlohmann's DOM is built and destroyed recursively), and every failure is
// an Error naming what was parsed.
#pragma once
#include <nlohmann/json_fwd.hpp>
#include <string_view>

namespace moecore::io {

inline constexpr int kMaxJsonDepth = 128;  // arrays/objects inside each other; real files use < 16

// Parses `text` as one JSON value. Throws Error "<what>: not valid JSON: <reason>" on syntax errors, and
// "<what>: JSON nested deeper than 128 levels" before parsing when the brackets nest too deep.
nlohmann::json parse_json(std::string_view text, std::string_view what);

// The deepest nesting of [ and { in `text` outside strings (a syntax check is not made here).
int json_nesting_depth(std::string_view text);

}  // namespace moecore::io
