// check_same_config (comm.h): the start-up handshake that proves every rank runs the same configuration.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/comm.h"

namespace moecore {
namespace {

int64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (const unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

std::string quoted(std::string v) {
  constexpr size_t kShown = 80;
  if (v.size() > kShown) v = v.substr(0, kShown) + "...";
  return "'" + v + "'";
}

}  // namespace

void check_same_config(const std::vector<std::pair<std::string, std::string>>& fields, const ProcessGroup& g) {
  if (g.size() == 1) return;
  const auto P = static_cast<size_t>(g.size());
  // Round 1: one hash of everything, the field count and a hash of the names.
  std::vector<int64_t> field_hash(fields.size());
  std::string names;
  int64_t total = static_cast<int64_t>(fields.size());
  for (size_t i = 0; i < fields.size(); ++i) {
    field_hash[i] = fnv1a(fields[i].first + '\n' + fields[i].second);
    total = fnv1a(std::to_string(field_hash[i]), static_cast<uint64_t>(total));
    names += fields[i].first + '\n';
  }
  const int64_t mine[3] = {total, static_cast<int64_t>(fields.size()), fnv1a(names)};
  std::vector<int64_t> all(3 * P);
  all_gather(std::span<int64_t>(all), std::span<const int64_t>(mine, 3), g);
  bool same = true, same_names = true;
  for (size_t r = 0; r < P; ++r) {
    same = same && all[3 * r] == total;
    same_names = same_names && all[3 * r + 1] == mine[1] && all[3 * r + 2] == mine[2];
  }
  if (same) return;
  if (!same_names)
    MOECORE_FAIL("ranks disagree on the configuration: their commands declare different flags (", g.name(), " rank ",
                 g.rank(), " has ", fields.size(), "): every rank must run the same moecore binary and subcommand");
  // Round 2: the per-field hashes name the differing fields (the same list on every rank).
  std::vector<int64_t> hashes(fields.size() * P);
  all_gather(std::span<int64_t>(hashes), std::span<const int64_t>(field_hash), g);
  std::vector<size_t> differ;
  for (size_t i = 0; i < fields.size(); ++i)
    for (size_t r = 1; r < P; ++r)
      if (hashes[r * fields.size() + i] != hashes[i]) {
        differ.push_back(i);
        break;
      }
  // Round 3: the differing fields' values, as bytes, from every rank (the first few fields only).
  constexpr size_t kShownFields = 8;
  if (differ.size() > kShownFields) differ.resize(kShownFields);
  std::vector<int32_t> bytes;
  for (const size_t i : differ) {
    for (const unsigned char c : fields[i].second) bytes.push_back(c);
    bytes.push_back(0);
  }
  const int64_t n = static_cast<int64_t>(bytes.size());
  std::vector<int64_t> counts(P);
  all_gather(std::span<int64_t>(counts), std::span<const int64_t>(&n, 1), g);
  int64_t sum = 0;
  for (const int64_t c : counts) sum += c;
  std::vector<int32_t> gathered(static_cast<size_t>(sum));
  all_gather_v(std::span<int32_t>(gathered), std::span<const int32_t>(bytes), std::span<const int64_t>(counts), g);
  std::vector<std::vector<std::string>> values(P);  // [rank][differing field]
  size_t at = 0;
  for (size_t r = 0; r < P; ++r) {
    std::string cur;
    for (int64_t k = 0; k < counts[r]; ++k, ++at) {
      if (gathered[at] == 0) {
        values[r].push_back(cur);
        cur.clear();
      } else {
        cur.push_back(static_cast<char>(gathered[at]));
      }
    }
  }
  std::string msg;
  for (size_t d = 0; d < differ.size(); ++d) {
    msg += "\n  " + fields[differ[d]].first + ":";
    for (size_t r = 0; r < P; ++r)
      msg += (r ? ", rank " : " rank ") + std::to_string(r) + " " +
             (d < values[r].size() ? quoted(values[r][d]) : std::string("?"));
  }
  MOECORE_FAIL("ranks disagree on the configuration (every rank of group ", g.name(),
               " must run the same command, flags and environment; seen on rank ", g.rank(), "):", msg);
}

}  // namespace moecore
