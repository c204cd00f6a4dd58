// JSONL and TensorBoard metrics writers. The protobuf messages are encoded by hand (a few fields, see
// docs/formats.md §5.2) so moecore needs neither protobuf nor TensorFlow; byte layout is pinned by the
// docs/formats.md §5.3 test vectors in tests/io/test_metrics.cpp.
#include "moecore/io/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/io/crc32c.h"
#include "moecore/io/input_file.h"

namespace moecore::io {
namespace {

namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little, "the encoders below write host byte order");

void create_parent_dirs(const fs::path& dir, const char* who) {
  if (dir.empty()) return;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) MOECORE_FAIL(who, ": cannot create directory '", dir.string(), "': ", ec.message());
}

double unix_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// ---- protobuf wire format ----
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_key(std::string& out, uint32_t field, Wire wire) {
  put_varint(out, (uint64_t{field} << 3) | wire);
}
template <class T>
void put_raw(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event fields: wall_time = 1 (double), step = 2 (int64), file_version = 3, summary = 5 (oneof "what").
void put_event_header(std::string& out, double wall_time, int64_t step) {
  if (std::bit_cast<uint64_t>(wall_time) != 0) {
    put_key(out, 1, kFixed64);
    put_raw(out, wall_time);
  }
  if (step != 0) {
    put_key(out, 2, kVarint);
    put_varint(out, static_cast<uint64_t>(step));  // negative int64: ten bytes, as protobuf does
  }
}

}  // namespace

std::string tensorboard_encode_file_version_event(double wall_time) {
  std::string ev;
  put_event_header(ev, wall_time, 0);
  put_bytes(ev, 3, "brain.Event:2");
  return ev;
}

std::string tensorboard_encode_scalar_event(double wall_time, int64_t step,
                                            const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;  // Summary.Value: tag = 1, simple_value = 2 (in oneof "value": always written)
    put_bytes(value, 1, tag);
    put_key(value, 2, kFixed32);
    put_raw(value, v);
    put_bytes(summary, 1, value);  // Summary.value = 1 (repeated)
  }
  std::string ev;
  put_event_header(ev, wall_time, step);
  put_bytes(ev, 5, summary);
  return ev;
}

std::string tfrecord_frame(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  const uint64_t len = data.size();
  put_raw(out, len);
  put_raw(out, crc32c_mask(crc32c(std::string_view(out.data(), 8))));
  out += data;
  put_raw(out, crc32c_mask(crc32c(data)));
  return out;
}

// ---- JsonlMetricsWriter ----

void JsonlMetricsWriter::Closer::operator()(std::FILE* f) const {
  if (f) std::fclose(f);
}

JsonlMetricsWriter::JsonlMetricsWriter(const std::string& path) : path_(path) {
  create_parent_dirs(fs::path(path).parent_path(), "metrics");
  // Lines go to a regular file (appended) or a character device (/dev/null, a terminal). A FIFO would block the
  // open until a reader came (or stall the run on a full pipe), and a directory or socket cannot be appended to:
  // each is refused, before the open (stat) and after it (fstat: the path may have changed in between). O_NONBLOCK
  // keeps the open itself from blocking.
  const auto refuse = [&](mode_t mode) {
    MOECORE_FAIL("metrics: --metrics-jsonl '", path, "' is ", file_kind(mode),
                 "; metrics are appended to a regular file (or written into a character device such as /dev/null): "
                 "give a file path");
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISCHR(st.st_mode)) refuse(st.st_mode);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0) MOECORE_FAIL("metrics: cannot open '", path, "' for appending: ", std::strerror(errno));
  if (::fstat(fd, &st) != 0 || (!S_ISREG(st.st_mode) && !S_ISCHR(st.st_mode))) {
    ::close(fd);
    refuse(st.st_mode);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  file_.reset(::fdopen(fd, "ab"));
  if (!file_) {
    const int err = errno;
    ::close(fd);
    MOECORE_FAIL("metrics: cannot open '", path, "' for appending: ", std::strerror(err));
  }
}

void JsonlMetricsWriter::write(const MetricFields& fields) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [key, value] : fields) {
    if (const auto* d = std::get_if<double>(&value)) {
      j[key] = std::isfinite(*d) ? nlohmann::ordered_json(*d) : nlohmann::ordered_json(nullptr);
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      j[key] = *i;
    } else {
      j[key] = std::get<std::string>(value);
    }
  }
  const std::string line = j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_.get()) != line.size() || std::fflush(file_.get()) != 0)
    MOECORE_FAIL("metrics: cannot write to '", path_, "': ", std::strerror(errno));
}

// ---- TensorBoardWriter ----

void TensorBoardWriter::Closer::operator()(std::FILE* f) const {
  if (f) std::fclose(f);  // flushes
}

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir, const std::string& filename_suffix, int flush_every)
    : flush_every_(flush_every < 1 ? 1 : flush_every) {
  create_parent_dirs(log_dir, "tensorboard");
  const double now = unix_now();
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%010lld", static_cast<long long>(now));
  const std::string base = (fs::path(log_dir) / "events.out.tfevents.").string() + stamp + "." + host;
  // O_EXCL: two writers started in the same second (a restarted run) must not share a file.
  for (int attempt = 0; attempt < 1000 && !file_; ++attempt) {
    path_ =
        base + (attempt == 0 ? "" : "." + std::to_string(::getpid()) + "." + std::to_string(attempt)) + filename_suffix;
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
      if (errno == EEXIST) continue;
      MOECORE_FAIL("tensorboard: cannot create '", path_, "': ", std::strerror(errno));
    }
    file_.reset(::fdopen(fd, "wb"));
    if (!file_) {
      ::close(fd);
      MOECORE_FAIL("tensorboard: cannot open '", path_, "': ", std::strerror(errno));
    }
  }
  if (!file_) MOECORE_FAIL("tensorboard: no free event file name under '", log_dir, "'");
  write_record(tensorboard_encode_file_version_event(now));
  flush();
}

void TensorBoardWriter::add_scalar(const std::string& tag, int64_t step, double value) {
  add_scalars(step, {{tag, value}});
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::vector<std::pair<std::string, float>> f;
  f.reserve(values.size());
  for (const auto& [tag, v] : values) f.emplace_back(tag, static_cast<float>(v));
  write_record(tensorboard_encode_scalar_event(unix_now(), step, f));
}

void TensorBoardWriter::write_record(const std::string& event) {
  const std::string rec = tfrecord_frame(event);
  if (std::fwrite(rec.data(), 1, rec.size(), file_.get()) != rec.size())
    MOECORE_FAIL("tensorboard: cannot write to '", path_, "': ", std::strerror(errno));
  if (++pending_ >= flush_every_) flush();
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_.get()) != 0) MOECORE_FAIL("tensorboard: cannot write to '", path_, "': ", std::strerror(errno));
  pending_ = 0;
}

}  // namespace moecore::io
