// Metrics writers: JSONL (one JSON object per line, appended, flushed per line) and TensorBoard event
// files (TFRecord framing with masked CRC32C, hand-encoded protobuf Event/Summary; docs/formats.md §5).
// Use Megatron's tag names ("lm loss", "learning-rate", ...) so curves overlay with Megatron runs.
// Not here: deciding what to log or when (train/), TensorBoard histograms, images or text.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace moecore::io {

using MetricValue = std::variant<int64_t, double, std::string>;
using MetricFields = std::vector<std::pair<std::string, MetricValue>>;  // written in this order

// Appends to `path` (created with its parent directories if missing). Each write() emits one compact
// JSON object and flushes it, so a crash loses at most the line being written. Doubles are printed
// with round-trip precision; NaN and Inf become null (strict JSON). Not thread-safe. `path` must be a regular file
// or a character device (/dev/null): a FIFO, socket or directory is refused (Error) rather than blocked on.
class JsonlMetricsWriter {
 public:
  explicit JsonlMetricsWriter(const std::string& path);
  void write(const MetricFields& fields);
  const std::string& path() const { return path_; }

 private:
  struct Closer {
    void operator()(std::FILE* f) const;
  };
  std::string path_;
  std::unique_ptr<std::FILE, Closer> file_;
};

// Writes <log_dir>/events.out.tfevents.<unix time, 10 digits>.<hostname><suffix>; if that name exists,
// ".<pid>.<n>" is inserted before the suffix. The first record is Event{wall_time, file_version =
// "brain.Event:2"}. Each scalar is Event{wall_time, step, summary{value{tag, simple_value (float32)}}}.
// Records are buffered: flush() pushes them to the OS; the destructor flushes; every `flush_every`-th
// record flushes automatically. Not thread-safe.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& log_dir, const std::string& filename_suffix = "", int flush_every = 16);
  void add_scalar(const std::string& tag, int64_t step, double value);
  // Several scalars of one step in one Event (one record).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  void flush();
  const std::string& path() const { return path_; }

 private:
  struct Closer {
    void operator()(std::FILE* f) const;
  };
  void write_record(const std::string& event);
  std::string path_;
  std::unique_ptr<std::FILE, Closer> file_;
  int flush_every_;
  int pending_ = 0;
};

// Protobuf / TFRecord building blocks, exposed for tests and for tools that write other event types.
// `wall_time` in seconds since the epoch. Fields equal to proto3 defaults are omitted as protobuf
// does, except members of a oneof (file_version, summary, simple_value), which are always written.
std::string tensorboard_encode_file_version_event(double wall_time);
std::string tensorboard_encode_scalar_event(double wall_time, int64_t step,
                                            const std::vector<std::pair<std::string, float>>& values);
// len (u64 LE), masked crc32c(len), data, masked crc32c(data).
std::string tfrecord_frame(const std::string& data);

}  // namespace moecore::io
