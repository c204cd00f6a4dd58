// The start-up memory check and the out-of-memory message (issue 27, defect 6): the limit reader on fake /proc and
// cgroup trees (v1, v2, "max", MemAvailable), a host allocation that fails naming its tensor and the plan, and
// `moecore train` refused at start-up, with its plan and the limit named, instead of being killed without a word,
// inside a memory cgroup where this machine lets the test make one (skipped, saying why, where it does not).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "apps/cli_support.h"
#include "moecore/core/memory.h"
#include "moecore/core/memory_limit.h"
#include "moecore/core/tensor.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;
using testing::run_moecore;
using testing::run_shell;

constexpr int64_t kMiB = int64_t{1} << 20;

// A fake filesystem root for memory_limit(root): /proc files and cgroup folders written by the test.
class MemoryLimitReader : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("moecore_memlimit_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "proc/self");
    write("proc/meminfo", "MemTotal:       16777216 kB\nMemFree:         1048576 kB\nMemAvailable:    8388608 kB\n");
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const std::string& path, const std::string& text) const {
    fs::create_directories((root_ / path).parent_path());
    std::ofstream(root_ / path) << text;
  }
  MemoryLimit limit() const { return memory_limit(root_.string()); }
  static constexpr const char* kV1Mount = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n";
  static constexpr const char* kV2Mount = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n";
  fs::path root_;
};

TEST_F(MemoryLimitReader, MemAvailableAloneIsTheLimit) {
  const MemoryLimit l = limit();
  EXPECT_EQ(l.room, 8192 * kMiB);
  EXPECT_EQ(l.limit, 16384 * kMiB);
  EXPECT_NE(l.describe().find("MemAvailable"), std::string::npos) << l.describe();
}

TEST_F(MemoryLimitReader, NothingReadableIsUnknown) {
  fs::remove(root_ / "proc/meminfo");
  EXPECT_FALSE(limit().known());
}

// v1: the limit less the usage, the inactive page cache counted as free; an ancestor's tighter limit wins.
TEST_F(MemoryLimitReader, CgroupV1LimitLessUsage) {
  write("proc/self/cgroup", "5:cpu,cpuacct:/x\n4:memory:/jobs/run1\n0::/\n");
  write("proc/self/mountinfo", std::string("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n") + kV1Mount);
  const std::string dir = "sys/fs/cgroup/memory/jobs/run1/";
  write(dir + "memory.limit_in_bytes", std::to_string(1024 * kMiB) + "\n");
  write(dir + "memory.usage_in_bytes", std::to_string(300 * kMiB) + "\n");
  write(dir + "memory.stat", "cache 1234\ninactive_file 1\ntotal_inactive_file " + std::to_string(100 * kMiB) + "\n");
  write("sys/fs/cgroup/memory/jobs/memory.limit_in_bytes", "9223372036854771712\n");  // unlimited
  write("sys/fs/cgroup/memory/jobs/memory.usage_in_bytes", std::to_string(5000 * kMiB) + "\n");
  MemoryLimit l = limit();
  EXPECT_EQ(l.room, 824 * kMiB);
  EXPECT_EQ(l.limit, 1024 * kMiB);
  EXPECT_NE(l.name.find("memory cgroup v1 /jobs/run1 (memory.limit_in_bytes)"), std::string::npos) << l.name;

  write("sys/fs/cgroup/memory/jobs/memory.limit_in_bytes", std::to_string(5200 * kMiB) + "\n");  // 200 MiB left
  l = limit();
  EXPECT_EQ(l.room, 200 * kMiB);
  EXPECT_NE(l.name.find("memory cgroup v1 /jobs (memory.limit_in_bytes)"), std::string::npos) << l.name;
}

TEST_F(MemoryLimitReader, CgroupV2MaxLessCurrent) {
  write("proc/self/cgroup", "0::/user.slice/job\n");
  write("proc/self/mountinfo", kV2Mount);
  write("sys/fs/cgroup/user.slice/job/memory.max", std::to_string(2048 * kMiB) + "\n");
  write("sys/fs/cgroup/user.slice/job/memory.current", std::to_string(1024 * kMiB) + "\n");
  write("sys/fs/cgroup/user.slice/job/memory.stat", "anon 5\ninactive_file " + std::to_string(24 * kMiB) + "\n");
  write("sys/fs/cgroup/user.slice/memory.max", "max\n");
  write("sys/fs/cgroup/user.slice/memory.current", "1\n");
  const MemoryLimit l = limit();
  EXPECT_EQ(l.room, 1048 * kMiB);
  EXPECT_EQ(l.limit, 2048 * kMiB);
  EXPECT_NE(l.name.find("memory cgroup v2 /user.slice/job (memory.max)"), std::string::npos) << l.name;
  EXPECT_NE(l.describe().find("1.02 GiB free of the 2.00 GiB limit"), std::string::npos) << l.describe();
}

// "max" everywhere is no limit: the machine's MemAvailable is the tightest.
TEST_F(MemoryLimitReader, CgroupV2MaxIsNoLimit) {
  write("proc/self/cgroup", "0::/job\n");
  write("proc/self/mountinfo", kV2Mount);
  write("sys/fs/cgroup/job/memory.max", "max\n");
  write("sys/fs/cgroup/job/memory.current", std::to_string(1024 * kMiB) + "\n");
  const MemoryLimit l = limit();
  EXPECT_EQ(l.room, 8192 * kMiB);
  EXPECT_NE(l.name.find("MemAvailable"), std::string::npos) << l.name;
}

// A cgroup larger than the machine's available memory: MemAvailable is the tighter.
TEST_F(MemoryLimitReader, TheTighterOfCgroupAndMachineWins) {
  write("proc/self/cgroup", "0::/job\n");
  write("proc/self/mountinfo", kV2Mount);
  write("sys/fs/cgroup/job/memory.max", std::to_string(65536 * kMiB) + "\n");
  write("sys/fs/cgroup/job/memory.current", "0\n");
  EXPECT_EQ(limit().room, 8192 * kMiB);
}

// A host allocation that fails names the tensor (shape, dtype, category), the bytes, the limit and the plan: never a
// bare std::bad_alloc. 2^48 f32 (1 PiB) exceeds any machine's address space.
TEST(HostMemory, OutOfMemoryNamesTheTensorTheLimitAndThePlan) {
  if (testing::kAddressSanitizer)
    GTEST_SKIP() << "AddressSanitizer's allocator aborts on a 1 PiB request instead of failing it";
  const Tensor held = Tensor::zeros({1024}, DType::f32, MemCategory::parameters);
  memory_set_plan("memory plan:\n  parameters       4.0 KiB (a test's plan)\n");
  try {
    Tensor::empty({int64_t{1} << 48}, DType::f32, MemCategory::activations);
    ADD_FAILURE() << "a 1 PiB allocation succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* part :
         {"tensor [281474976710656] f32", "out of host memory allocating 1048576.00 GiB", "of activations",
          "free of the", "moecore holds", "parameters", "the memory plan of this run", "a test's plan", "hint:"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " in: " << m;
  }
  memory_set_plan("");
}

// `moecore train` on a small preprocessed corpus.
class MemoryRun : public testing::CliScratch {
 protected:
  MemoryRun() : CliScratch("memory") {}
  void SetUp() override {
    CliScratch::SetUp();
    byte_corpus();
  }
};

// A refusal at start-up: exit 1 (not a signal), the plan and the limit named, no step taken.
void expect_refused(const CmdResult& r, const std::string& limit_words) {
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("memory plan"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(limit_words), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hint:"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("iteration"), std::string::npos) << "trained before failing: " << r.output;
}

// The reproducer (the default model: 4 layers, H 128, S 128): it grew to 24 GB and was killed after 65 s,
// printing nothing. Its plan (540 GiB, one activation of 24 GiB) is refused at start-up, before it is written.
TEST_F(MemoryRun, HugeMicroBatchIsRefusedWithThePlan) {
  const CmdResult r = run_moecore(train_args() +
                                  "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
                                  "--micro-batch-size 100000");
  expect_refused(r, "free of the");
  EXPECT_NE(r.output.find("activations"), std::string::npos) << r.output;
}

// A child of this process's memory cgroup with a limit (v1 memory.limit_in_bytes, v2 memory.max), removed at the
// end; unavailable() says why none could be made.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(int64_t limit_bytes) {
    std::ifstream cg("/proc/self/cgroup");
    std::string v1, v2;
    for (std::string line; std::getline(cg, line);) {
      const size_t c1 = line.find(':'), c2 = line.find(':', c1 + 1);
      if (c2 == std::string::npos) continue;
      const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
      if (("," + controllers + ",").find(",memory,") != std::string::npos) v1 = line.substr(c2 + 1);
      if (line.rfind("0::", 0) == 0) v2 = line.substr(c2 + 1);
    }
    std::error_code ec;
    const std::string name = "moecore_test_" + std::to_string(::getpid());
    if (!v1.empty() && fs::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes", ec)) {
      dir_ = fs::path("/sys/fs/cgroup/memory") / fs::path(v1).relative_path() / name;
      limit_file_ = "memory.limit_in_bytes";
    } else if (!v2.empty() && fs::exists("/sys/fs/cgroup/cgroup.controllers", ec)) {
      dir_ = fs::path("/sys/fs/cgroup") / fs::path(v2).relative_path() / name;
      limit_file_ = "memory.max";
    } else {
      why_ = "no memory cgroup controller is mounted at /sys/fs/cgroup/memory (v1) or /sys/fs/cgroup (v2)";
      return;
    }
    if (!fs::create_directory(dir_, ec)) {
      why_ = "cannot create the cgroup " + dir_.string() + ": " + (ec ? ec.message() : "it exists");
      dir_.clear();
      return;
    }
    std::ofstream(dir_ / limit_file_) << limit_bytes << "\n";
    std::ifstream back(dir_ / limit_file_);
    int64_t read = 0;
    if (!(back >> read) || read != limit_bytes)
      why_ = "cannot set " + (dir_ / limit_file_).string() + " (not delegated to this process?)";
    else if (const CmdResult r = run_shell(wrap("true")); r.status != 0)
      why_ = "cannot move a process into " + dir_.string() + ": " + r.output;
  }
  ~MemoryCgroup() {
    std::error_code ec;
    if (!dir_.empty()) fs::remove(dir_, ec);  // (rmdir: its processes have exited)
  }
  const std::string& unavailable() const { return why_; }
  // The shell command that runs `command` inside the cgroup.
  std::string wrap(const std::string& command) const {
    return "sh -c 'echo $$ > " + (dir_ / "cgroup.procs").string() + " && exec " + command + "'";
  }
  std::string limit_file() const { return limit_file_; }

 private:
  fs::path dir_;
  std::string limit_file_, why_;
};

// Inside a 256 MiB cgroup (the issue: a 1 GiB cgroup SIGKILLed 4 runs of 4 with no message): a model whose
// parameters alone need more, and a small model with a micro-batch whose activations need more, are both refused
// naming the cgroup's limit; the small model with its usual micro-batch trains.
TEST_F(MemoryRun, InsideAMemoryCgroupTheLimitIsTheCgroups) {
  const MemoryCgroup cg(256 * kMiB);
  if (!cg.unavailable().empty()) GTEST_SKIP() << "no memory cgroup for the test: " << cg.unavailable();
  const std::string bin = std::string(MOECORE_BINARY) + " ";
  const std::string limit = "limit of the memory cgroup";

  CmdResult r = run_shell(cg.wrap(bin + train_args() + "--num-layers 8 --hidden-size 1024 --num-attention-heads 8"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("parameters per rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(limit), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(cg.limit_file()), std::string::npos) << r.output;

  r = run_shell(cg.wrap(bin + train_args() + "--micro-batch-size 4000"));
  expect_refused(r, limit);

  r = run_shell(cg.wrap(bin + train_args()));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("iteration"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace moecore
