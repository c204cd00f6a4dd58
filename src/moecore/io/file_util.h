// Atomic file writes: write to a temporary file beside the target, fsync it, rename over the target, and
// fsync the directory, so a crash leaves either the old file or the new one, never a torn file. Also the
// write loop every durable writer shares, with its test-only fault-injection hook. Not here: directories,
// checksums (io/checkpoint), streaming readers.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moecore::io {

void write_file_atomic(const std::string& path, std::string_view bytes);
std::string read_file(const std::string& path);  // throws Error naming the file when unreadable

// ---- Write-fault injection (FOR TESTS, shipped in the product) ----------------------------------------
// MOECORE_FAULT_INJECT_WRITE="<file name or *>:<byte offset>:<ENOSPC|EIO>" makes every write through
// write_all (write_file_atomic, checkpoint data files, state.json, COMMIT, the tracker) of a file with that
// name (the last path component of the target, e.g. "model.safetensors", "COMMIT"; "*" = any file) fail
// once it reaches byte <offset>: the bytes before it are written, then the write fails with that errno, as
// a full disk would. It fires on every matching file that is longer than <offset> (a full disk stays full).
// Read once, at the first write; a malformed value is an Error naming the variable.
inline constexpr const char* kWriteFaultEnv = "MOECORE_FAULT_INJECT_WRITE";
struct WriteFault {
  std::string name;     // file name, or "*"
  uint64_t offset = 0;  // first byte that cannot be written
  int err = 0;          // ENOSPC or EIO
};
std::optional<WriteFault> write_fault_parse(std::string_view spec);  // throws Error on a malformed spec
const std::optional<WriteFault>& write_fault_injected();             // the environment's, parsed once

// Writes all of `bytes` at the start of the open file `fd` (short writes and EINTR retried). `name` is the
// file name the fault hook matches. Returns 0, or the errno of the write that failed with `failed_at` set
// to the byte offset it failed at (errno is left set too).
int write_all(int fd, std::string_view bytes, std::string_view name, uint64_t& failed_at);

}  // namespace moecore::io
