#include "moecore/io/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moecore/core/error.h"

namespace moecore::io {
namespace {
[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  MOECORE_FAIL("io: ", what, " '", path, "': ", std::strerror(errno));
}
}  // namespace

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_fail("cannot create", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      io_fail("cannot write", tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    io_fail("cannot fsync", tmp);
  }
  if (::close(fd) != 0) io_fail("cannot close", tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) io_fail("cannot rename into place", path);
  std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) io_fail("cannot open", path);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

}  // namespace moecore::io
