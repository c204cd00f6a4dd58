// A small command-line parser for Megatron-style flags (--name value, --flag). Each subcommand declares
// its flags with help text; unknown flags are rejected with the nearest valid name as a suggestion.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moecore::apps {

class Args {
 public:
  explicit Args(std::string program) : program_(std::move(program)) {}
  // Declares a flag taking a value, with its default ("" = unset) and help text.
  Args& option(const std::string& name, const std::string& def, const std::string& help);
  // Declares a boolean switch.
  Args& flag(const std::string& name, const std::string& help);
  // Declares positional arguments' help line.
  Args& positional(const std::string& name, const std::string& help);
  // Parses argv[1..]; returns false when --help was asked (help already printed).
  bool parse(int argc, char** argv);

  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double f64(const std::string& name) const;
  bool on(const std::string& name) const;
  bool given(const std::string& name) const;
  const std::vector<std::string>& positionals() const { return pos_values_; }
  std::string help() const;

 private:
  struct Spec {
    std::string def, help;
    bool is_flag;
  };
  std::string program_;
  std::map<std::string, Spec> specs_;
  std::vector<std::string> order_;
  std::vector<std::pair<std::string, std::string>> pos_specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> pos_values_;
};

// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace moecore::apps
