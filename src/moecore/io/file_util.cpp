#include "moecore/io/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
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

OutputTarget output_target(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {OutputKind::replace, path};
    io_fail("cannot inspect output", path);
  }
  std::string target = path;
  if (S_ISLNK(st.st_mode)) {
    char* resolved = ::realpath(path.c_str(), nullptr);
    if (!resolved)
      MOECORE_FAIL("io: output '", path, "' is a symbolic link to nothing that can be written (", std::strerror(errno),
                   "); hint: remove the link or give the file it should name");
    target = resolved;
    std::free(resolved);
    if (::stat(target.c_str(), &st) != 0) io_fail("cannot inspect output", target);
  }
  const std::string shown = target == path ? "'" + path + "'" : "'" + path + "' (-> '" + target + "')";
  auto refuse = [&](const std::string& what) -> OutputTarget {
    MOECORE_FAIL("io: output ", shown, " is ", what, "; moecore writes files, and replaces only regular files ",
                 "of its own user; hint: give a new file name");
  };
  if (S_ISREG(st.st_mode)) {
    if (st.st_uid != ::geteuid())
      return refuse("a file of user id " + std::to_string(st.st_uid) + ", not of this user (" +
                    std::to_string(::geteuid()) + ")");
    return {OutputKind::replace, target};
  }
  if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode)) return {OutputKind::write_into, target};
  if (S_ISDIR(st.st_mode)) return refuse("a directory");
  if (S_ISBLK(st.st_mode)) return refuse("a block device");
  if (S_ISSOCK(st.st_mode)) return refuse("a socket");
  return refuse("not a regular file");
}

void check_output_file(const FlagPath& out, const std::vector<FlagPath>& inputs) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (out.path.empty()) return;
  try {
    output_target(out.path);
  } catch (const Error& e) {
    throw Error(out.flag + ": " + e.what());
  }
  if (!fs::exists(out.path, ec)) return;  // nothing there: nothing an input could lose
  for (const FlagPath& in : inputs) {
    if (in.path.empty() || !fs::exists(in.path, ec)) continue;
    if (fs::equivalent(out.path, in.path, ec) && !ec)
      MOECORE_FAIL(out.flag, " ", out.path, " would overwrite the input ", in.flag, " ", in.path,
                   "; hint: write the output somewhere else");
  }
}

namespace {
// Writes into a character device or FIFO (no temporary file, no rename: the device stays what it is).
void write_into(const std::string& path, std::string_view bytes) {
  // O_NONBLOCK: opening a FIFO for writing blocks until a reader comes; ENXIO says none is there.
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0 && errno == ENXIO)
    MOECORE_FAIL("io: output '", path, "' is a FIFO that no process is reading; hint: start its reader first");
  if (fd < 0) io_fail("cannot open", path);
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  uint64_t at = 0;
  if (write_all(fd, bytes, std::filesystem::path(path).filename().string(), at) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    io_fail("cannot write byte " + std::to_string(at) + " of " + std::to_string(bytes.size()) + " to", path);
  }
  ::close(fd);
}
}  // namespace

void write_file_atomic(const std::string& requested, std::string_view bytes) {
  const OutputTarget target = output_target(requested);
  if (target.kind == OutputKind::write_into) return write_into(target.path, bytes);
  const std::string& path = target.path;
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
