#include "moecore/io/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
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

std::optional<WriteFault> write_fault_parse(std::string_view spec) {
  if (spec.empty()) return std::nullopt;
  auto bad = [&](const char* why) -> std::optional<WriteFault> {
    MOECORE_FAIL("io: ", kWriteFaultEnv, "='", spec, "' ", why,
                 "; expected <file name or *>:<byte offset>:<ENOSPC|EIO>, e.g. model.safetensors:4096:ENOSPC");
  };
  // From the right, so that a file name may hold ':'.
  const size_t c2 = spec.rfind(':');
  if (c2 == std::string_view::npos || c2 == 0) return bad("has no ':'");
  const size_t c1 = spec.rfind(':', c2 - 1);
  if (c1 == std::string_view::npos || c1 == 0) return bad("has fewer than three ':'-separated fields");
  WriteFault f;
  f.name = std::string(spec.substr(0, c1));
  const std::string_view off = spec.substr(c1 + 1, c2 - c1 - 1), err = spec.substr(c2 + 1);
  if (off.empty() || off.size() > 18 || off.find_first_not_of("0123456789") != std::string_view::npos)
    return bad("has a byte offset that is not a decimal number");
  for (char ch : off) f.offset = f.offset * 10 + static_cast<uint64_t>(ch - '0');
  if (err == "ENOSPC")
    f.err = ENOSPC;
  else if (err == "EIO")
    f.err = EIO;
  else
    return bad("names an errno other than ENOSPC or EIO");
  return f;
}

const std::optional<WriteFault>& write_fault_injected() {
  static const std::optional<WriteFault> fault = [] {
    const char* v = std::getenv(kWriteFaultEnv);
    return write_fault_parse(v ? std::string_view(v) : std::string_view());
  }();
  return fault;
}

int write_all(int fd, std::string_view bytes, std::string_view name, uint64_t& failed_at) {
  size_t limit = bytes.size();  // bytes that may be written before the injected fault
  int fault_err = 0;
  if (const auto& f = write_fault_injected(); f && (f->name == "*" || f->name == name) && f->offset < bytes.size()) {
    limit = static_cast<size_t>(f->offset);
    fault_err = f->err;
  }
  size_t done = 0;
  while (done < limit) {
    const ssize_t n = ::write(fd, bytes.data() + done, limit - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      failed_at = done;
      return errno;
    }
    done += static_cast<size_t>(n);
  }
  if (fault_err != 0) {
    failed_at = done;
    errno = fault_err;
    return fault_err;
  }
  return 0;
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_fail("cannot create", tmp);
  // A failed write removes its temporary file: it could only ever be litter.
  auto fail = [&](const std::string& what, const std::string& where) {
    const int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = e;
    io_fail(what, where);
  };
  uint64_t at = 0;
  if (write_all(fd, bytes, std::filesystem::path(path).filename().string(), at) != 0)
    fail("cannot write byte " + std::to_string(at) + " of " + std::to_string(bytes.size()) + " to", tmp);
  if (::fsync(fd) != 0) fail("cannot fsync", tmp);
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    errno = e;
    io_fail("cannot close", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    errno = e;
    io_fail("cannot rename into place", path);
  }
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
