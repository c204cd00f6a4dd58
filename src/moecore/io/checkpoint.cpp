// Checkpoint directories: staging, fsync ordering, the COMMIT manifest, the tracker, retention and
// verified loading. The protocol and its crash guarantees are documented in checkpoint.h; this file
// keeps to that order (data durable -> rename -> COMMIT -> tracker -> deletes) and says why where needed.
#include "moecore/io/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/io/crc32c.h"
#include "moecore/io/file_util.h"
#include "moecore/io/json.h"

namespace moecore::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormatMagic = "moecore-checkpoint";

using FileEntry = CheckpointFileInfo;
using Manifest = CheckpointManifest;

[[noreturn]] void sys_fail(const std::string& what, const std::string& path) {
  MOECORE_FAIL("checkpoint: ", what, " '", path, "': ", std::strerror(errno),
               " (check free space and permissions of the checkpoint directory)");
}

void warn(const std::string& msg) {
  std::cerr << "moecore: warning: checkpoint: " << msg << "\n";
}

// An Error's message without its "checkpoint: " prefix, for embedding in a warning.
std::string reason_of(const Error& e) {
  const std::string m = e.what();
  return m.rfind("checkpoint: ", 0) == 0 ? m.substr(12) : m;
}

std::string hex8(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

std::string iter_name(int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(iteration));
  return buf;
}

// Only the exact names we write (iter_%07d) count, so staging dirs and look-alikes are never picked up.
std::optional<int64_t> parse_iter_name(const std::string& name) {
  if (name.size() < 12 || name.size() > 24 || name.compare(0, 5, "iter_") != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    if (v > (INT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  if (iter_name(v) != name) return std::nullopt;
  return v;
}

bool is_staging_name(const std::string& name) {
  const size_t dot = name.find('.');
  if (dot == std::string::npos || !parse_iter_name(name.substr(0, dot))) return false;
  const std::string rest = name.substr(dot);
  return rest.rfind(".tmp-", 0) == 0 || rest.rfind(".old-", 0) == 0;
}

bool is_plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

void check_file_name(const std::string& name) {
  if (!is_plain_name(name))
    MOECORE_FAIL("checkpoint: file name '", name, "' is not a plain file name (no '/', not empty, not . or ..)");
  if (name == kCheckpointCommitFile || name == kCheckpointStateFile)
    MOECORE_FAIL("checkpoint: file name '", name, "' is reserved; choose another name for these tensors");
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) sys_fail("cannot open directory", dir);
  // Some filesystems cannot fsync directories (EINVAL); their renames are then as durable as they get.
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const int e = errno;
    ::close(fd);
    errno = e;
    sys_fail("cannot fsync directory", dir);
  }
  ::close(fd);
}

void write_fsync(const std::string& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) sys_fail("cannot create", path);
  uint64_t at = 0;
  if (const int e = write_all(fd, bytes, fs::path(path).filename().string(), at); e != 0) {
    ::close(fd);
    errno = e;
    sys_fail("cannot write byte " + std::to_string(at) + " of " + std::to_string(bytes.size()) + " to", path);
  }
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    sys_fail("cannot fsync", path);
  }
  if (::close(fd) != 0) sys_fail("cannot close", path);
}

// Data files go to the disk by direct I/O where the filesystem takes it: a buffered write's copy into the page cache
// and its writeback cost about 2.5 s of CPU per GB on this project's virtual disks (0.08 s direct), CPU that an
// asynchronous save's writer takes from training, and direct writes are faster too. Bytes at a page-aligned address
// (io/checkpoint_worker.h HostBuffer) are written from where they are, others through an aligned bounce buffer; the
// last block is padded and the file cut back to its size. Returns false, having written nothing,
// where direct I/O is refused (tmpfs: EINVAL) or a write fault is injected for this file (the hook stops at any byte,
// which direct writes of whole blocks cannot): write_fsync then writes it.
bool write_fsync_direct(const std::string& path, std::string_view bytes) {
  constexpr size_t kAlign = 4096, kChunk = size_t{8} << 20;
  const std::string name = fs::path(path).filename().string();
  if (const auto& f = write_fault_injected(); f && (f->name == "*" || f->name == name)) return false;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  if (fd < 0 && errno == EINVAL) return false;
  if (fd < 0) sys_fail("cannot create", path);
  std::unique_ptr<char, decltype(&std::free)> buf(nullptr, &std::free);  // the bounce buffer, when one is needed
  auto fail = [&](int e, const std::string& what) {
    ::close(fd);
    errno = e;
    sys_fail(what, path);
  };
  for (size_t off = 0; off < bytes.size(); off += kChunk) {
    const size_t n = std::min(kChunk, bytes.size() - off), padded = (n + kAlign - 1) / kAlign * kAlign;
    const char* from = bytes.data() + off;
    if (reinterpret_cast<uintptr_t>(from) % kAlign != 0 || n != padded) {  // else written from where it is
      if (!buf) buf.reset(static_cast<char*>(std::aligned_alloc(kAlign, kChunk)));
      if (!buf) fail(ENOMEM, "cannot allocate the write buffer for");
      std::memcpy(buf.get(), from, n);
      std::memset(buf.get() + n, 0, padded - n);
      from = buf.get();
    }
    ssize_t w;
    do {
      w = ::pwrite(fd, from, padded, static_cast<off_t>(off));
    } while (w < 0 && errno == EINTR);
    if (w < 0 && errno == EINVAL && off == 0) {  // a filesystem that takes O_DIRECT at open only
      ::close(fd);
      return false;
    }
    // A short write of a regular file means no room for the rest (a retry would be unaligned).
    if (w < 0 || static_cast<size_t>(w) < padded)
      fail(w < 0 ? errno : ENOSPC, "cannot write byte " + std::to_string(off + (w < 0 ? 0 : static_cast<size_t>(w))) +
                                       " of " + std::to_string(bytes.size()) + " to");
  }
  if (bytes.size() % kAlign != 0 && ::ftruncate(fd, static_cast<off_t>(bytes.size())) != 0)
    fail(errno, "cannot set the size of");
  if (::fsync(fd) != 0) fail(errno, "cannot fsync");
  if (::close(fd) != 0) sys_fail("cannot close", path);
  return true;
}

// Streams the file so multi-GB shards are checksummed without holding them in memory.
FileEntry file_entry_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) sys_fail("cannot open", path);
  std::vector<char> buf(size_t{4} << 20);
  FileEntry e;
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<size_t>(f.gcount());
    e.crc32c = crc32c_extend(e.crc32c, buf.data(), got);
    e.bytes += got;
  }
  if (f.bad()) sys_fail("cannot read", path);
  return e;
}

std::string manifest_json(const Manifest& m) {
  nlohmann::ordered_json j;
  j["format"] = kFormatMagic;
  j["version"] = kCheckpointFormatVersion;
  j["iteration"] = m.iteration;
  j["files"] = nlohmann::ordered_json::object();
  for (const auto& [name, e] : m.files) j["files"][name] = {{"bytes", e.bytes}, {"crc32c", hex8(e.crc32c)}};
  return j.dump(1) + "\n";
}

Manifest parse_manifest(std::string_view text, const std::string& path, std::optional<int64_t> expect_iteration) {
  auto bad = [&](const std::string& why) -> Manifest {
    MOECORE_FAIL("checkpoint: '", path, "' is not a valid COMMIT marker: ", why);
  };
  json j;
  try {
    j = parse_json(text, path);
  } catch (const Error& e) {
    return bad(std::string("a damaged marker (") + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("format") || !j["format"].is_string())
    return bad("bad magic: no \"format\" string");
  if (j["format"] != kFormatMagic)
    return bad("bad magic '" + j["format"].get<std::string>().substr(0, 64) + "' (expected '" + kFormatMagic + "')");
  if (!j.contains("version") || !j["version"].is_number_integer()) return bad("no integer \"version\"");
  if (!j["version"].is_number_unsigned() || j["version"].get<uint64_t>() != kCheckpointFormatVersion)
    return bad("unsupported version " + j["version"].dump() + " (this build reads version " +
               std::to_string(kCheckpointFormatVersion) + "); use a matching moecore build");
  const json& jit = j["iteration"];
  if (!jit.is_number_unsigned() || jit.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    return bad("no \"iteration\" that is an integer >= 0");
  Manifest m;
  m.iteration = static_cast<int64_t>(jit.get<uint64_t>());
  if (expect_iteration && *expect_iteration != m.iteration)
    return bad("it records iteration " + std::to_string(m.iteration) + " but the directory is named for " +
               std::to_string(*expect_iteration));
  if (!j.contains("files") || !j["files"].is_object()) return bad("no \"files\" object");
  for (const auto& [name, e] : j["files"].items()) {
    const std::string shown = name.substr(0, 128);
    if (!is_plain_name(name) || name == kCheckpointCommitFile) return bad("file name '" + shown + "' is not allowed");
    if (!e.is_object() || !e.contains("bytes") || !e["bytes"].is_number_unsigned() || !e.contains("crc32c") ||
        !e["crc32c"].is_string())
      return bad("entry for '" + shown + "' lacks \"bytes\" or \"crc32c\"");
    const std::string crc = e["crc32c"].get<std::string>();
    if (crc.size() != 8 || crc.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
      return bad("entry for '" + shown + "' has crc32c '" + crc.substr(0, 16) + "', not 8 hex digits");
    m.files[name] = {e["bytes"].get<uint64_t>(), static_cast<uint32_t>(std::stoul(crc, nullptr, 16))};
  }
  if (!m.files.count(kCheckpointStateFile)) return bad("it does not list state.json");
  return m;
}

// Leftovers of an interrupted COMMIT write (write_file_atomic's temporary files) in dir.
std::vector<std::string> commit_leftovers(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  const std::string prefix = std::string(kCheckpointCommitFile) + ".tmp";
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string n = de.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Reads and validates <dir>/COMMIT. `expect_iteration` comes from the directory name when it has one.
Manifest read_manifest(const std::string& dir, std::optional<int64_t> expect_iteration) {
  const std::string path = (fs::path(dir) / kCheckpointCommitFile).string();
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    const auto tmp = commit_leftovers(dir);
    if (!tmp.empty())
      MOECORE_FAIL("checkpoint: '", path, "' is missing, only the leftover '", tmp.front(),
                   "' exists: the save was interrupted while committing, so the directory is unfinished");
    MOECORE_FAIL("checkpoint: '", path, "' is missing: the save did not finish or the marker was deleted");
  }
  return parse_manifest(read_file(path), path, expect_iteration);
}

// Directories named iter_%07d under root, by iteration.
std::map<int64_t, std::string> iteration_dirs(const std::string& root) {
  std::map<int64_t, std::string> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(root, ec)) {
    if (!de.is_directory(ec)) continue;
    if (auto it = parse_iter_name(de.path().filename().string())) out[*it] = de.path().string();
  }
  return out;
}

// Removes a committed directory so that no crash can leave it looking committed with files missing:
// the marker goes first (durably), then the rest.
void remove_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  fs::remove(fs::path(dir) / kCheckpointCommitFile, ec);
  if (!ec) fsync_dir(dir);
  fs::remove_all(dir, ec);
  if (ec) warn("could not remove '" + dir + "': " + ec.message());
}

// Steps 1-2 of the protocol. Returns the final directory and the manifest to commit. With a token the
// staging directory <final>.tmp-<token> already exists (made by checkpoint_staging_begin) and holds the files
// of `others`, written by other ranks; they join the manifest after their sizes are checked.
std::pair<std::string, Manifest> stage_and_publish(const std::string& root, const CheckpointWriteRequest& req,
                                                   const std::string& token = "",
                                                   const std::map<std::string, CheckpointFileInfo>& others = {}) {
  if (req.iteration < 0) MOECORE_FAIL("checkpoint: iteration (", req.iteration, ") must be >= 0");
  for (const auto& [name, tensors] : req.files) check_file_name(name);
  try {
    parse_json(req.state_json, "state_json");
  } catch (const Error&) {
    MOECORE_FAIL("checkpoint: state_json for iteration ", req.iteration, " is not valid JSON (", req.state_json.size(),
                 " bytes); pass \"{}\" when there is no state");
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) MOECORE_FAIL("checkpoint: cannot create directory '", root, "': ", ec.message());

  const std::string final_dir = checkpoint_iteration_dir(root, req.iteration);
  const std::string pid = std::to_string(::getpid());
  const std::string staging = final_dir + ".tmp-" + (token.empty() ? pid : token);
  if (token.empty()) {
    fs::remove_all(staging, ec);
    if (!fs::create_directory(staging, ec) || ec)
      MOECORE_FAIL("checkpoint: cannot create directory '", staging, "': ", ec.message());
  } else if (!fs::is_directory(staging, ec)) {
    MOECORE_FAIL("checkpoint: the shared staging directory '", staging, "' is missing");
  }

  Manifest m;
  m.iteration = req.iteration;
  try {
    for (const auto& [name, info] : others) {
      check_file_name(name);
      if (req.files.count(name)) MOECORE_FAIL("checkpoint: file '", name, "' is written by two ranks");
      const std::string path = (fs::path(staging) / name).string();
      const auto size = fs::file_size(path, ec);
      if (ec || size != info.bytes)
        MOECORE_FAIL("checkpoint: '", path, "' written by another rank is ", ec ? "missing" : "of the wrong size",
                     " (expected ", info.bytes, " bytes)");
      m.files[name] = {info.bytes, info.crc32c};
    }
    for (const auto& [name, tensors] : req.files) m.files[name] = checkpoint_staging_write(staging, name, tensors);
    write_fsync((fs::path(staging) / kCheckpointStateFile).string(), req.state_json);
    m.files[kCheckpointStateFile] = {req.state_json.size(), crc32c(req.state_json)};
    fsync_dir(staging);

    // rename(2) cannot replace a non-empty directory: move an old copy of this iteration aside first.
    // A crash between the two renames leaves no iter dir for this iteration, which discovery tolerates.
    const std::string aside = final_dir + ".old-" + pid;
    const bool replacing = fs::exists(final_dir, ec);
    if (replacing && req.same_model && fs::exists(fs::path(final_dir) / kCheckpointCommitFile, ec)) {
      std::string state;
      try {
        state = read_file((fs::path(final_dir) / kCheckpointStateFile).string());
      } catch (const Error&) {
      }
      if (!req.same_model(state))
        MOECORE_FAIL("checkpoint: ", final_dir, " is a checkpoint of another model; this save would replace it; ",
                     "hint: save this model into its own --save directory");
    }
    if (replacing) {
      fs::remove_all(aside, ec);
      if (std::rename(final_dir.c_str(), aside.c_str()) != 0) sys_fail("cannot move aside", final_dir);
    }
    if (std::rename(staging.c_str(), final_dir.c_str()) != 0) {
      const int e = errno;
      if (replacing) std::rename(aside.c_str(), final_dir.c_str());
      errno = e;
      sys_fail("cannot rename staging directory into place", final_dir);
    }
    fsync_dir(root);
    if (replacing) fs::remove_all(aside, ec);
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
  return {final_dir, m};
}

void apply_retention(const std::string& root, int64_t just_written, int keep_last,
                     const std::function<bool(const std::string&)>& same_model) {
  if (keep_last <= 0) return;
  std::vector<int64_t> others;  // the same model's, ascending
  for (int64_t it : checkpoint_list_committed(root)) {
    if (it == just_written) continue;
    if (same_model) {
      std::string state;
      try {
        state = read_file((fs::path(checkpoint_iteration_dir(root, it)) / kCheckpointStateFile).string());
      } catch (const Error&) {
        continue;  // unreadable: not known to be ours, so kept
      }
      if (!same_model(state)) continue;
    }
    others.push_back(it);
  }
  const size_t keep_others = static_cast<size_t>(keep_last - 1);
  if (others.size() <= keep_others) return;
  for (size_t i = 0; i < others.size() - keep_others; ++i)
    remove_checkpoint_dir(checkpoint_iteration_dir(root, others[i]));
}

// What no load can ever use, left by earlier interrupted saves: staging dirs (*.tmp-*, *.old-*), iteration
// directories without a COMMIT file, and temporary files of COMMIT and the tracker. Run only after this
// save has committed and the tracker names it, so `just_written` is what a --load now picks. Safe: a
// directory without COMMIT is refused by checkpoint_load (--ckpt-step included), and a root has a single
// writer (checkpoint.h) whose only save in flight is this one, so nothing removed here could still become a
// checkpoint. Directories with a (possibly damaged) COMMIT are kept: retention decides about committed ones,
// and a damaged one is left for inspection.
void remove_unfinished(const std::string& root, int64_t just_written) {
  std::error_code ec;
  std::vector<fs::path> stale;
  const std::string tracker_tmp = std::string(kCheckpointTrackerFile) + ".tmp";
  for (const auto& de : fs::directory_iterator(root, ec)) {
    const std::string name = de.path().filename().string();
    if (de.is_directory(ec) && is_staging_name(name)) {
      stale.push_back(de.path());
    } else if (de.is_directory(ec) && parse_iter_name(name)) {
      for (const auto& leftover : commit_leftovers(de.path().string())) stale.push_back(de.path() / leftover);
      if (*parse_iter_name(name) != just_written && !fs::exists(de.path() / kCheckpointCommitFile, ec))
        stale.push_back(de.path());
    } else if (name.rfind(tracker_tmp, 0) == 0) {
      stale.push_back(de.path());
    }
  }
  for (const auto& p : stale) fs::remove_all(p, ec);
}

// Steps 3-5 of the protocol, once the files of `manifest` are in `dir`. A failed COMMIT write removes the
// uncommitted directory: it could never be loaded, and the tracker still names the previous iteration.
void commit_and_retain(const std::string& root, const std::string& dir, const Manifest& manifest, int keep_last,
                       const std::function<bool(const std::string&)>& same_model) {
  try {
    write_file_atomic((fs::path(dir) / kCheckpointCommitFile).string(), manifest_json(manifest));
  } catch (const Error&) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    throw;
  }
  write_file_atomic((fs::path(root) / kCheckpointTrackerFile).string(), std::to_string(manifest.iteration));
  apply_retention(root, manifest.iteration, keep_last, same_model);
  remove_unfinished(root, manifest.iteration);
}

// "<root>" and the iteration of a directory <root>/iter_N (nullopt when dir is not named so).
std::pair<std::string, std::optional<int64_t>> split_iteration_dir(const std::string& dir) {
  const fs::path norm = fs::path(dir).lexically_normal();
  const fs::path leaf = norm.has_filename() ? norm : norm.parent_path();
  const std::string parent = leaf.parent_path().string();
  return {parent.empty() ? "." : parent, parse_iter_name(leaf.filename().string())};
}

std::string join_iterations(const std::vector<int64_t>& its) {
  std::string s;
  for (int64_t it : its) s += (s.empty() ? "" : ", ") + std::to_string(it);
  return s;
}

// The hint for a damaged checkpoint of iteration `failed` (nullopt: none in particular) under root.
std::string recovery_hint(const std::string& root, std::optional<int64_t> failed) {
  std::vector<int64_t> others;
  for (int64_t it : checkpoint_list_committed(root))
    if (!failed || it != *failed) others.push_back(it);
  if (others.empty())
    return " No other committed checkpoint is under '" + root +
           "': restore the damaged files, or move them out of the directory to train from scratch.";
  return " Committed checkpoints under '" + root + "': iteration" + (others.size() > 1 ? "s " : " ") +
         join_iterations(others) + " (newest " + std::to_string(others.back()) + "); load one with --load " + root +
         " --ckpt-step " + std::to_string(others.back()) + ", or restore the damaged files.";
}

}  // namespace

std::string checkpoint_iteration_dir(const std::string& root, int64_t iteration) {
  return (fs::path(root) / iter_name(iteration)).string();
}

int64_t checkpoint_iteration_of(const std::string& dir) {
  if (const std::optional<int64_t> named = split_iteration_dir(dir).second) return *named;
  return read_manifest(dir, std::nullopt).iteration;
}

std::optional<int64_t> checkpoint_read_tracker(const std::string& root) {
  const fs::path path = fs::path(root) / kCheckpointTrackerFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  std::string text = read_file(path.string());
  const size_t b = text.find_first_not_of(" \t\r\n"), e = text.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) return std::nullopt;
  text = text.substr(b, e - b + 1);
  if (text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoll(text);
}

std::vector<int64_t> checkpoint_list_committed(const std::string& root) {
  std::vector<int64_t> out;
  for (const auto& [it, dir] : iteration_dirs(root)) {
    try {
      read_manifest(dir, it);
      out.push_back(it);
    } catch (const Error&) {
    }
  }
  return out;
}

std::string checkpoint_staging_begin(const std::string& root, int64_t iteration, const std::string& token) {
  if (token.empty() || !is_plain_name(token))
    MOECORE_FAIL("checkpoint: staging token '", token, "' is not a plain name");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) MOECORE_FAIL("checkpoint: cannot create directory '", root, "': ", ec.message());
  const std::string staging = checkpoint_iteration_dir(root, iteration) + ".tmp-" + token;
  fs::remove_all(staging, ec);
  if (!fs::create_directory(staging, ec) || ec)
    MOECORE_FAIL("checkpoint: cannot create directory '", staging, "': ", ec.message());
  return staging;
}

CheckpointFileInfo checkpoint_staging_write(const std::string& staging_dir, const std::string& name,
                                            const std::map<std::string, Tensor>& tensors) {
  check_file_name(name);
  return checkpoint_staging_write_bytes(staging_dir, name, safetensors_serialize(tensors));
}

CheckpointFileInfo checkpoint_staging_write_bytes(const std::string& staging_dir, const std::string& name,
                                                  std::string_view bytes) {
  check_file_name(name);
  const std::string path = (fs::path(staging_dir) / name).string();
  if (!write_fsync_direct(path, bytes)) write_fsync(path, bytes);
  return {bytes.size(), crc32c(bytes)};
}

void checkpoint_staging_remove(const std::string& root, int64_t iteration, const std::string& token) {
  if (token.empty() || !is_plain_name(token))
    MOECORE_FAIL("checkpoint: staging token '", token, "' is not a plain name");
  std::error_code ec;
  fs::remove_all(checkpoint_iteration_dir(root, iteration) + ".tmp-" + token, ec);
}

void checkpoint_staging_commit(const std::string& root, const CheckpointWriteRequest& request, const std::string& token,
                               const std::map<std::string, CheckpointFileInfo>& written_by_others, int keep_last) {
  if (keep_last < 0) MOECORE_FAIL("checkpoint: keep_last (", keep_last, ") must be >= 0 (0 keeps all)");
  if (token.empty()) MOECORE_FAIL("checkpoint: checkpoint_staging_commit needs the token of checkpoint_staging_begin");
  const auto [dir, manifest] = stage_and_publish(root, request, token, written_by_others);
  commit_and_retain(root, dir, manifest, keep_last, request.same_model);
}

std::string checkpoint_write_uncommitted(const std::string& root, const CheckpointWriteRequest& request) {
  return stage_and_publish(root, request).first;
}

void checkpoint_save(const std::string& root, const CheckpointWriteRequest& request, int keep_last) {
  if (keep_last < 0) MOECORE_FAIL("checkpoint: keep_last (", keep_last, ") must be >= 0 (0 keeps all)");
  const auto [dir, manifest] = stage_and_publish(root, request);
  commit_and_retain(root, dir, manifest, keep_last, request.same_model);
}

std::optional<std::string> checkpoint_find_latest(const std::string& root, std::optional<int64_t> step) {
  std::error_code ec;
  const std::string step_flag = step ? "--ckpt-step " + std::to_string(*step) : "";
  if (!fs::is_directory(root, ec)) {
    if (step) MOECORE_FAIL("checkpoint: ", step_flag, ": the --load directory '", root, "' does not exist");
    return std::nullopt;
  }
  const fs::path norm = fs::path(root).lexically_normal();
  const auto named = parse_iter_name((norm.has_filename() ? norm : norm.parent_path()).filename().string());
  if (named || fs::exists(norm / kCheckpointCommitFile, ec)) {
    if (step && named != step)
      MOECORE_FAIL("checkpoint: ", step_flag, " does not match --load '", root,
                   "', which is itself an iteration directory; give the checkpoint root to --load instead");
    return root;
  }
  // Validates COMMIT of the chosen directory; an error names it and lists the alternatives.
  auto chosen = [&](int64_t it, const std::string& by) -> std::string {
    const std::string dir = checkpoint_iteration_dir(root, it);
    if (!fs::is_directory(dir, ec))
      MOECORE_FAIL("checkpoint: ", by, " names iteration ", it, " but '", dir, "' does not exist.",
                   recovery_hint(root, it));
    try {
      read_manifest(dir, it);
    } catch (const Error& e) {
      MOECORE_FAIL("checkpoint: refusing to load iteration ", it, " (named by ", by, "): ", reason_of(e), ".",
                   recovery_hint(root, it));
    }
    return dir;
  };
  if (step) return chosen(*step, step_flag);

  const auto dirs = iteration_dirs(root);
  const fs::path tracker_path = fs::path(root) / kCheckpointTrackerFile;
  if (fs::exists(tracker_path, ec)) {
    const auto tracker = checkpoint_read_tracker(root);
    if (!tracker)
      MOECORE_FAIL("checkpoint: the tracker '", tracker_path.string(),
                   "' does not hold an iteration number, so the newest checkpoint is unknown.",
                   recovery_hint(root, std::nullopt));
    const std::string dir = chosen(*tracker, "the tracker '" + tracker_path.string() + "'");
    for (auto it = dirs.upper_bound(*tracker); it != dirs.end(); ++it) {
      const bool committed = fs::exists(fs::path(it->second) / kCheckpointCommitFile, ec);
      warn("ignoring '" + it->second + "': newer than the tracker's iteration " + std::to_string(*tracker) +
           (committed ? " (committed, but the tracker was not updated: an interrupted save or a rewound run)"
                      : " (no COMMIT marker: an unfinished save)"));
    }
    return dir;
  }
  if (dirs.empty()) return std::nullopt;
  return chosen(dirs.rbegin()->first, "the highest iteration directory, as there is no tracker file");
}

std::string checkpoint_recovery_hint(const std::string& dir) {
  const auto [root, it] = split_iteration_dir(dir);
  return recovery_hint(root, it);
}

CheckpointManifest checkpoint_parse_manifest(std::string_view text, const std::string& path,
                                             std::optional<int64_t> expect_iteration) {
  return parse_manifest(text, path, expect_iteration);
}

VerifiedCheckpoint checkpoint_verify(const std::string& dir) {
  const fs::path norm = fs::path(dir).lexically_normal();
  const auto named = parse_iter_name((norm.has_filename() ? norm : norm.parent_path()).filename().string());
  Manifest m;
  try {
    m = read_manifest(dir, named);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "." + checkpoint_recovery_hint(dir));
  }

  std::vector<std::string> problems;
  for (const auto& [name, want] : m.files) {
    const std::string path = (fs::path(dir) / name).string();
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      problems.push_back("'" + path + "': missing file (COMMIT lists it with " + std::to_string(want.bytes) +
                         " bytes)");
      continue;
    }
    const uint64_t size = fs::file_size(path, ec);
    if (ec || size != want.bytes) {
      problems.push_back("'" + path + "': size mismatch: " + std::to_string(size) + " bytes on disk, COMMIT records " +
                         std::to_string(want.bytes) + (size < want.bytes ? " (truncated)" : " (overwritten)"));
      continue;
    }
    const FileEntry got = file_entry_of(path);
    if (got.bytes != want.bytes || got.crc32c != want.crc32c)
      problems.push_back("'" + path + "': checksum mismatch: crc32c " + hex8(got.crc32c) + " on disk, COMMIT records " +
                         hex8(want.crc32c) + " (a flipped or overwritten byte)");
  }
  if (!problems.empty()) {
    std::string msg;
    for (const auto& p : problems) msg += (msg.empty() ? "" : "; ") + p;
    MOECORE_FAIL("checkpoint: '", dir, "' (iteration ", m.iteration, ") fails verification against COMMIT: ", msg, ".",
                 checkpoint_recovery_hint(dir));
  }

  VerifiedCheckpoint out;
  out.iteration = m.iteration;
  out.dir = dir;
  for (const auto& [name, entry] : m.files) {
    if (name == kCheckpointStateFile)
      out.state_json = read_file((fs::path(dir) / name).string());
    else
      out.files.push_back(name);
  }
  return out;
}

LoadedCheckpoint checkpoint_load(const std::string& dir) {
  const VerifiedCheckpoint v = checkpoint_verify(dir);
  LoadedCheckpoint out;
  out.iteration = v.iteration;
  out.dir = v.dir;
  out.state_json = v.state_json;
  for (const auto& name : v.files) out.files[name] = safetensors_load((fs::path(dir) / name).string());
  return out;
}

CheckpointFileInfo checkpoint_file_info(const std::string& path) {
  return file_entry_of(path);
}

}  // namespace moecore::io
