// Metrics writers and CRC32C: the docs/formats.md §5 test vectors byte for byte, TensorBoard event files read
// back by a small TFRecord/protobuf parser (CRCs verified, tag/step/value decoded), an optional cross-check
// with the Python `tensorboard` package (the interpreter named by MOECORE_TEST_PYTHON), and JSONL read back
// line by line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moecore/io/crc32c.h"
#include "moecore/io/file_util.h"
#include "moecore/io/metrics.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string temp_dir(const char* name) {
  const auto p =
      fs::temp_directory_path() / ("moecore_metrics_" + std::string(name) + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

// ---- CRC32C ----

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(io::crc32c("123456789"), 0xE3069283u);  // docs/formats.md §5.1 check value
  EXPECT_EQ(io::crc32c_extend_portable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(io::crc32c(""), 0u);
  std::string buf(32, '\0');  // RFC 3720 B.4 vectors
  EXPECT_EQ(io::crc32c(buf), 0x8A9136AAu);
  buf.assign(32, '\xff');
  EXPECT_EQ(io::crc32c(buf), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<char>(i);
  EXPECT_EQ(io::crc32c(buf), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<char>(31 - i);
  EXPECT_EQ(io::crc32c(buf), 0x113FDB5Cu);
}

TEST(Crc32c, ExtendAndPortablePathAgreeAtEveryLengthAndAlignment) {
  std::string data(300, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 131 + 7) ^ (i >> 3));
  for (size_t off = 0; off < 8; ++off)
    for (size_t n = 0; n + off <= data.size(); n += 7) {
      const char* p = data.data() + off;
      const uint32_t whole = io::crc32c_extend(0, p, n);
      ASSERT_EQ(whole, io::crc32c_extend_portable(0, p, n)) << off << " " << n;
      const size_t cut = n / 3;
      ASSERT_EQ(io::crc32c_extend(io::crc32c_extend(0, p, cut), p + cut, n - cut), whole) << off << " " << n;
    }
}

TEST(Crc32c, MaskRoundTrips) {
  for (uint32_t c : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu}) {
    EXPECT_NE(io::crc32c_mask(c), c);
    EXPECT_EQ(io::crc32c_unmask(io::crc32c_mask(c)), c);
  }
}

// ---- TensorBoard: docs/formats.md §5.3 ----

TEST(TensorBoard, FileVersionRecordMatchesTheTestVector) {
  const std::string rec = io::tfrecord_frame(io::tensorboard_encode_file_version_event(1700000000.0));
  EXPECT_EQ(rec, from_hex("1800000000000000a37f4b22"
                          "0900000040fc54d9411a0d627261696e2e4576656e743a32"
                          "eced8f9d"));
}

TEST(TensorBoard, ScalarRecordMatchesTheTestVector) {
  const std::string rec = io::tfrecord_frame(io::tensorboard_encode_scalar_event(1700000000.5, 10, {{"loss", 2.5f}}));
  EXPECT_EQ(rec, from_hex("1a00000000000000129bd82d"
                          "0900002040fc54d941100a2a0d0a0b0a046c6f73731500002040"
                          "3f2e8cb4"));
}

// ---- A minimal TFRecord + protobuf reader ----

struct Field {
  uint32_t number = 0;
  uint32_t wire = 0;
  uint64_t varint = 0;  // wire 0; also the raw bits of fixed64 / fixed32
  std::string bytes;    // wire 2
};

uint64_t read_varint(const std::string& s, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0; pos < s.size() && shift < 64; shift += 7) {
    const auto b = static_cast<uint8_t>(s[pos++]);
    v |= uint64_t{b & 0x7Fu} << shift;
    if (!(b & 0x80)) return v;
  }
  ADD_FAILURE() << "truncated varint";
  return v;
}

std::vector<Field> decode_message(const std::string& s) {
  std::vector<Field> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const uint64_t key = read_varint(s, pos);
    Field f;
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<uint32_t>(key & 7);
    if (f.wire == 0) {
      f.varint = read_varint(s, pos);
    } else if (f.wire == 1 || f.wire == 5) {
      const size_t n = f.wire == 1 ? 8 : 4;
      if (pos + n > s.size()) {
        ADD_FAILURE() << "truncated fixed field";
        return out;
      }
      std::memcpy(&f.varint, s.data() + pos, n);
      pos += n;
    } else if (f.wire == 2) {
      const uint64_t n = read_varint(s, pos);
      if (pos + n > s.size()) {
        ADD_FAILURE() << "length-delimited field runs past the message";
        return out;
      }
      f.bytes = s.substr(pos, n);
      pos += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      return out;
    }
    out.push_back(f);
  }
  return out;
}

std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < file.size()) {
    if (pos + 12 > file.size()) {
      ADD_FAILURE() << "truncated record header at " << pos;
      break;
    }
    uint64_t len;
    uint32_t len_crc, data_crc;
    std::memcpy(&len, file.data() + pos, 8);
    std::memcpy(&len_crc, file.data() + pos + 8, 4);
    EXPECT_EQ(io::crc32c_unmask(len_crc), io::crc32c(file.substr(pos, 8))) << "length crc at " << pos;
    if (pos + 12 + len + 4 > file.size()) {
      ADD_FAILURE() << "truncated record at " << pos;
      break;
    }
    out.push_back(file.substr(pos + 12, len));
    std::memcpy(&data_crc, file.data() + pos + 12 + len, 4);
    EXPECT_EQ(io::crc32c_unmask(data_crc), io::crc32c(out.back())) << "data crc at " << pos;
    pos += 12 + len + 4;
  }
  return out;
}

struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

DecodedEvent decode_event(const std::string& data) {
  DecodedEvent ev;
  for (const Field& f : decode_message(data)) {
    if (f.number == 1 && f.wire == 1)
      std::memcpy(&ev.wall_time, &f.varint, 8);
    else if (f.number == 2 && f.wire == 0)
      ev.step = static_cast<int64_t>(f.varint);
    else if (f.number == 3 && f.wire == 2)
      ev.file_version = f.bytes;
    else if (f.number == 5 && f.wire == 2) {
      for (const Field& v : decode_message(f.bytes)) {
        EXPECT_EQ(v.number, 1u);
        std::pair<std::string, float> tv{"", NAN};
        for (const Field& g : decode_message(v.bytes)) {
          if (g.number == 1 && g.wire == 2) tv.first = g.bytes;
          if (g.number == 2 && g.wire == 5) std::memcpy(&tv.second, &g.varint, 4);
        }
        ev.values.push_back(tv);
      }
    } else
      ADD_FAILURE() << "unexpected Event field " << f.number;
  }
  return ev;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& de : fs::directory_iterator(dir))
    if (de.path().filename().string().rfind("events.out.tfevents.", 0) == 0) out.push_back(de.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(TensorBoard, WrittenScalarsReadBack) {
  const std::string dir = temp_dir("tb");
  const double before = std::floor(static_cast<double>(std::time(nullptr)));
  std::string path;
  {
    io::TensorBoardWriter w(dir + "/run_1", "", /*flush_every=*/1000);
    path = w.path();
    w.add_scalar("lm loss", 1, 2.5);
    w.add_scalar("learning-rate", 2, 1e-4);
    w.add_scalar("grad-norm", 0,
                 0.0);  // step 0 and value 0 are proto3 defaults; the value must still be there
    w.add_scalar("lm loss", -3, -0.125);
    w.add_scalars(4, {{"lm loss", 1.75}, {"lm loss vs samples", 1.75}});
    w.flush();
    EXPECT_EQ(read_records(io::read_file(path)).size(), 6u);
  }  // the destructor closes the file
  ASSERT_EQ(event_files(dir + "/run_1"), std::vector<std::string>{path});
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string name = fs::path(path).filename().string();
  EXPECT_EQ(name.size(), std::string("events.out.tfevents.").size() + 10 + 1 + std::strlen(host)) << name;
  EXPECT_EQ(name.substr(name.size() - std::strlen(host)), host);

  const auto records = read_records(io::read_file(path));
  ASSERT_EQ(records.size(), 6u);
  const DecodedEvent first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_GE(first.wall_time, before);
  EXPECT_LE(first.wall_time, before + 600);
  EXPECT_EQ(std::stoll(name.substr(20, 10)), static_cast<long long>(first.wall_time));

  struct Expect {
    int64_t step;
    std::vector<std::pair<std::string, float>> values;
  };
  const std::vector<Expect> expect = {{1, {{"lm loss", 2.5f}}},
                                      {2, {{"learning-rate", 1e-4f}}},
                                      {0, {{"grad-norm", 0.0f}}},
                                      {-3, {{"lm loss", -0.125f}}},
                                      {4, {{"lm loss", 1.75f}, {"lm loss vs samples", 1.75f}}}};
  for (size_t i = 0; i < expect.size(); ++i) {
    const DecodedEvent ev = decode_event(records[i + 1]);
    EXPECT_EQ(ev.step, expect[i].step) << i;
    EXPECT_EQ(ev.values, expect[i].values) << i;
    EXPECT_GE(ev.wall_time, first.wall_time) << i;
    EXPECT_TRUE(ev.file_version.empty());
  }
  fs::remove_all(dir);
}

TEST(TensorBoard, WritersStartedInTheSameSecondGetDistinctFiles) {
  const std::string dir = temp_dir("tb_two");
  io::TensorBoardWriter a(dir), b(dir), c(dir, ".suffix");
  EXPECT_NE(a.path(), b.path());
  EXPECT_NE(b.path(), c.path());
  EXPECT_EQ(c.path().substr(c.path().size() - 7), ".suffix");
  a.add_scalar("x", 1, 1.0);
  b.add_scalar("x", 1, 2.0);
  a.flush();
  b.flush();
  EXPECT_EQ(read_records(io::read_file(a.path())).size(), 2u);
  EXPECT_EQ(decode_event(read_records(io::read_file(b.path()))[1]).values.at(0).second, 2.0f);
  fs::remove_all(dir);
}

// The real reader: scripts/test.sh installs `tensorboard` into a test-time virtual environment
// (build/test-venv) and exports its interpreter as MOECORE_TEST_PYTHON. Unset (one binary run by hand), the
// test skips; set, an interpreter without `tensorboard` is a failure, not a skip.
TEST(TensorBoard, PythonTensorboardReadsOurFiles) {
  const char* python_env = std::getenv("MOECORE_TEST_PYTHON");
  if (!python_env || !*python_env)
    GTEST_SKIP() << "MOECORE_TEST_PYTHON is unset: scripts/test.sh sets it to a Python with `tensorboard`";
  ASSERT_EQ(std::string(python_env).find('\''), std::string::npos) << "MOECORE_TEST_PYTHON=" << python_env;
  const std::string python = std::string("'") + python_env + "'";
  ASSERT_EQ(std::system((python + " -c 'import tensorboard'").c_str()), 0)
      << "MOECORE_TEST_PYTHON=" << python_env << " cannot import `tensorboard` (pip install tensorboard)";
  const std::string dir = temp_dir("tb_py");
  {
    io::TensorBoardWriter w(dir);
    w.add_scalar("lm loss", 1, 2.5);
    w.add_scalar("lm loss", 2, 0.125);
    w.add_scalar("grad-norm", 2, 0.0);
  }
  const std::string script = dir + "/read.py", out = dir + "/out.txt";
  std::ofstream(script) << "import sys\n"
                           "from tensorboard.backend.event_processing import event_accumulator as ea\n"
                           "acc = ea.EventAccumulator(sys.argv[1]); acc.Reload()\n"
                           "with open(sys.argv[2], 'w') as f:\n"
                           "    for tag in sorted(acc.Tags()['scalars']):\n"
                           "        for e in acc.Scalars(tag): f.write(f'{tag}|{e.step}|{e.value:.9g}\\n')\n";
  ASSERT_EQ(std::system((python + " " + script + " " + dir + " " + out).c_str()), 0);
  EXPECT_EQ(io::read_file(out), "grad-norm|2|0\nlm loss|1|2.5\nlm loss|2|0.125\n");
  fs::remove_all(dir);
}

// ---- JSONL ----

TEST(JsonlMetrics, OneObjectPerLineAppendedAndReadBack) {
  const std::string dir = temp_dir("jsonl");
  const std::string path = dir + "/logs/metrics.jsonl";
  {
    io::JsonlMetricsWriter w(path);
    w.write({{"iteration", int64_t{1}}, {"lm loss", 0.1 + 0.2}, {"phase", std::string("train")}});
    // Flushed per line: visible before the writer is closed.
    EXPECT_EQ(io::read_file(path), "{\"iteration\":1,\"lm loss\":0.30000000000000004,\"phase\":\"train\"}\n");
    w.write({{"iteration", int64_t{2}}, {"lm loss", NAN}, {"grad-norm", INFINITY}});
  }
  {
    io::JsonlMetricsWriter w(path);  // a resumed run appends
    w.write({{"iteration", int64_t{3}}, {"lm loss", 1e-300}, {"note", std::string("quote \" and \n newline")}});
  }
  std::ifstream f(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["iteration"].get<int64_t>(), 1);
  EXPECT_EQ(lines[0]["lm loss"].get<double>(), 0.1 + 0.2);  // round-trip precision
  EXPECT_EQ(lines[0]["phase"], "train");
  EXPECT_TRUE(lines[1]["lm loss"].is_null());
  EXPECT_TRUE(lines[1]["grad-norm"].is_null());
  EXPECT_EQ(lines[2]["iteration"].get<int64_t>(), 3);
  EXPECT_EQ(lines[2]["lm loss"].get<double>(), 1e-300);
  EXPECT_EQ(lines[2]["note"], "quote \" and \n newline");
  fs::remove_all(dir);
}

TEST(JsonlMetrics, UnwritablePathIsAnError) {
  const std::string dir = temp_dir("jsonl_bad");
  fs::create_directories(dir);
  io::write_file_atomic(dir + "/file", "x");
  try {
    io::JsonlMetricsWriter w(dir + "/file/metrics.jsonl");
    ADD_FAILURE() << "opened a path below a regular file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/file"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moecore
