// Atomic file writes: write to a temporary file beside the target, fsync it, rename over the target, and
// fsync the directory, so a crash leaves either the old file or the new one, never a torn file. The rules of
// what an output may replace (never a device, a FIFO, a directory or another user's file; never one of the
// command's own inputs). Also the write loop every durable writer shares, with its test-only fault-injection
// hook. Not here: checkpoint directories and checksums (io/checkpoint), streaming readers.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moecore::io {

// ---- Outputs: what a path may receive --------------------------------------------------------------
// Every file moecore writes goes through output_target first:
//   absent, or a regular file of this (effective) user  -> replace: written beside it and renamed over it. A
//     symbolic link is followed: the file it names is replaced and the link stays.
//   a character device (/dev/null, a terminal) or a FIFO -> write_into: written into, never replaced; a FIFO
//     that no process reads is refused when it is opened (it would block forever).
//   anything else: a directory, a block device, a socket, a dangling link, another user's file -> Error naming
//     the path and what is there.
enum class OutputKind : uint8_t { replace, write_into };
struct OutputTarget {
  OutputKind kind = OutputKind::replace;
  std::string path;  // the file to replace or write into (symbolic links resolved)
};
OutputTarget output_target(const std::string& path);

// A path given to a command by a flag ("--out", "hf/model.safetensors"); flag names it in errors.
struct FlagPath {
  std::string flag, path;
};
// An output file checked at start-up, before any work: output_target accepts it (Error naming the flag otherwise),
// and it is none of the command's input files (through links and hard links too: Error naming both flags). A directory
// given as an input stands for the files read from it: callers list those (e.g. HfCheckpointReader::files()).
void check_output_file(const FlagPath& out, const std::vector<FlagPath>& inputs);

// Writes `bytes` to `path` as output_target says: replace atomically (temporary file, fsync, rename, fsync of the
// directory), or write into a device or FIFO.
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
