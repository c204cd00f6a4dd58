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
  // Declares a flag taking one or more values (all words up to the next --flag), like Megatron's nargs='*'.
  Args& list_option(const std::string& name, const std::string& help);
  // Declares positional arguments' help line.
  Args& positional(const std::string& name, const std::string& help);
  // Parses argv[1..]; returns false when --help was asked (help already printed). A --config FILE (YAML or
  // JSON mapping of flag names, with '-' or '_') fills every flag the command line does not give.
  bool parse(int argc, char** argv);

  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double f64(const std::string& name) const;
  bool on(const std::string& name) const;
  bool given(const std::string& name) const;
  std::vector<std::string> list(const std::string& name) const;  // values of a list_option (may be empty)
  const std::vector<std::string>& positionals() const { return pos_values_; }
  std::string help() const;

 private:
  struct Spec {
    std::string def, help;
    bool is_flag;
    bool is_list = false;
  };
  void merge_config(const std::string& path);
  const Spec& spec_or_suggest(const std::string& name, const char* where) const;
  std::string program_;
  std::map<std::string, Spec> specs_;
  std::vector<std::string> order_;
  std::vector<std::pair<std::string, std::string>> pos_specs_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> lists_;
  std::vector<std::string> pos_values_;
};

// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace moecore::apps
