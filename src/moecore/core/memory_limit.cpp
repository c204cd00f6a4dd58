// Reading the memory limits: /proc/self/cgroup names this process's cgroups, /proc/self/mountinfo where each
// hierarchy is mounted. Every file is optional: a missing or malformed one drops that limit, never fails.
#include "moecore/core/memory_limit.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "moecore/core/memory.h"

namespace moecore {
namespace {
namespace fs = std::filesystem;

// The file's first line as a non-negative integer; -1 when the file is missing or holds anything else ("max").
int64_t read_i64(const fs::path& p) {
  std::ifstream f(p);
  std::string line;
  if (!f || !std::getline(f, line)) return -1;
  std::string_view s = line;
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec != std::errc() || end != s.data() + s.size() || v < 0 ? -1 : v;
}

// "key value" lines (memory.stat) or "Key: value kB" lines (/proc/meminfo): the value of key, in bytes.
std::optional<int64_t> read_keyed(const fs::path& p, const std::string& key, int64_t unit) {
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string k;
    int64_t v = 0;
    if (in >> k >> v && (k == key || k == key + ":") && v >= 0 && v <= INT64_MAX / unit) return v * unit;
  }
  return std::nullopt;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) out.push_back(part);
  return out;
}

// One cgroup hierarchy this process belongs to: the folder of its cgroup and the mount point above which no
// ancestor is visible.
struct CgroupDir {
  fs::path dir, mount;
  std::string path;  // the cgroup's name in /proc/self/cgroup
};

std::optional<CgroupDir> find_cgroup(const std::string& root, bool v2) {
  std::string cg_path;
  bool in_hierarchy = false;
  std::ifstream cg(root + "/proc/self/cgroup");
  for (std::string line; std::getline(cg, line);) {  // "4:memory:/a/b" (v1), "0::/a/b" (v2)
    const size_t c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const auto names = split(controllers, ',');
    if (v2 ? line.substr(0, c1) == "0" && controllers.empty()
           : std::find(names.begin(), names.end(), "memory") != names.end()) {
      cg_path = line.substr(c2 + 1);
      in_hierarchy = true;
    }
  }
  if (!in_hierarchy) return std::nullopt;
  std::ifstream mi(root + "/proc/self/mountinfo");
  for (std::string line;
       std::getline(mi, line);) {  // "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory"
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    const auto pre = split(line.substr(0, dash), ' '), post = split(line.substr(dash + 3), ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    const auto opts = split(post[2], ',');
    if (v2 ? post[0] != "cgroup2" : post[0] != "cgroup" || std::find(opts.begin(), opts.end(), "memory") == opts.end())
      continue;
    const std::string& mount_root = pre[3];
    // The mount shows the hierarchy from mount_root down: a cgroup outside it (a cgroup namespace) is the mount.
    std::string rel = cg_path;
    if (mount_root != "/") rel = cg_path.starts_with(mount_root) ? cg_path.substr(mount_root.size()) : "";
    CgroupDir d{fs::path(root + pre[4]), fs::path(root + pre[4]), cg_path};
    if (!rel.empty() && rel != "/") d.dir = d.mount / fs::path(rel).relative_path();
    std::error_code ec;
    if (!fs::is_directory(d.dir, ec)) d.dir = d.mount;
    return d;
  }
  return std::nullopt;
}

// The tightest limit of the cgroup and its ancestors up to the mount.
std::optional<MemoryLimit> cgroup_limit(const std::string& root, bool v2) {
  const auto d = find_cgroup(root, v2);
  if (!d) return std::nullopt;
  const char* limit_file = v2 ? "memory.max" : "memory.limit_in_bytes";
  const char* usage_file = v2 ? "memory.current" : "memory.usage_in_bytes";
  std::optional<MemoryLimit> best;
  const fs::path mount = d->mount.lexically_normal();
  for (fs::path dir = d->dir.lexically_normal();; dir = dir.parent_path()) {
    const int64_t limit = read_i64(dir / limit_file), used = read_i64(dir / usage_file);
    if (limit >= 0 && limit < (int64_t{1} << 62) && used >= 0) {  // "max" reads as -1; v1's unlimited is 2^63 - 4096
      const int64_t reclaimable =
          read_keyed(dir / "memory.stat", v2 ? "inactive_file" : "total_inactive_file", 1).value_or(0);
      const int64_t held = std::max<int64_t>(0, used - reclaimable);
      const int64_t room = std::max<int64_t>(0, limit - held);
      if (!best || room < best->room) {
        const std::string rel = dir.string().substr(std::min(dir.string().size(), mount.string().size()));
        best = MemoryLimit{room, limit,
                           std::string("limit of the memory cgroup ") + (v2 ? "v2 " : "v1 ") +
                               (rel.empty() ? "/" : rel) + " (" + limit_file + ")"};
      }
    }
    if (dir == mount || dir == dir.parent_path() || dir.string().size() <= mount.string().size()) break;
  }
  return best;
}
}  // namespace

std::string MemoryLimit::describe() const {
  if (!known()) return "no memory limit could be read";
  return memory_format_bytes(room) + " free of the " + memory_format_bytes(limit) + " " + name;
}

MemoryLimit memory_limit(const std::string& root) {
  MemoryLimit best;
  auto take = [&](const std::optional<MemoryLimit>& l) {
    if (l && l->known() && (!best.known() || l->room < best.room)) best = *l;
  };
  const std::string meminfo = root + "/proc/meminfo";
  const auto available = read_keyed(meminfo, "MemAvailable", 1024), total = read_keyed(meminfo, "MemTotal", 1024);
  if (available && total && *total > 0)
    take(MemoryLimit{*available, *total, "of the machine (MemAvailable of /proc/meminfo)"});
  take(cgroup_limit(root, false));
  take(cgroup_limit(root, true));
  return best;
}

}  // namespace moecore
