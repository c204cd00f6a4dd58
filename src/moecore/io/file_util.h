// Atomic file writes: write to a temporary file beside the target, fsync it, rename over the target, and
// fsync the directory, so a crash leaves either the old file or the new one, never a torn file.
#pragma once
#include <string>
#include <string_view>

namespace moecore::io {
void write_file_atomic(const std::string& path, std::string_view bytes);
std::string read_file(const std::string& path);  // throws Error naming the file when unreadable
}  // namespace moecore::io
