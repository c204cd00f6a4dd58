// A small command-line parser for Megatron-style flags (--name value, --flag). Each subcommand declares the flags
// it implements with help text and Megatron's default ("" = Megatron's None: unset). Every other Megatron flag is
// taken from the table of megatron_flags.h: accepted without effect (checked against Megatron's type and choices) or
// refused naming the flag and what is missing. Names Megatron does not have either are unknown flags, rejected with
// the nearest valid name as a suggestion when one is close.
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace YAML {
class Node;
}

namespace moecore::apps {

struct MegatronFlag;  // megatron_flags.h

// What a flag's value may be, checked at start-up (in parse and fill_unset) for the default and every given
// value, whether or not the run uses the flag: a bad number never waits for the code that reads it.
struct FlagDomain {
  enum class Kind : uint8_t { number, integer, number_list, choice };
  Kind kind = Kind::number;
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;              // (lo, ... instead of [lo, ...
  bool hi_open = false;              // ..., hi) instead of ..., hi]
  std::vector<std::string> choices;  // Kind::choice: the accepted words
  // Integers: [lo, hi]; the default upper bound keeps sizes within what one process can address.
  static FlagDomain integer(double lo, double hi = 2147483647.0) { return make(Kind::integer, lo, hi); }
  // Real numbers: the default upper bound is float's largest, as the configurations keep floats.
  static constexpr double kFloatMax = 3.4028234663852886e38;
  static FlagDomain number(double lo, double hi = kFloatMax) { return make(Kind::number, lo, hi); }
  static FlagDomain positive_number(double hi = kFloatMax) { return make(Kind::number, 0.0, hi, true); }
  static FlagDomain fraction() { return make(Kind::number, 0.0, 1.0, false, true); }  // [0, 1)
  // Numbers separated by ',' or '/' (or a YAML list), each in [lo, hi].
  static FlagDomain numbers(double lo, double hi = kFloatMax) { return make(Kind::number_list, lo, hi); }
  static FlagDomain one_of(std::vector<std::string> words) {
    FlagDomain d = make(Kind::choice, 0, 0);
    d.choices = std::move(words);
    return d;
  }
  static FlagDomain make(Kind k, double lo, double hi, bool lo_open = false, bool hi_open = false) {
    FlagDomain d;
    d.kind = k;
    d.lo = lo;
    d.hi = hi;
    d.lo_open = lo_open;
    d.hi_open = hi_open;
    return d;
  }
  std::string describe() const;  // "an integer in [1, 2147483647]", "one of a, b"
};

// Parses a whole string as a finite number / an integer without overflow; false otherwise.
bool parse_number(const std::string& s, double& out);
bool parse_integer(const std::string& s, int64_t& out);

class Args {
 public:
  explicit Args(std::string program) : program_(std::move(program)) {}
  // Declares a flag taking a value, with its default ("" = unset) and help text.
  Args& option(const std::string& name, const std::string& def, const std::string& help);
  // Declares a boolean switch.
  Args& flag(const std::string& name, const std::string& help);
  // Declares a flag taking one or more values (all words up to the next --flag), like Megatron's nargs='*'.
  Args& list_option(const std::string& name, const std::string& help);
  // The domain of a declared value flag (see FlagDomain). A value flag without a domain is free text (paths,
  // names, expressions with their own parser); tests/apps list those, so a numeric flag cannot miss one.
  Args& domain(const std::string& name, FlagDomain d);
  // Declares positional arguments' help line.
  Args& positional(const std::string& name, const std::string& help);
  // Parses argv[1..]; returns false when --help or --list-flags was asked (already printed). A --config FILE
  // (YAML or JSON mapping of flag names, with '-' or '_') fills every flag the command line does not give.
  // --list-flags prints one tab-separated line per flag, the command's own and then the rest of Megatron's table:
  // name, kind (switch | value | list | accepted-switch | accepted-value | accepted-list | refused-switch |
  // refused-value | refused-list | other-command), default, help (for a table flag: why), domain (empty for free
  // text and switches; Megatron's type and choices for a table flag). --list-flags=markdown prints
  // docs/megatron-flags.md: Megatron's whole table with each flag's fate here.
  bool parse(int argc, char** argv);
  // After parse: sets `name` (a declared flag) to `value` ("" for a switch: on) unless the command line or --config
  // gave it; `where` names the source in errors ("in --hf-config FILE").
  void fill_unset(const std::string& name, const std::string& value, const std::string& where);

  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double f64(const std::string& name) const;
  // The value, or `unset` when the flag is unset (Megatron's None).
  int64_t i64_or(const std::string& name, int64_t unset) const;
  double f64_or(const std::string& name, double unset) const;
  bool on(const std::string& name) const;
  // Declared flags and Megatron's accepted ones (validation rules read those: --deterministic-mode refuses
  // --cross-entropy-loss-fusion).
  bool given(const std::string& name) const;
  std::vector<std::string> list(const std::string& name) const;  // values of a list_option (may be empty)
  const std::vector<std::string>& positionals() const { return pos_values_; }
  std::string help() const;
  // Under mpirun: every rank checks that the others run the same command with the same effective values (every
  // flag, positionals, the comm environment); a mismatch fails on every rank naming the differing flags. parse()
  // calls it; call it again after fill_unset (--hf-config) fills flags from a file. Collective over the world.
  void check_same_on_every_rank() const;

 private:
  struct Spec {
    Spec() = default;
    Spec(std::string d, std::string h, bool flag, bool list = false)
        : def(std::move(d)), help(std::move(h)), is_flag(flag), is_list(list) {}
    std::string def, help;
    bool is_flag = false;
    bool is_list = false;
    std::optional<FlagDomain> domain;
    const MegatronFlag* megatron = nullptr;  // a flag of Megatron's table the command does not declare
  };
  void check_domain(const std::string& name, const std::string& value, const std::string& where) const;
  void check_domains() const;
  void check_table_values(const std::string& name, const std::string& where) const;
  bool declared(const std::string& name) const;
  std::string list_flags() const;
  std::string megatron_markdown() const;
  void merge_config(const std::string& path);
  void merge_config_entry(const std::string& path, const std::string& where, const std::string& key,
                          const YAML::Node& v);
  // The declared flag, or the table's row of a Megatron flag the command does not declare (added on first use),
  // or an Error: an unknown flag (with a suggestion) or a Megatron flag of another moecore command.
  const Spec& spec_or_suggest(const std::string& name, const char* where);
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
