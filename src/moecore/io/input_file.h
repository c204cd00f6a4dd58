// Input files that must be regular files (Megatron .bin/.idx, tokenizer files, safetensors, JSON / YAML configs):
// a FIFO given as one would block open() or read() until some writer came, and a directory, socket or device reads
// nothing a reader can use, so each is refused naming the file, what it was for and what it is.
// Not here: outputs (file_util.h, the metrics writers) or inputs that may stream (`preprocess --input`: a pipe is
// fine there).
#pragma once
#include <sys/types.h>

#include <string>

namespace moecore::io {

// "a FIFO (named pipe)", "a directory", "a socket", "a character device", "a block device", "a regular file", ...
std::string file_kind(mode_t mode);

// Throws Error unless `path` (its symlinks followed) is a regular file: "<what> '<path>' is a FIFO (named pipe), not
// a regular file; ...". A path that does not exist or cannot be examined passes: the reader's open() reports it.
void require_regular_file(const std::string& path, const std::string& what);

// open(path, O_RDONLY | O_CLOEXEC) that cannot block on a FIFO: it opens with O_NONBLOCK, refuses (as above, closing
// the descriptor) anything fstat does not call a regular file, then clears O_NONBLOCK. Returns the descriptor, or -1
// with errno set when open() itself fails (the caller words that error).
int open_regular_file(const std::string& path, const std::string& what);

}  // namespace moecore::io
