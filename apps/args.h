// A small command-line parser for Megatron-style flags (--name value, --flag). Each subcommand declares
// its flags with help text and Megatron's default ("" = Megatron's None: unset); Megatron flags this version
// cannot honour are declared as unsupported, so a script that uses them fails naming the flag; unknown flags
// are rejected with the nearest valid name as a suggestion when one is close.
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
  // A Megatron switch accepted for compatibility that changes nothing here (fusions, implementation choices).
  Args& accepted(const std::string& name, const std::string& help);
  // Megatron flags this version cannot honour, refused by name when given; `what` says what is missing. A
  // value flag is accepted with the value `allowed` (Megatron's default; "" = Megatron's None: never).
  Args& unsupported_switch(const std::string& name, const std::string& what);
  Args& unsupported(const std::string& name, const std::string& allowed, const std::string& what);
  // Declares positional arguments' help line.
  Args& positional(const std::string& name, const std::string& help);
  // Parses argv[1..]; returns false when --help or --list-flags was asked (already printed). A --config FILE
  // (YAML or JSON mapping of flag names, with '-' or '_') fills every flag the command line does not give.
  // --list-flags prints one tab-separated line per flag: name, kind (switch | value | list |
  // unsupported-switch | unsupported-value), default, help.
  bool parse(int argc, char** argv);
  // After parse: sets `name` to `value` ("" for a switch: on) unless the command line or --config gave it;
  // `where` names the source in errors ("in --hf-config FILE"). Unsupported values are refused as on the
  // command line.
  void fill_unset(const std::string& name, const std::string& value, const std::string& where);

  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double f64(const std::string& name) const;
  // The value, or `unset` when the flag is unset (Megatron's None).
  int64_t i64_or(const std::string& name, int64_t unset) const;
  double f64_or(const std::string& name, double unset) const;
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
    bool unsupported = false;  // value flags: def is the one value allowed
  };
  void check_unsupported() const;
  std::string list_flags() const;
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
