// Every flag of Megatron-LM's training argument parser (megatron/training/arguments.py at commit d98e8a64, 877
// names) with its fate in moecore, in one table (megatron_flags.cpp) that the argument parser (args.h), --help,
// --list-flags, --config and docs/megatron-flags.md all read:
//   implemented  a command declares the flag with Megatron's semantics and default (its help says what it does);
//   accepted     the flag is taken and checked against Megatron's type and choices, and changes nothing here, for the
//                reason given (a fusion, a kernel or I/O-strategy choice, Python's garbage collector, ...);
//   refused      given, the command stops naming the flag, what is missing and what to use instead. A value flag given
//                Megatron's own default is taken (it asks for nothing moecore lacks: scripts say --num-workers 2).
// "unknown flag" is left for names Megatron does not have either. Megatron's negated spellings are names of their own
// there (--no-rope-fusion, --disable-bias-linear; a positive --rope-fusion does not exist) and here.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace moecore::apps {

enum class MegatronArity : uint8_t { switch_, value, list };  // store_true/false | one value | nargs '+' / '*'
enum class MegatronFate : uint8_t { implemented, accepted, refused };

struct MegatronFlag {
  const char* name;
  MegatronArity arity;
  const char* type;     // Megatron's argparse type of a value: "int", "float" or "str" ("" for switches)
  const char* def;      // Megatron's default as Python writes it: None, True, 'adam', 0.01
  const char* choices;  // Megatron's choices, '|'-separated ("" = any value of the type)
  MegatronFate fate;
  const char* why;  // accepted: why it changes nothing here; refused: what is missing, and what to use instead
};

// The whole table, sorted by name.
std::span<const MegatronFlag> megatron_flags();
// The row of `name`, or nullptr when Megatron has no such flag.
const MegatronFlag* megatron_flag(std::string_view name);
// The Megatron commit the table was taken from.
inline constexpr const char* kMegatronFlagsCommit = "d98e8a64";

// Checks one value of `flag` against Megatron's type and choices; throws Megatron's (argparse's) error:
// "argument --ckpt-format: invalid choice: 'x' (choose from 'torch', 'torch_dist', ...)".
void megatron_check_value(const MegatronFlag& flag, const std::string& value);
// Whether `value` is Megatron's default of the flag (None never is; 'adam' is adam; 1.0 is 1).
bool megatron_is_default(const MegatronFlag& flag, const std::string& value);

}  // namespace moecore::apps
