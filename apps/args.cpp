#include "apps/args.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <yaml-cpp/yaml.h>

#include "apps/megatron_flags.h"
#include "moecore/core/error.h"
#include "moecore/io/input_file.h"
#include "moecore/parallel/comm.h"

namespace moecore::apps {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

bool parse_number(const std::string& s, double& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(s.c_str(), &end);
  if (*end || errno == ERANGE || !std::isfinite(x)) return false;  // also nan, inf and 1e999
  out = x;
  return true;
}

bool parse_integer(const std::string& s, int64_t& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (*end || errno == ERANGE) return false;  // strtoll saturates at 2^63-1 silently otherwise
  out = x;
  return true;
}

namespace {
std::string fmt_bound(double v) {
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}

std::vector<std::string> split_numbers(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char ch : s + ",") {
    if (ch == ',' || ch == '/') {
      out.push_back(cur);
      cur.clear();
    } else if (ch != ' ' && ch != '[' && ch != ']') {
      cur.push_back(ch);
    }
  }
  return out;
}
}  // namespace

std::string FlagDomain::describe() const {
  if (kind == Kind::choice) {
    std::string s = "one of ";
    for (size_t i = 0; i < choices.size(); ++i) s += (i ? ", " : "") + choices[i];
    return s;
  }
  const std::string range = (lo_open ? "(" : "[") + fmt_bound(lo) + ", " + fmt_bound(hi) + (hi_open ? ")" : "]");
  if (kind == Kind::integer) return "an integer in " + range;
  if (kind == Kind::number_list) return "numbers separated by ',' each in " + range;
  return "a number in " + range;
}

Args& Args::option(const std::string& name, const std::string& def, const std::string& help) {
  specs_[name] = {def, help, false};
  order_.push_back(name);
  return *this;
}

Args& Args::flag(const std::string& name, const std::string& help) {
  specs_[name] = {"", help, true};
  order_.push_back(name);
  return *this;
}

Args& Args::list_option(const std::string& name, const std::string& help) {
  specs_[name] = {"", help, false, true};
  order_.push_back(name);
  return *this;
}

Args& Args::domain(const std::string& name, FlagDomain d) {
  auto it = specs_.find(name);
  MOECORE_CHECK(it != specs_.end() && !it->second.is_flag && !it->second.is_list, "domain for ", name,
                ", which is not a declared value flag");
  it->second.domain = std::move(d);
  return *this;
}

// "" is Megatron's None (unset) and always allowed: the code reading the flag decides what unset means.
void Args::check_domain(const std::string& name, const std::string& value, const std::string& where) const {
  const Spec& sp = specs_.at(name);
  if (!sp.domain || value.empty()) return;
  const FlagDomain& d = *sp.domain;
  const auto fail = [&] { MOECORE_FAIL("flag '", name, "'", where, ": '", value, "' is not ", d.describe()); };
  if (d.kind == FlagDomain::Kind::choice) {
    if (std::find(d.choices.begin(), d.choices.end(), value) == d.choices.end()) fail();
    return;
  }
  const auto in_range = [&](double x) {
    return (d.lo_open ? x > d.lo : x >= d.lo) && (d.hi_open ? x < d.hi : x <= d.hi);
  };
  if (d.kind == FlagDomain::Kind::integer) {
    int64_t x = 0;
    if (!parse_integer(value, x) || !in_range(static_cast<double>(x))) fail();
    return;
  }
  const std::vector<std::string> parts =
      d.kind == FlagDomain::Kind::number_list ? split_numbers(value) : std::vector<std::string>{value};
  for (const auto& p : parts) {
    double x = 0;
    if (!parse_number(p, x) || !in_range(x)) fail();
  }
}

void Args::check_domains() const {
  for (const auto& n : order_) {
    const Spec& sp = specs_.at(n);
    if (!sp.domain) continue;
    auto it = values_.find(n);
    check_domain(n, it != values_.end() ? it->second : sp.def, it != values_.end() ? "" : " (its default)");
  }
}

Args& Args::positional(const std::string& name, const std::string& help) {
  pos_specs_.emplace_back(name, help);
  return *this;
}

std::string Args::help() const {
  std::string s = "usage: moecore " + program_;
  for (const auto& [n, h] : pos_specs_) s += " <" + n + ">";
  s += " [options]\n";
  for (const auto& [n, h] : pos_specs_) s += "  <" + n + ">\n      " + h + "\n";
  for (const auto& n : order_) {
    const Spec& sp = specs_.at(n);
    s += "  " + n + (sp.is_flag ? "" : sp.is_list ? " VALUE..." : " VALUE") + "\n      " + sp.help;
    if (!sp.is_flag && !sp.def.empty()) s += " (default: " + sp.def + ")";
    s += "\n";
  }
  std::string accepted;
  int refused = 0;
  for (const MegatronFlag& f : megatron_flags()) {
    if (declared(f.name)) continue;
    if (f.fate == MegatronFate::accepted) accepted += "  " + std::string(f.name) + "\n      " + f.why + "\n";
    refused += f.fate == MegatronFate::refused;
  }
  s += "Megatron flags accepted without effect here (checked against Megatron's choices):\n" + accepted;
  s += std::to_string(refused) + " other Megatron flags are refused by name, saying what is missing (moecore " +
       program_ + " --list-flags, docs/megatron-flags.md)\n";
  return s;
}

const Args::Spec& Args::spec_or_suggest(const std::string& a, const char* where) {
  auto it = specs_.find(a);
  if (it != specs_.end()) return it->second;
  if (const MegatronFlag* m = megatron_flag(a)) {
    if (m->fate == MegatronFate::implemented)
      MOECORE_FAIL("flag '", a, "'", where, " is a Megatron flag that moecore ", program_,
                   " does not take (moecore train does; see moecore ", program_, " --help)");
    Spec sp(m->def, m->why, m->arity == MegatronArity::switch_, m->arity == MegatronArity::list);
    sp.megatron = m;
    return specs_.emplace(a, std::move(sp)).first->second;
  }
  std::string best;
  size_t best_d = ~size_t{0};
  for (const auto& [n, sp] : specs_) {
    const size_t d = edit_distance(a, n);
    if (d < best_d) best_d = d, best = n;
  }
  // Only a near miss (a typo) earns a suggestion; a far one would mislead.
  const bool close = !best.empty() && best_d <= std::max<size_t>(2, a.size() / 5);
  MOECORE_FAIL("unknown flag '", a, "'", where, close ? "; did you mean '" + best + "'?" : "", " (see moecore ",
               program_, " --help)");
}

bool Args::parse(int argc, char** argv) {
  std::string config;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a == "--list-flags" || a == "--list-flags=markdown") {
      std::fputs((a == "--list-flags" ? list_flags() : megatron_markdown()).c_str(), stdout);
      return false;
    }
    if (a.rfind("--", 0) != 0) {
      pos_values_.push_back(a);
      continue;
    }
    std::string value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    if (a == "--config" && !specs_.count("--config")) {  // a command may declare its own --config
      if (eq == std::string::npos) {
        if (i + 1 >= argc) MOECORE_FAIL("flag '--config' needs a file");
        value = argv[++i];
      }
      config = value;
      continue;
    }
    const Spec& sp = spec_or_suggest(a, "");
    if (sp.is_flag) {
      if (eq != std::string::npos) MOECORE_FAIL("flag '", a, "' takes no value");
      values_[a] = "1";
      continue;
    }
    if (sp.is_list) {
      auto& vals = lists_[a];
      vals.clear();
      if (eq != std::string::npos) vals.push_back(value);
      while (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) vals.push_back(argv[++i]);
      if (vals.empty()) MOECORE_FAIL("flag '", a, "' needs at least one value");
      values_[a] = "1";
      continue;
    }
    if (eq == std::string::npos) {
      if (i + 1 >= argc) MOECORE_FAIL("flag '", a, "' needs a value");
      value = argv[++i];
    }
    values_[a] = value;
  }
  if (pos_values_.size() > pos_specs_.size())
    MOECORE_FAIL("unexpected argument '", pos_values_[pos_specs_.size()], "' (see moecore ", program_, " --help)");
  // Every refused or ill-valued Megatron flag at once (a Megatron config often carries several: FSDP's come together).
  std::string refused;
  for (const auto& [name, v] : values_) {
    if (!specs_.at(name).megatron) continue;
    try {
      check_table_values(name, "");
    } catch (const Error& e) {
      refused += (refused.empty() ? "" : "\n") + std::string(e.what());
    }
  }
  if (!refused.empty()) MOECORE_FAIL(refused);
  if (!config.empty()) merge_config(config);  // (checks its table flags itself, naming the file)
  check_domains();
  check_same_on_every_rank();
  return true;
}

void Args::check_same_on_every_rank() const {
  if (!comm_initialized()) return;
  const ProcessGroup world = comm_world();
  if (world.size() == 1) return;
  std::vector<std::pair<std::string, std::string>> fields;
  fields.emplace_back("command", program_);
  for (size_t i = 0; i < pos_values_.size(); ++i)
    fields.emplace_back("argument " + std::to_string(i + 1), pos_values_[i]);
  std::vector<std::string> names = order_;
  for (const auto& [n, sp] : specs_)
    if (sp.megatron) names.push_back(n);  // Megatron's accepted flags, given here
  for (const auto& n : names) {
    const Spec& sp = specs_.at(n);
    std::string v;
    if (sp.is_list) {
      for (const auto& x : list(n)) v += (v.empty() ? "" : " ") + x;
    } else if (sp.is_flag) {
      v = on(n) ? "on" : "off";
    } else {
      v = str(n);
    }
    fields.emplace_back(n, v);
  }
  const CommOptions& o = comm_options();
  fields.emplace_back("MOECORE_COMM_DEBUG", o.debug ? "1" : "0");
  fields.emplace_back("MOECORE_COMM_TIMEOUT_S", std::to_string(o.timeout_s));
  fields.emplace_back("MOECORE_COMM_PROGRESS_THREAD", o.progress_thread ? "1" : "0");
  check_same_config(fields, world);
}

// A Megatron flag of the table that the command does not declare: its values against Megatron's type and choices,
// then, if it is refused, the refusal (a value flag at Megatron's own default asks for nothing and passes).
void Args::check_table_values(const std::string& name, const std::string& where) const {
  const Spec& sp = specs_.at(name);
  const MegatronFlag& m = *sp.megatron;
  const std::vector<std::string> vals = sp.is_list ? list(name) : std::vector<std::string>{str(name)};
  if (!sp.is_flag)
    for (const std::string& v : vals) megatron_check_value(m, v);
  if (m.fate != MegatronFate::refused) return;
  if (sp.is_flag) MOECORE_FAIL(name, where, " is ", m.why);
  std::string joined;
  for (const std::string& v : vals) joined += " " + v;
  if (sp.is_list || !megatron_is_default(m, vals[0])) MOECORE_FAIL(name, joined, where, " is ", m.why);
}

namespace {
const char* arity_name(MegatronArity a) {
  return a == MegatronArity::switch_ ? "switch" : a == MegatronArity::list ? "list" : "value";
}
std::string table_domain(const MegatronFlag& f) {
  if (*f.choices) return std::string("one of ") + f.choices;
  return f.type;
}
}  // namespace

// Declared by the command (--help by every command).
bool Args::declared(const std::string& name) const {
  const auto it = specs_.find(name);
  return name == "--help" || (it != specs_.end() && !it->second.megatron);
}

std::string Args::list_flags() const {
  std::string s;
  for (const auto& n : order_) {
    const Spec& sp = specs_.at(n);
    const char* kind = sp.is_flag ? "switch" : sp.is_list ? "list" : "value";
    s += n + "\t" + kind + "\t" + sp.def + "\t" + sp.help + "\t" + (sp.domain ? sp.domain->describe() : "") + "\n";
  }
  for (const MegatronFlag& f : megatron_flags()) {
    if (declared(f.name)) continue;
    const std::string kind =
        f.fate == MegatronFate::implemented
            ? std::string("other-command")
            : (f.fate == MegatronFate::accepted ? "accepted-" : "refused-") + std::string(arity_name(f.arity));
    s += std::string(f.name) + "\t" + kind + "\t" + f.def + "\t" + f.why + "\t" + table_domain(f) + "\n";
  }
  return s;
}

// docs/megatron-flags.md, generated: every Megatron flag with its fate in this command.
std::string Args::megatron_markdown() const {
  std::string s = "# Megatron's flags in `moecore " + program_ + "`\n\n";
  s += "Generated by `moecore " + program_ +
       " --list-flags=markdown` from the table in `apps/megatron_flags.cpp` (do "
       "not edit by hand). Every flag of Megatron-LM's training argument parser at commit " +
       std::string(kMegatronFlagsCommit) +
       " has one fate: **implemented** (Megatron's semantics and default; the description is moecore's `--help`), "
       "**accepted** (checked against Megatron's type and choices, changes nothing here, for the reason given) or "
       "**refused** (the run stops naming the flag and what to use instead; a value flag given Megatron's own "
       "default passes). Names Megatron does not have are unknown flags.\n\n";
  int counts[3] = {0, 0, 0};
  for (const MegatronFlag& f : megatron_flags()) ++counts[static_cast<int>(f.fate)];
  s += "| fate | flags |\n|---|---|\n| implemented | " + std::to_string(counts[0]) + " |\n| accepted | " +
       std::to_string(counts[1]) + " |\n| refused | " + std::to_string(counts[2]) + " |\n\n";
  s += "| flag | kind | Megatron default | fate | what it does here |\n|---|---|---|---|---|\n";
  const auto cell = [](std::string t) {
    std::string out;
    for (const char ch : t) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
    return out;
  };
  for (const MegatronFlag& f : megatron_flags()) {
    const auto it = specs_.find(f.name);
    const bool ours = declared(f.name);
    const char* fate = f.fate == MegatronFate::implemented ? "implemented"
                       : f.fate == MegatronFate::accepted  ? "accepted"
                                                           : "refused";
    std::string what = it != specs_.end() && ours ? it->second.help : ours ? "this help" : f.why;
    if (f.fate == MegatronFate::implemented && !ours) what = "(another moecore command)";
    std::string kind = arity_name(f.arity);
    if (*f.choices)
      kind += ": " + std::string(f.choices);
    else if (*f.type && f.arity != MegatronArity::switch_)
      kind += " (" + std::string(f.type) + ")";
    s += "| `" + std::string(f.name) + "` | " + cell(kind) + " | " + cell(f.def) + " | " + fate + " | " + cell(what) +
         " |\n";
  }
  return s;
}

// Command-line flags win: a config entry only fills flags the command line left unset.
void Args::merge_config(const std::string& path) {
  YAML::Node root;
  io::require_regular_file(path, "--config");  // a FIFO would block the read
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    MOECORE_FAIL("--config ", path, ": cannot parse as YAML/JSON: ", e.what());
  }
  if (!root.IsMap()) MOECORE_FAIL("--config ", path, ": the top level must be a mapping of flag names to values");
  const std::string where = " in --config " + path;
  for (const auto& kv : root) {
    std::string key;
    try {
      key = kv.first.as<std::string>();
      merge_config_entry(path, where, key, kv.second);
    } catch (const YAML::Exception& e) {
      MOECORE_FAIL("--config ", path, ": entry '", key, "': ", e.what(),
                   " (values are scalars, or lists of scalars for list flags)");
    }
  }
}

void Args::merge_config_entry(const std::string& path, const std::string& where, const std::string& key,
                              const YAML::Node& v) {
  std::string name = key;
  for (char& ch : name)
    if (ch == '_') ch = '-';
  if (name.rfind("--", 0) != 0) name = "--" + name;
  const Spec& sp = spec_or_suggest(name, where.c_str());
  if (values_.count(name)) return;
  if (sp.is_flag) {
    if (!v.IsScalar()) MOECORE_FAIL("--config ", path, ": ", name, " must be true or false");
    if (v.as<bool>()) values_[name] = "1";
  } else if (sp.is_list) {
    auto& vals = lists_[name];
    if (v.IsSequence())
      for (const auto& e : v) vals.push_back(e.as<std::string>());
    else
      vals.push_back(v.as<std::string>());
    values_[name] = "1";
  } else if (v.IsSequence()) {
    std::string joined;
    for (const auto& e : v) joined += (joined.empty() ? "" : ",") + e.as<std::string>();
    values_[name] = joined;
  } else {
    values_[name] = v.as<std::string>();
  }
  if (sp.megatron && values_.count(name)) check_table_values(name, where);
}

void Args::fill_unset(const std::string& name, const std::string& value, const std::string& where) {
  const Spec& sp = spec_or_suggest(name, where.c_str());
  if (values_.count(name)) return;
  if (sp.is_list) lists_[name] = {value};
  values_[name] = sp.is_flag || sp.is_list ? "1" : value;
  if (sp.megatron) check_table_values(name, where);
  check_domain(name, values_[name], where);
}

std::vector<std::string> Args::list(const std::string& name) const {
  auto it = lists_.find(name);
  return it == lists_.end() ? std::vector<std::string>{} : it->second;
}

bool Args::given(const std::string& name) const {
  return values_.count(name) > 0;
}

std::string Args::str(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) return it->second;
  auto sp = specs_.find(name);
  MOECORE_CHECK(sp != specs_.end(), "flag ", name, " was not declared");
  return sp->second.def;
}

int64_t Args::i64(const std::string& name) const {
  const std::string v = str(name);
  int64_t x = 0;
  if (!parse_integer(v, x)) MOECORE_FAIL("flag '", name, "' expects an integer (-2^63 .. 2^63-1), got '", v, "'");
  return x;
}

double Args::f64(const std::string& name) const {
  const std::string v = str(name);
  double x = 0;
  if (!parse_number(v, x)) MOECORE_FAIL("flag '", name, "' expects a finite number, got '", v, "'");
  return x;
}

bool Args::on(const std::string& name) const {
  return given(name);
}

int64_t Args::i64_or(const std::string& name, int64_t unset) const {
  return str(name).empty() ? unset : i64(name);
}

double Args::f64_or(const std::string& name, double unset) const {
  return str(name).empty() ? unset : f64(name);
}

}  // namespace moecore::apps
