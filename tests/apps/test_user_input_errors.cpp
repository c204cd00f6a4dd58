// User input that reached an internal check, a library's raw error or a hang instead of a message (issue 27,
// defects 7 and 9), run as a user would: environment variables checked like flags, sample counts no memory holds,
// --max-shard-size, duplicate --json-keys, an empty prompt, a null dtype in config.json, FIFOs where files belong,
// and errors naming the flag the user typed. Each error must exit 1, name the flag, variable or key, and show no
// raw library text.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/cli_support.h"
#include "moecore/io/safetensors.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;
using testing::run_moecore;
using testing::run_shell;

#define EXPECT_HAS(out, part) \
  EXPECT_NE((out).find(part), std::string::npos) << "missing '" << (part) << "' in:\n" << (out)
#define EXPECT_LACKS(out, part) EXPECT_EQ((out).find(part), std::string::npos) << "'" << (part) << "' in:\n" << (out)

// What a user error must look like: exit status 1, the name the user typed, no raw library or check text.
void expect_user_error(const CmdResult& r, const std::string& name, const std::string& what) {
  EXPECT_EQ(r.status, 1) << what << ":\n" << r.output;
  EXPECT_HAS(r.output, name);
  for (const char* raw :
       {"std::bad_alloc", "[json.exception", "tensor.slice", "check failed", "check `", "internal error"})
    EXPECT_LACKS(r.output, raw);
}

class UserInputErrors : public testing::CliScratch {
 protected:
  UserInputErrors() : CliScratch("user_input") {}
  // A FIFO at `name`: nothing ever writes into it or reads from it, so a reader or writer that opened it
  // blocking would wait forever (the command runs under `timeout`, which only keeps a regression from hanging the
  // suite).
  std::string fifo(const std::string& name) const {
    EXPECT_EQ(::mkfifo(p(name).c_str(), 0644), 0) << name;
    return p(name);
  }
};

CmdResult run_bounded(const std::string& args, const std::string& env = "") {
  return run_shell(env + " timeout 120 " + std::string(MOECORE_BINARY) + " " + args);
}

// Defect 7: MOECORE_COMM_TIMEOUT_S=-5 switched the collective timeout off (and overrode
// --distributed-timeout-minutes), so a stopped rank hung the job; every moecore variable is now checked like a flag,
// in every run (one process too), naming the variable and what it accepts.
TEST_F(UserInputErrors, EnvironmentVariablesAreCheckedLikeFlags) {
  byte_corpus();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"MOECORE_COMM_TIMEOUT_S=-5", "[0, 60000000]"},
      {"MOECORE_COMM_TIMEOUT_S=nan", "[0, 60000000]"},
      {"MOECORE_COMM_TIMEOUT_S=inf", "[0, 60000000]"},
      {"MOECORE_COMM_TIMEOUT_S=1e999", "[0, 60000000]"},
      {"MOECORE_COMM_TIMEOUT_S=10min", "[0, 60000000]"},
      {"MOECORE_COMM_TIMEOUT_S=", "[0, 60000000]"},
      {"MOECORE_COMM_PROGRESS_THREAD=2", "set 1"},
      {"MOECORE_COMM_DEBUG=maybe", "set 1"},
      {"MOECORE_CUDA_SYNC=yes-please", "set 1"},
      {"MOECORE_CPU_ISA=avx3", "avx2 or avx512"},
      {"MOECORE_CPU_BF16_GEMM=amx", "native or widened"},
      {"MOECORE_CPU_BF16_GEMM=native ONEDNN_MAX_CPU_ISA=AVX2", "lacks"}};
  for (const auto& [env, accepted] : cases) {
    const CmdResult r = run_bounded(train_args(), env);
    const std::string name = env.substr(0, env.find('='));
    expect_user_error(r, name, env);
    EXPECT_HAS(r.output, accepted);
    EXPECT_LACKS(r.output, "iteration ");  // refused before training
  }
  // 0 keeps its documented meaning (wait forever); a plain number of seconds is fine.
  for (const char* env : {"MOECORE_COMM_TIMEOUT_S=0", "MOECORE_COMM_TIMEOUT_S=30.5", "MOECORE_COMM_PROGRESS_THREAD=0",
                          "MOECORE_CPU_ISA=avx2", "MOECORE_CPU_BF16_GEMM=widened"}) {
    const CmdResult r = run_bounded(train_args(), env);
    EXPECT_EQ(r.status, 0) << env << ":\n" << r.output;
  }
}

#ifdef MOECORE_HAVE_MPI
// Under mpirun, where the variable matters, every rank refuses it before any collective.
TEST_F(UserInputErrors, NegativeCommTimeoutIsRefusedOnEveryRank) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  byte_corpus();
  const CmdResult r = run_shell("MOECORE_COMM_TIMEOUT_S=-5 timeout 300 env " + testing::mpirun_command(2) +
                                std::string(MOECORE_BINARY) + " " + train_args());
  EXPECT_NE(r.status, 0) << r.output;
  size_t n = 0;
  for (size_t k = r.output.find("MOECORE_COMM_TIMEOUT_S='-5'"); k != std::string::npos;
       k = r.output.find("MOECORE_COMM_TIMEOUT_S='-5'", k + 1))
    ++n;
  EXPECT_EQ(n, 2u) << r.output;
  EXPECT_LACKS(r.output, "iteration ");
}
#endif

// Defect 9 (d), (e): the data's sample indices hold every sample of the run (as Megatron's), so counts no memory
// holds ended in std::bad_alloc, or after billions of loop turns in "4399230135 epochs needed". They are refused
// before the data is read, naming the flags.
TEST_F(UserInputErrors, SampleCountsNoMemoryHoldsAreRefusedNamingTheFlags) {
  byte_corpus();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--global-batch-size 1000000000", "--global-batch-size 1000000000"},
      {"--eval-iters 1000000000", "--eval-iters 1000000000"},
      {"--train-iters 1000000000000", "--train-iters 1000000000000"},
      {"--train-iters 1000000000000 --global-batch-size 1000000000", "--train-iters 1000000000000"},
      {"--eval-iters 1000000000000 --eval-interval 1 --global-batch-size 1000000", "--eval-iters"}};
  for (const auto& [flags, name] : cases) {
    const CmdResult r = run_bounded(train_args() + flags);
    expect_user_error(r, name, flags);
    EXPECT_LACKS(r.output, "epochs needed");
    EXPECT_LACKS(r.output, "iteration ");
  }
}

// Defect 9 (c): --max-shard-size below 1 byte reached an internal check of the writer, 2^64 bytes and more were
// undefined behaviour, and "1.2.3MB" was read as 1.2 MB. It is parsed strictly, up front, naming the flag.
TEST_F(UserInputErrors, MaxShardSizeIsParsedStrictly) {
  for (const char* bad : {"1.2.3MB", "0.5", "0", "0.1B", "-1", "1e3", "5 GB", "5gb", "5TB", ".", "MB",
                          "99999999999999999999GB", "18446744073709551616", "2048GiB"}) {
    const CmdResult r =
        run_moecore("convert --load " + p("none") + " --to-hf " + p("out") + " --max-shard-size '" + bad + "'");
    expect_user_error(r, "--max-shard-size", bad);
    EXPECT_HAS(r.output, std::string("'") + bad + "'");
  }
  for (const char* good : {"1", "1.5KB", "500MB", "2GiB", "1024GiB"}) {  // accepted: the missing --load fails next
    const CmdResult r =
        run_moecore("convert --load " + p("none") + " --to-hf " + p("out") + " --max-shard-size " + good);
    EXPECT_EQ(r.status, 1) << good << ":\n" << r.output;
    EXPECT_LACKS(r.output, "--max-shard-size");
  }
}

// Defect 9 (f): a key given twice to --json-keys wrote the same .bin twice and left it without its .idx.
TEST_F(UserInputErrors, DuplicateJsonKeysAreRefusedBeforeWriting) {
  {
    std::ofstream f(p("docs.jsonl"));
    f << "{\"text\": \"one\", \"title\": \"a\"}\n{\"text\": \"two\", \"title\": \"b\"}\n";
  }
  const CmdResult r = run_moecore("preprocess --input " + p("docs.jsonl") + " --output-prefix " + p("out") +
                                  " --tokenizer-type ByteLevel --json-keys text title text");
  expect_user_error(r, "--json-keys", "duplicate key");
  EXPECT_HAS(r.output, "'text' twice");
  EXPECT_FALSE(fs::exists(p("out_text_document.bin")));
  EXPECT_FALSE(fs::exists(p("out_title_document.bin")));
}

// Defect 9 (a): an empty --prompt reached `tensor.slice [-1, 0)`. It now starts a new document from the
// end-of-document token (unconditional sampling), in `generate` and in train's sample after training.
TEST_F(UserInputErrors, EmptyPromptStartsFromTheEndOfDocumentToken) {
  byte_corpus();
  CmdResult r = run_moecore(train_args() + "--save " + p("ckpt") + " --generate-tokens 4 --prompt ''");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_HAS(r.output, "---- sample ----");
  r = run_moecore("generate --load " + p("ckpt") +
                  " --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
                  "--max-new-tokens 4 --prompt ''");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_LACKS(r.output, "tensor.slice");
}

// Defect 9 (b): "dtype": null in an imported config.json failed only at the export, with nlohmann's raw type
// error. null is transformers' "not given" (the export writes bf16); any other non-name is refused at the import,
// naming the key.
TEST_F(UserInputErrors, ConfigDtypeIsCheckedAtImportAndReadSafelyAtExport) {
  const std::string golden = std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/mixtral";
  const auto hf_dir = [&](const std::string& name, const char* key, const nlohmann::json& value) {
    fs::create_directories(p(name));
    fs::copy_file(golden + "/model.safetensors", p(name) + "/model.safetensors");
    std::ifstream in(golden + "/config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    cfg[key] = value;
    std::ofstream(p(name) + "/config.json") << cfg.dump(2);
    return p(name);
  };
  CmdResult r = run_moecore("convert --from-hf " + hf_dir("null_dtype", "dtype", nullptr) + " --save " + p("ck"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("convert --load " + p("ck") + " --to-hf " + p("ck_hf"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_LACKS(r.output, "[json.exception");
  for (const auto& [key, value] : std::vector<std::pair<const char*, nlohmann::json>>{
           {"dtype", 5}, {"torch_dtype", nlohmann::json::array({"bfloat16"})}, {"dtype", "float64"}}) {
    r = run_moecore("convert --from-hf " + hf_dir(std::string("bad_") + key, key, value) + " --save " + p("bad_ck"));
    expect_user_error(r, std::string("'") + key + "'", value.dump());
    EXPECT_FALSE(fs::exists(p("bad_ck") + "/iter_0000000")) << value.dump();
    fs::remove_all(p(std::string("bad_") + key));
  }
}

// Defect 9 (g): a FIFO given where a file is read (a dataset's .idx or .bin, tokenizer files, --hf-config, --config,
// safetensors) or written (--metrics-jsonl) blocked the open forever. Each is refused naming the file and what it is.
TEST_F(UserInputErrors, FifosWhereFilesBelongAreRefusedNotWaitedOn) {
  byte_corpus();
  fs::copy_file(p("c_text_document.bin"), p("f_text_document.bin"));
  fifo("f_text_document.idx");
  std::string args = train_args();
  args.replace(args.find(p("c_text_document")), p("c_text_document").size(), p("f_text_document"));
  CmdResult r = run_bounded(args);
  expect_user_error(r, p("f_text_document.idx"), ".idx FIFO");
  EXPECT_HAS(r.output, "FIFO");

  fs::copy_file(p("c_text_document.idx"), p("g_text_document.idx"));
  fifo("g_text_document.bin");
  args = train_args();
  args.replace(args.find(p("c_text_document")), p("c_text_document").size(), p("g_text_document"));
  r = run_bounded(args);
  expect_user_error(r, p("g_text_document.bin"), ".bin FIFO");
  EXPECT_HAS(r.output, "FIFO");

  const std::string pipe = fifo("pipe");
  {  // a valid moe-layer case, so that its --inputs is read
    const io::SafetensorsFile g =
        io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/moe_shared_gate.safetensors");
    std::ofstream(p("layer.json")) << g.metadata.at("config");
  }
  for (const std::string& cmd :
       {train_args() + "--metrics-jsonl " + pipe, train_args() + "--hf-config " + pipe,
        "preprocess --input " + p("corpus.jsonl") + " --output-prefix " + p("x") +
            " --tokenizer-type GPT2BPETokenizer --vocab-file " + pipe + " --merge-file " + pipe,
        train_args() + "--config " + pipe, "moe-layer --config " + pipe + " --inputs x --out " + p("y"),
        "moe-layer --config " + p("layer.json") + " --inputs " + pipe + " --out " + p("y")}) {
    r = run_bounded(cmd);
    expect_user_error(r, pipe, cmd);
    EXPECT_HAS(r.output, "FIFO");
  }
  r = run_bounded(train_args() + "--metrics-jsonl " + p("."));
  expect_user_error(r, "--metrics-jsonl", "directory");
  EXPECT_HAS(r.output, "a directory");
  r = run_bounded(train_args() + "--metrics-jsonl /dev/null");  // a character device may be written into
  EXPECT_EQ(r.status, 0) << r.output;
}

// Defect 9 (h): errors about the model's config.json named --hf-config when the user had typed --from-hf, --load-hf
// or --hf.
TEST_F(UserInputErrors, ConfigErrorsNameTheFlagTheUserTyped) {
  byte_corpus();
  fs::create_directories(p("empty_model"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"convert --from-hf " + p("missing") + " --save " + p("ck"), "--from-hf " + p("missing")},
      {"convert --from-hf " + p("empty_model") + " --save " + p("ck"), "--from-hf " + p("empty_model")},
      {"model-step --hf " + p("missing") + " --tokens " + std::string(MOECORE_SOURCE_DIR) +
           "/tests/golden/hf_models/mixtral/tokens.safetensors --out " + p("o"),
       "--hf " + p("missing")},
      {train_args() + "--load-hf " + p("missing"), "--load-hf " + p("missing")},
      {train_args() + "--load-hf " + p("empty_model"), "--load-hf " + p("empty_model")}};
  for (const auto& [cmd, name] : cases) {
    const CmdResult r = run_moecore(cmd);
    expect_user_error(r, name, cmd);
    EXPECT_LACKS(r.output, "--hf-config");
  }
}

}  // namespace
}  // namespace moecore
