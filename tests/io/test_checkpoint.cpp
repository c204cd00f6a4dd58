// Checkpoint directories: round trip, the tracker file, discovery (several iterations, uncommitted and
// damaged directories, rewound runs, --ckpt-step), keep-last-N retention and the removal of unfinished saves,
// and verified loading that names the file and the reason for each corruption (missing marker, flipped byte,
// truncation, missing file, bad magic) and lists the committed alternatives. Damaged newest checkpoints are
// never silently replaced by older ones. The write-fault hook's parser (the hook itself: tests/apps). The background
// writer of asynchronous saves (io/checkpoint_worker.h), whose files commit like any other rank's.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "moecore/io/checkpoint.h"
#include "moecore/io/checkpoint_worker.h"
#include "moecore/io/crc32c.h"
#include "moecore/io/file_util.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, so ctest may run the cases in parallel.
class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ =
        (fs::temp_directory_path() / ("moecore_ckpt_" + std::string(info->name()) + "_" + std::to_string(::getpid())))
            .string();
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string dir(int64_t it) const { return io::checkpoint_iteration_dir(root_, it); }
  std::string root_;
};

io::CheckpointWriteRequest make_request(int64_t iteration) {
  io::CheckpointWriteRequest r;
  r.iteration = iteration;
  const uint64_t seed = static_cast<uint64_t>(iteration) + 1;
  r.files["model.safetensors"] = {{"decoder.w", testing::randn({4, 3}, "w", 1.0f, seed)},
                                  {"decoder.b", testing::randn({3}, "b", 1.0f, seed).to(DType::bf16)}};
  r.files["optimizer.safetensors"] = {{"exp_avg.decoder.w", testing::randn({4, 3}, "m", 1.0f, seed)},
                                      {"step", Tensor::zeros({}, DType::i64)}};
  r.state_json = R"({"iteration": )" + std::to_string(iteration) + R"(, "consumed_samples": 1024})";
  return r;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

// Runs fn, expects an Error whose message contains every one of `parts`; returns the message.
std::string expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return msg;
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

void overwrite(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::vector<std::string> names_in(const std::string& root) {
  std::vector<std::string> out;
  for (const auto& de : fs::directory_iterator(root)) out.push_back(de.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(Checkpoint, RoundTripsTensorsAndState) {
  const auto req = make_request(200);
  io::checkpoint_save(root_, req, 0);
  const auto latest = io::checkpoint_find_latest(root_);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, dir(200));
  EXPECT_EQ(fs::path(*latest).filename(), "iter_0000200");
  const io::LoadedCheckpoint ck = io::checkpoint_load(*latest);
  EXPECT_EQ(ck.iteration, 200);
  EXPECT_EQ(ck.dir, *latest);
  EXPECT_EQ(ck.state_json, req.state_json);
  ASSERT_EQ(ck.files.size(), req.files.size());
  for (const auto& [file, tensors] : req.files) {
    const auto& got = ck.files.at(file).tensors;
    ASSERT_EQ(got.size(), tensors.size()) << file;
    for (const auto& [name, t] : tensors) EXPECT_TRUE(same_bytes(got.at(name), t)) << file << ": " << name;
  }
  EXPECT_EQ(names_in(*latest),
            (std::vector<std::string>{"COMMIT", "model.safetensors", "optimizer.safetensors", "state.json"}));
}

TEST_F(Checkpoint, CommitRecordsSizeAndCrcOfEveryFile) {
  io::checkpoint_save(root_, make_request(3), 0);
  const auto j = nlohmann::json::parse(io::read_file(dir(3) + "/COMMIT"));
  EXPECT_EQ(j["format"], "moecore-checkpoint");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["iteration"], 3);
  ASSERT_EQ(j["files"].size(), 3u);
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "state.json"}) {
    const std::string bytes = io::read_file(dir(3) + "/" + name);
    EXPECT_EQ(j["files"][name]["bytes"].get<uint64_t>(), bytes.size()) << name;
    char crc[9];
    std::snprintf(crc, sizeof crc, "%08x", io::crc32c(bytes));
    EXPECT_EQ(j["files"][name]["crc32c"], crc) << name;
  }
}

TEST_F(Checkpoint, TrackerFileHoldsTheLastSavedIteration) {
  for (int64_t it : {10, 20, 30}) io::checkpoint_save(root_, make_request(it), 0);
  EXPECT_EQ(io::read_file(root_ + "/latest_checkpointed_iteration.txt"), "30");  // Megatron: str(iteration)
  EXPECT_EQ(io::checkpoint_read_tracker(root_), 30);
  overwrite(root_ + "/latest_checkpointed_iteration.txt", " 20\n");
  EXPECT_EQ(io::checkpoint_read_tracker(root_), 20);
  overwrite(root_ + "/latest_checkpointed_iteration.txt", "release");
  EXPECT_EQ(io::checkpoint_read_tracker(root_), std::nullopt);
}

TEST_F(Checkpoint, FindsTheNewestOfSeveralIterations) {
  EXPECT_EQ(io::checkpoint_find_latest(root_), std::nullopt);  // root does not exist yet
  for (int64_t it : {10, 20, 30}) io::checkpoint_save(root_, make_request(it), 0);
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(30));
  EXPECT_EQ(io::checkpoint_list_committed(root_), (std::vector<int64_t>{10, 20, 30}));
  fs::remove(root_ + "/latest_checkpointed_iteration.txt");  // without a tracker: newest committed
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(30));
  EXPECT_EQ(io::checkpoint_load(*io::checkpoint_find_latest(root_)).iteration, 30);
}

TEST_F(Checkpoint, TrackerWinsOverNewerDirectoriesOfARewoundRun) {
  for (int64_t it : {10, 20, 30}) io::checkpoint_save(root_, make_request(it), 0);
  io::checkpoint_save(root_, make_request(15), 0);  // the run was rewound to 10 and saved again at 15
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(15));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("iter_0000020"), std::string::npos) << err;
  EXPECT_NE(err.find("iter_0000030"), std::string::npos) << err;
}

TEST_F(Checkpoint, IterationDirectoryAsRootIsUsedAsIs) {
  io::checkpoint_save(root_, make_request(10), 0);
  io::checkpoint_save(root_, make_request(20), 0);
  EXPECT_EQ(io::checkpoint_find_latest(dir(10)), dir(10));
  EXPECT_EQ(io::checkpoint_find_latest(dir(10) + "/"), dir(10) + "/");
  EXPECT_EQ(io::checkpoint_load(dir(10) + "/").iteration, 10);
}

TEST_F(Checkpoint, RetentionKeepsTheLastN) {
  io::checkpoint_write_uncommitted(root_, make_request(5));  // never counted; removed as unfinished
  for (int64_t it : {10, 20, 30, 40, 50}) io::checkpoint_save(root_, make_request(it), 2);
  EXPECT_EQ(io::checkpoint_list_committed(root_), (std::vector<int64_t>{40, 50}));
  EXPECT_EQ(names_in(root_),
            (std::vector<std::string>{"iter_0000040", "iter_0000050", "latest_checkpointed_iteration.txt"}));
  io::checkpoint_save(root_, make_request(60), 1);
  EXPECT_EQ(io::checkpoint_list_committed(root_), (std::vector<int64_t>{60}));
  io::checkpoint_save(root_, make_request(70), 0);  // 0 keeps all
  EXPECT_EQ(io::checkpoint_list_committed(root_), (std::vector<int64_t>{60, 70}));
}

TEST_F(Checkpoint, RetentionNeverDeletesTheIterationJustWritten) {
  for (int64_t it : {10, 20, 30}) io::checkpoint_save(root_, make_request(it), 0);
  io::checkpoint_save(root_, make_request(5), 1);  // the oldest by number, but the one being written
  EXPECT_EQ(io::checkpoint_list_committed(root_), (std::vector<int64_t>{5}));
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(5));
}

TEST_F(Checkpoint, CrashBeforeTheMarkerLeavesThePreviousOneSelected) {
  io::checkpoint_save(root_, make_request(10), 0);
  const std::string partial = io::checkpoint_write_uncommitted(root_, make_request(20));
  EXPECT_EQ(partial, dir(20));
  EXPECT_TRUE(fs::exists(partial + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(partial + "/COMMIT"));
  EXPECT_EQ(io::checkpoint_read_tracker(root_), 10);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(10));  // the tracker still names 10
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("iter_0000020"), std::string::npos) << err;
  EXPECT_NE(err.find("COMMIT"), std::string::npos) << err;

  // Without the tracker the newest directory is the candidate: an unfinished one is refused, not skipped.
  const std::string tracker = io::read_file(root_ + "/latest_checkpointed_iteration.txt");
  fs::remove(root_ + "/latest_checkpointed_iteration.txt");
  expect_error([&] { io::checkpoint_find_latest(root_); },
               {partial + "/COMMIT", "missing", "iteration 10", "--ckpt-step 10"});
  EXPECT_EQ(io::checkpoint_find_latest(root_, 10), dir(10));
  overwrite(root_ + "/latest_checkpointed_iteration.txt", tracker);

  expect_error([&] { io::checkpoint_load(partial); }, {partial, "COMMIT", "--ckpt-step 10"});
  io::checkpoint_save(root_, make_request(20), 0);  // the retried save replaces the partial directory
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(20));
  EXPECT_EQ(io::checkpoint_load(dir(20)).iteration, 20);
}

TEST_F(Checkpoint, OnlyUncommittedDirectoriesIsAnErrorNotAFreshStart) {
  io::checkpoint_write_uncommitted(root_, make_request(10));
  expect_error([&] { io::checkpoint_find_latest(root_); },
               {dir(10) + "/COMMIT", "missing", "No other committed checkpoint"});
}

TEST_F(Checkpoint, AbsentOrEmptyRootHasNoCheckpoint) {
  EXPECT_EQ(io::checkpoint_find_latest(root_), std::nullopt);
  fs::create_directories(root_);
  overwrite(root_ + "/notes.txt", "not a checkpoint");
  EXPECT_EQ(io::checkpoint_find_latest(root_), std::nullopt);
  expect_error([&] { io::checkpoint_find_latest(root_, 10); }, {"--ckpt-step 10", "iter_0000010", "does not exist"});
  expect_error([&] { io::checkpoint_find_latest(root_ + "/absent", 10); }, {"--ckpt-step 10", "does not exist"});
}

TEST_F(Checkpoint, FlippedByteIsAChecksumErrorNamingTheFile) {
  io::checkpoint_save(root_, make_request(10), 0);
  const std::string shard = dir(10) + "/model.safetensors";
  std::string bytes = io::read_file(shard);
  bytes[bytes.size() - 3] ^= 0x10;
  overwrite(shard, bytes);
  expect_error([&] { io::checkpoint_load(dir(10)); }, {shard, "checksum mismatch"});
}

TEST_F(Checkpoint, FlippedByteInStateJsonIsCaughtToo) {
  io::checkpoint_save(root_, make_request(10), 0);
  const std::string state = dir(10) + "/state.json";
  std::string bytes = io::read_file(state);
  bytes[1] = 'X';
  overwrite(state, bytes);
  expect_error([&] { io::checkpoint_load(dir(10)); }, {state, "checksum"});
}

TEST_F(Checkpoint, TruncatedShardIsASizeErrorNamingTheFile) {
  io::checkpoint_save(root_, make_request(10), 0);
  const std::string shard = dir(10) + "/optimizer.safetensors";
  const auto size = fs::file_size(shard);
  fs::resize_file(shard, size - 4);
  expect_error([&] { io::checkpoint_load(dir(10)); },
               {shard, "size mismatch", std::to_string(size - 4), std::to_string(size), "truncated"});
}

TEST_F(Checkpoint, MissingFileIsNamed) {
  io::checkpoint_save(root_, make_request(10), 0);
  const std::string shard = dir(10) + "/optimizer.safetensors";
  fs::remove(shard);
  expect_error([&] { io::checkpoint_load(dir(10)); }, {shard, "missing file"});
}

TEST_F(Checkpoint, EveryDamagedFileIsReportedInOneMessage) {
  io::checkpoint_save(root_, make_request(10), 0);
  fs::remove(dir(10) + "/optimizer.safetensors");
  fs::resize_file(dir(10) + "/model.safetensors", 16);
  expect_error([&] { io::checkpoint_load(dir(10)); },
               {"optimizer.safetensors': missing", "model.safetensors': size mismatch"});
}

TEST_F(Checkpoint, BadMagicVersionOrMarkerAreRefused) {
  io::checkpoint_save(root_, make_request(10), 0);
  io::checkpoint_save(root_, make_request(20), 0);
  const std::string commit = dir(20) + "/COMMIT";
  const std::string good = io::read_file(commit);
  auto j = nlohmann::json::parse(good);

  j["format"] = "some-other-format";
  overwrite(commit, j.dump());
  expect_error([&] { io::checkpoint_load(dir(20)); }, {commit, "bad magic", "some-other-format"});
  // The tracker names 20, which is damaged: an error listing 10, never a silent fall back to it.
  expect_error([&] { io::checkpoint_find_latest(root_); }, {commit, "bad magic", "iteration 10", "--ckpt-step 10"});
  EXPECT_EQ(io::checkpoint_find_latest(root_, 10), dir(10));

  j = nlohmann::json::parse(good);
  j["version"] = 2;
  overwrite(commit, j.dump());
  expect_error([&] { io::checkpoint_load(dir(20)); }, {commit, "unsupported version 2"});

  j = nlohmann::json::parse(good);
  j["iteration"] = 21;
  overwrite(commit, j.dump());
  expect_error([&] { io::checkpoint_load(dir(20)); }, {commit, "iteration 21"});

  overwrite(commit, good.substr(0, good.size() / 2));
  expect_error([&] { io::checkpoint_load(dir(20)); }, {commit, "not valid JSON"});

  j = nlohmann::json::parse(good);
  j["files"]["../../etc/passwd"] = {{"bytes", 1}, {"crc32c", "00000000"}};
  overwrite(commit, j.dump());
  expect_error([&] { io::checkpoint_load(dir(20)); }, {commit, "not allowed"});
}

TEST_F(Checkpoint, SavingAnIterationAgainReplacesIt) {
  io::checkpoint_save(root_, make_request(10), 0);
  auto second = make_request(10);
  second.files.erase("optimizer.safetensors");
  second.state_json = R"({"second": true})";
  io::checkpoint_save(root_, second, 0);
  const auto ck = io::checkpoint_load(dir(10));
  EXPECT_EQ(ck.state_json, second.state_json);
  EXPECT_EQ(ck.files.size(), 1u);
  EXPECT_EQ(names_in(root_), (std::vector<std::string>{"iter_0000010", "latest_checkpointed_iteration.txt"}));
}

TEST_F(Checkpoint, StaleStagingDirectoriesAreRemovedByTheNextSave) {
  fs::create_directories(root_ + "/iter_0000007.tmp-99999");
  fs::create_directories(root_ + "/iter_0000007.old-99999");
  overwrite(root_ + "/iter_0000007.tmp-99999/model.safetensors", "partial");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(io::checkpoint_find_latest(root_), std::nullopt);  // never looked at
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  io::checkpoint_save(root_, make_request(10), 0);
  EXPECT_EQ(names_in(root_), (std::vector<std::string>{"iter_0000010", "latest_checkpointed_iteration.txt"}));
}

TEST_F(Checkpoint, ManyShardsPerIteration) {
  io::CheckpointWriteRequest r;
  r.iteration = 12345678;  // more than 7 digits
  for (int rank = 0; rank < 4; ++rank) {
    char name[64];
    std::snprintf(name, sizeof name, "model-rank%05d.safetensors", rank);
    r.files[name] = {{"expert", testing::randn({2, 2}, "e", 1.0f, static_cast<uint64_t>(rank))}};
  }
  io::checkpoint_save(root_, r, 0);
  EXPECT_EQ(io::checkpoint_find_latest(root_), root_ + "/iter_12345678");
  const auto ck = io::checkpoint_load(root_ + "/iter_12345678");
  EXPECT_EQ(ck.files.size(), 4u);
  EXPECT_TRUE(same_bytes(ck.files.at("model-rank00003.safetensors").tensors.at("expert"),
                         r.files.at("model-rank00003.safetensors").at("expert")));
  EXPECT_EQ(ck.state_json, "{}");
}

TEST_F(Checkpoint, BadRequestsAreRejectedBeforeAnythingIsWritten) {
  auto r = make_request(10);
  r.files["sub/model.safetensors"] = {};
  expect_error([&] { io::checkpoint_save(root_, r, 0); }, {"sub/model.safetensors", "plain file name"});
  r = make_request(10);
  r.files["COMMIT"] = {};
  expect_error([&] { io::checkpoint_save(root_, r, 0); }, {"COMMIT", "reserved"});
  r = make_request(10);
  r.state_json = "{not json";
  expect_error([&] { io::checkpoint_save(root_, r, 0); }, {"state_json", "not valid JSON"});
  r = make_request(-1);
  expect_error([&] { io::checkpoint_save(root_, r, 0); }, {"iteration (-1)"});
  expect_error([&] { io::checkpoint_save(root_, make_request(10), -2); }, {"keep_last (-2)"});
  EXPECT_EQ(io::checkpoint_find_latest(root_), std::nullopt);
}

// ---- Regression tests of issue 15 (an outside tester's 65 corrupted checkpoints) ----------------------------

TEST_F(Checkpoint, DamagedNewestCheckpointIsRefusedListingTheOlderOnes) {
  for (int64_t it : {10, 20, 30}) io::checkpoint_save(root_, make_request(it), 0);
  const std::string commit = dir(30) + "/COMMIT";
  std::string bytes = io::read_file(commit);
  bytes[bytes.find("moecore-checkpoint")] ^= 0x20;  // a flipped byte in COMMIT: 'Moecore-checkpoint'
  overwrite(commit, bytes);
  const std::string msg = expect_error([&] { io::checkpoint_find_latest(root_); },
                                       {commit, "bad magic", "iterations 10, 20", "--ckpt-step 20"});
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;  // one line
  EXPECT_EQ(io::checkpoint_find_latest(root_, 20), dir(20));
  EXPECT_EQ(io::checkpoint_load(*io::checkpoint_find_latest(root_, 20)).iteration, 20);
  expect_error([&] { io::checkpoint_find_latest(root_, 30); }, {commit, "--ckpt-step 30", "iterations 10, 20"});
  expect_error([&] { io::checkpoint_find_latest(root_, 25); }, {"iter_0000025", "does not exist"});

  fs::remove(commit);  // a deleted COMMIT
  expect_error([&] { io::checkpoint_find_latest(root_); }, {commit, "missing", "iterations 10, 20"});
  fs::remove(root_ + "/latest_checkpointed_iteration.txt");  // without the tracker: the highest directory
  expect_error([&] { io::checkpoint_find_latest(root_); }, {commit, "missing", "no tracker file"});
}

TEST_F(Checkpoint, DataErrorsOfTheNewestListTheOlderOnes) {
  for (int64_t it : {10, 20}) io::checkpoint_save(root_, make_request(it), 0);
  const std::string shard = dir(20) + "/model.safetensors";
  std::string bytes = io::read_file(shard);
  bytes[bytes.size() - 1] ^= 0x01;
  overwrite(shard, bytes);
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(20));  // COMMIT is fine: the data is checked by the load
  const std::string msg = expect_error([&] { io::checkpoint_load(dir(20)); },
                                       {shard, "checksum mismatch", "iteration 10", "--ckpt-step 10"});
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST_F(Checkpoint, TrackerNamingADamagedOrMissingDirectoryIsAnError) {
  for (int64_t it : {10, 20}) io::checkpoint_save(root_, make_request(it), 0);
  overwrite(root_ + "/latest_checkpointed_iteration.txt", "40");
  expect_error([&] { io::checkpoint_find_latest(root_); },
               {"latest_checkpointed_iteration.txt", "iteration 40", "does not exist", "iterations 10, 20"});
  overwrite(root_ + "/latest_checkpointed_iteration.txt", "x7");
  expect_error([&] { io::checkpoint_find_latest(root_); },
               {"latest_checkpointed_iteration.txt", "does not hold an iteration number", "--ckpt-step 20"});
  overwrite(root_ + "/latest_checkpointed_iteration.txt", "20");
  fs::resize_file(dir(20) + "/COMMIT", 10);  // a truncated COMMIT
  expect_error([&] { io::checkpoint_find_latest(root_); },
               {dir(20) + "/COMMIT", "latest_checkpointed_iteration.txt", "--ckpt-step 10"});
}

TEST_F(Checkpoint, OnlyACommitLeftoverIsAnUnfinishedDirectory) {
  io::checkpoint_save(root_, make_request(10), 0);
  const std::string partial = io::checkpoint_write_uncommitted(root_, make_request(20));
  overwrite(partial + "/COMMIT.tmp.4242", "{\"format\": \"moecore-chec");  // a crash while writing COMMIT
  overwrite(root_ + "/latest_checkpointed_iteration.txt", "20");
  expect_error([&] { io::checkpoint_find_latest(root_); },
               {partial + "/COMMIT", "COMMIT.tmp.4242", "interrupted while committing", "--ckpt-step 10"});
  expect_error([&] { io::checkpoint_load(partial); }, {"COMMIT.tmp.4242", "--ckpt-step 10"});
}

TEST_F(Checkpoint, NextSaveRemovesUnfinishedSavesButNoCommittedDirectory) {
  io::checkpoint_save(root_, make_request(10), 0);
  io::checkpoint_save(root_, make_request(20), 0);
  io::checkpoint_write_uncommitted(root_, make_request(30));  // crashed before its COMMIT
  io::checkpoint_write_uncommitted(root_, make_request(40));
  overwrite(dir(40) + "/COMMIT.tmp.777", "partial");  // crashed while writing its COMMIT
  overwrite(dir(10) + "/COMMIT.tmp.778", "partial");  // a leftover beside a valid COMMIT
  overwrite(root_ + "/latest_checkpointed_iteration.txt.tmp.779", "3");
  fs::create_directories(root_ + "/iter_0000050.tmp-123");
  fs::create_directories(root_ + "/iter_0000005.old-123");
  auto bad = nlohmann::json::parse(io::read_file(dir(20) + "/COMMIT"));
  bad["version"] = 9;  // damaged COMMIT: kept for inspection, never counted
  overwrite(dir(20) + "/COMMIT", bad.dump());
  io::checkpoint_save(root_, make_request(25), 2);
  EXPECT_EQ(names_in(root_), (std::vector<std::string>{"iter_0000010", "iter_0000020", "iter_0000025",
                                                       "latest_checkpointed_iteration.txt"}));
  EXPECT_EQ(names_in(dir(10)),
            (std::vector<std::string>{"COMMIT", "model.safetensors", "optimizer.safetensors", "state.json"}));
  EXPECT_EQ(io::checkpoint_find_latest(root_), dir(25));
  EXPECT_EQ(io::checkpoint_load(dir(10)).iteration, 10);
}

TEST_F(Checkpoint, ManifestParserRejectsHostileValues) {
  const std::string path = "x/COMMIT";
  const auto ok = io::checkpoint_parse_manifest(
      R"({"format":"moecore-checkpoint","version":1,"iteration":3,"files":{"state.json":{"bytes":2,"crc32c":"0000abcd"}}})",
      path, 3);
  EXPECT_EQ(ok.iteration, 3);
  EXPECT_EQ(ok.files.at("state.json").crc32c, 0xabcdu);
  for (
      const char* text :
      {R"({"format":"moecore-checkpoint","version":1,"iteration":-3,"files":{}})",
       R"({"format":"moecore-checkpoint","version":1,"iteration":3.5,"files":{}})",
       R"({"format":"moecore-checkpoint","version":1e400,"iteration":3,"files":{}})",
       R"({"format":"moecore-checkpoint","version":-1,"iteration":3,"files":{}})",
       R"({"format":"moecore-checkpoint","version":1,"iteration":18446744073709551615,"files":{}})",
       R"({"format":"moecore-checkpoint","version":1,"iteration":3,"files":{"state.json":{"bytes":-1,"crc32c":"00000000"}}})",
       R"({"format":"moecore-checkpoint","version":1,"iteration":3,"files":{"state.json":{"bytes":1,"crc32c":"0x000000"}}})",
       R"({"format":"moecore-checkpoint","version":1,"iteration":3,"files":{"..":{"bytes":1,"crc32c":"00000000"}}})",
       R"({"format":"moecore-checkpoint","version":1,"iteration":3,"files":{}})", "[[[[[[[[[[[[[[[[[[[[[[[[[[", "",
       "null", R"({"format":7})"})
    expect_error([&] { io::checkpoint_parse_manifest(text, path, std::nullopt); }, {path});
}

TEST(WriteFault, SpecIsParsedStrictly) {
  const auto f = io::write_fault_parse("model.safetensors:4096:ENOSPC");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->name, "model.safetensors");
  EXPECT_EQ(f->offset, 4096u);
  EXPECT_EQ(f->err, ENOSPC);
  const auto g = io::write_fault_parse("*:0:EIO");
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->name, "*");
  EXPECT_EQ(g->err, EIO);
  EXPECT_EQ(io::write_fault_parse("a:b:7:EIO")->name, "a:b");
  EXPECT_FALSE(io::write_fault_parse("").has_value());
  for (const char* bad : {"model.safetensors", "model.safetensors:12", ":1:EIO", "x:-1:EIO", "x:1:EPERM", "x::EIO",
                          "x:99999999999999999999:EIO"})
    expect_error([&] { io::write_fault_parse(bad); }, {"MOECORE_FAULT_INJECT_WRITE", bad});
}

// The asynchronous saves' writer, in both modes: it writes the serialized files into the staging directory (size and
// CRC32C as the synchronous writer's), the committer commits them like another rank's, and a failure is the first
// file's Error (its path and the errno's text) with nothing listed as written.
TEST_F(Checkpoint, BackgroundWriterFilesCommitAsTheSynchronousOnes) {
  const io::CheckpointWriteRequest req = make_request(3);
  io::checkpoint_save(root_ + "/sync", req, 0);
  for (const bool persistent : {true, false}) {
    SCOPED_TRACE(persistent ? "persistent" : "a thread per job");
    const std::string root = root_ + (persistent ? "/persistent" : "/temporal");
    io::CheckpointWorker worker(persistent);
    for (int64_t it : {3, 4}) {  // two jobs: the persistent thread is reused, the per-job thread replaced
      const std::string staging = io::checkpoint_staging_begin(root, it, "w");
      std::vector<io::CheckpointWorkerFile> files;
      for (const auto& [name, tensors] : req.files)
        files.push_back({name, io::HostBuffer(io::safetensors_serialize(tensors))});
      worker.submit(staging, std::move(files));
      EXPECT_TRUE(worker.busy());
      const io::CheckpointWorkerResult r = worker.take(&files);
      EXPECT_FALSE(worker.busy());
      EXPECT_FALSE(worker.done());
      ASSERT_EQ(r.error, "");
      ASSERT_EQ(r.written.size(), 2u);
      ASSERT_EQ(files.size(), 2u);  // the buffers, handed back for the next snapshot
      EXPECT_EQ(files[0].bytes.view(), io::safetensors_serialize(req.files.at(files[0].name)));
      io::CheckpointWriteRequest commit = req;
      commit.iteration = it;
      commit.files.clear();
      io::checkpoint_staging_commit(root, commit, "w", r.written, 0);
    }
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_EQ(io::read_file(io::checkpoint_iteration_dir(root, 3) + "/" + f),
                io::read_file(io::checkpoint_iteration_dir(root_ + "/sync", 3) + "/" + f))
          << f;
    EXPECT_EQ(io::checkpoint_read_tracker(root), 4);
    EXPECT_NO_THROW(io::checkpoint_load(io::checkpoint_iteration_dir(root, 4)));

    auto two_files = [] {
      std::vector<io::CheckpointWorkerFile> f;
      f.push_back({"a.safetensors", io::HostBuffer("abc")});
      f.push_back({"b.safetensors", io::HostBuffer("def")});
      return f;
    };
    const std::string missing = root + "/no_such_dir";
    worker.submit(missing, two_files());
    const io::CheckpointWorkerResult bad = worker.take();
    EXPECT_TRUE(bad.written.empty());
    EXPECT_NE(bad.error.find(missing + "/a.safetensors"), std::string::npos) << bad.error;
    EXPECT_NE(bad.error.find(std::strerror(ENOENT)), std::string::npos) << bad.error;
    // A job left in flight is waited for by the destructor (the run ends with an Error): no thread outlives it.
    worker.submit(io::checkpoint_staging_begin(root, 9, "w"), two_files());
  }
}

}  // namespace
}  // namespace moecore
