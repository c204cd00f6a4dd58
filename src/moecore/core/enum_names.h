// Enums that are read from and written as text (flags, checkpoint files, log lines): each enum has one table of
// {value, name}, found by argument-dependent lookup as `enum_names(E)` next to the enum, and one parser and printer
// over it here. The names are the spellings users and files see; the values are what the code compares.
// Not here: the enums themselves (each lives with the config that holds it).
#pragma once
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/error.h"

namespace moecore {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

// The table of E (declared beside E: `constexpr std::span<const EnumName<E>> enum_names(E)`).
template <class E>
constexpr std::span<const EnumName<E>> enum_table() {
  return enum_names(E{});
}

// The spelling of v (a value missing from its table is a broken contract).
template <class E>
const char* enum_name(E v) {
  for (const EnumName<E>& n : enum_table<E>())
    if (n.value == v) return n.name;
  MOECORE_CHECK(false, "enum value ", static_cast<int>(v), " has no name in its table");
  return "";
}

// Every accepted spelling, in the table's order.
template <class E>
std::vector<std::string> enum_name_list() {
  std::vector<std::string> out;
  for (const EnumName<E>& n : enum_table<E>()) out.emplace_back(n.name);
  return out;
}

// "a, b, c".
template <class E>
std::string enum_choices() {
  std::string s;
  for (const EnumName<E>& n : enum_table<E>()) s += (s.empty() ? "" : ", ") + std::string(n.name);
  return s;
}

// The value spelled `text`; otherwise an Error naming `what` (the flag or file key), the text and the accepted
// names: "--nan-action 'halt' is not one of stop, skip".
template <class E>
E enum_parse(std::string_view text, std::string_view what) {
  for (const EnumName<E>& n : enum_table<E>())
    if (text == n.name) return n.value;
  MOECORE_FAIL(what, " '", text, "' is not one of ", enum_choices<E>());
}

}  // namespace moecore
