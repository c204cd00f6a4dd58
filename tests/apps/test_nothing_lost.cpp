// Nothing lost, nothing overwritten, nothing silently wrong (issue 27), run as a user would: outputs never replace
// a device, a FIFO, a directory, another user's file or one of the command's own inputs; retention never deletes
// another model's checkpoint; a resume that would drop or ignore tensors, or change the model's math, is an error;
// ranks agree on the iteration they resume from; non-finite models are refused rather than used.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "apps/cli_support.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::CmdResult;
using testing::run_moecore;
using testing::run_shell;

std::string file_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class NothingLost : public testing::CliScratch {
 protected:
  NothingLost() : CliScratch("nothing_lost") {}
  // A copy of a small golden Hugging Face model (DeepSeek-V2-Lite-shaped, 50 tensors) at p("hf").
  void copy_hf_model() const {
    fs::copy(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/deepseek_v2lite", p("hf"),
             fs::copy_options::recursive);
  }
  std::string model_step(const std::string& out) const {
    return "model-step --hf " + p("hf") + " --tokens " + p("hf/tokens.safetensors") + " --out " + out;
  }
};

// ---- 1. Outputs ---------------------------------------------------------------------------------------------

// An output that is one of the command's inputs is refused before anything is written, and the input survives.
TEST_F(NothingLost, AnOutputThatIsAnInputIsRefused) {
  copy_hf_model();
  const std::string weights = file_text(p("hf/model.safetensors"));
  CmdResult r = run_moecore(model_step(p("hf/model.safetensors")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--out " + p("hf/model.safetensors") + " would overwrite the input --hf"), std::string::npos)
      << r.output;
  EXPECT_EQ(file_text(p("hf/model.safetensors")), weights);
  r = run_moecore(model_step(p("hf/tokens.safetensors")));
  EXPECT_NE(r.output.find("would overwrite the input --tokens"), std::string::npos) << r.output;
  // through a hard link too
  fs::create_hard_link(p("hf/model.safetensors"), p("alias.safetensors"));
  r = run_moecore(model_step(p("alias.safetensors")));
  EXPECT_NE(r.output.find("would overwrite the input --hf"), std::string::npos) << r.output;
  EXPECT_EQ(file_text(p("hf/model.safetensors")), weights);
  // moe-layer's --out over its --inputs
  r = run_moecore("moe-layer --config " + p("hf/config.json") + " --inputs " + p("hf/tokens.safetensors") + " --out " +
                  p("hf/tokens.safetensors"));
  EXPECT_NE(r.output.find("would overwrite the input --inputs"), std::string::npos) << r.output;
  // preprocess writing the dataset over its own input
  std::ofstream(p("c_text_document.bin")) << "some text\n";
  r = run_moecore("preprocess --input " + p("c_text_document.bin") + " --input-format text --output-prefix " + p("c") +
                  " --tokenizer-type ByteLevel");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("would overwrite the input --input"), std::string::npos) << r.output;
  EXPECT_EQ(file_text(p("c_text_document.bin")), "some text\n");
  // train's --metrics-jsonl (appended to) over a dataset file
  byte_corpus();
  const std::string idx = file_text(p("c_text_document.idx"));
  r = run_moecore(train_args() + "--metrics-jsonl " + p("c_text_document.idx"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--metrics-jsonl " + p("c_text_document.idx") + " would overwrite the input --data-path"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(file_text(p("c_text_document.idx")), idx);
}

// A character device and a FIFO are written into and stay what they are; a FIFO nobody reads is refused rather
// than waited on; a directory, a dangling link and another user's file are refused; a link is followed.
TEST_F(NothingLost, OutputsNeverReplaceWhatIsNotTheirs) {
  copy_hf_model();
  // A FIFO with a reader: the bytes go through it.
  ASSERT_EQ(::mkfifo(p("fifo").c_str(), 0644), 0);
  CmdResult r = run_shell("cat " + p("fifo") + " > " + p("from_fifo") + " & timeout 120 " +
                          std::string(MOECORE_BINARY) + " " + model_step(p("fifo")) + "; wait");
  EXPECT_EQ(r.status, 0) << r.output;
  struct stat st {};
  ASSERT_EQ(::lstat(p("fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the FIFO was replaced";
  EXPECT_GT(fs::file_size(p("from_fifo")), 1000u);
  // A FIFO without a reader: refused (timeout only guards the suite against the old behaviour, a hang).
  r = run_shell("timeout 120 " + std::string(MOECORE_BINARY) + " " + model_step(p("fifo")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("is a FIFO that no process is reading"), std::string::npos) << r.output;
  ASSERT_EQ(::lstat(p("fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // A character device (this test's own /dev/null, where mknod is allowed).
  if (::mknod(p("null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) {
    r = run_moecore(model_step(p("null")));
    EXPECT_EQ(r.status, 0) << r.output;
    ASSERT_EQ(::lstat(p("null").c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode)) << "the character device was replaced";
  } else {
    std::printf("(no mknod here: the character-device case is not run)\n");
  }
  // A directory.
  fs::create_directories(p("dir"));
  r = run_moecore(model_step(p("dir")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--out: io: output '" + p("dir") + "' is a directory"), std::string::npos) << r.output;
  // A symbolic link: its target is replaced, the link stays.
  std::ofstream(p("target")) << "old";
  fs::create_symlink(p("target"), p("link"));
  r = run_moecore(model_step(p("link")));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::is_symlink(p("link")));
  EXPECT_GT(fs::file_size(p("target")), 1000u);
  // A dangling link.
  fs::create_symlink(p("nowhere/x"), p("dangling"));
  r = run_moecore(model_step(p("dangling")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("is a symbolic link to nothing"), std::string::npos) << r.output;
  // Another user's file (as root, how the README runs moecore, chown works).
  std::ofstream(p("theirs")) << "theirs";
  if (::geteuid() == 0 && ::chown(p("theirs").c_str(), 4242, 4242) == 0) {
    r = run_moecore(model_step(p("theirs")));
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("is a file of user id 4242"), std::string::npos) << r.output;
    EXPECT_EQ(file_text(p("theirs")), "theirs");
  }
  // An HF export onto a link to an empty directory would replace the link: refused before writing.
  fs::create_directories(p("empty"));
  fs::create_directory_symlink(p("empty"), p("empty_link"));
  r = run_moecore("convert --from-hf " + p("hf") + " --save " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("convert --load " + p("ckpt") + " --to-hf " + p("empty_link"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("is a symbolic link"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_symlink(p("empty_link")));
}

// ---- 2. Retention -------------------------------------------------------------------------------------------

// A --save directory that holds another model's checkpoint is refused before the first step; allowed explicitly,
// retention still removes only this model's checkpoints and no save replaces the other model's.
TEST_F(NothingLost, RetentionNeverDeletesAnotherModelsCheckpoint) {
  byte_corpus();
  CmdResult r = run_moecore(train_args() + "--save " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_TRUE(fs::exists(p("ckpt/iter_0000002/COMMIT")));
  const std::string other_model =
      "--hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --train-iters 4 --save-interval 1 ";
  r = run_moecore(train_args() + other_model + "--save " + p("ckpt") + " --keep-last-checkpoints 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--save " + p("ckpt") + " holds " + p("ckpt") +
                          "/iter_0000002, a checkpoint of another "
                          "model (saved with hidden_size = 16 but the model has hidden_size = 32)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find(" iteration "), std::string::npos) << "trained before refusing: " << r.output;
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000002/COMMIT")));
  // Allowed: the other model's iteration 2 is neither replaced (the save of that iteration fails) nor removed.
  r = run_moecore(train_args() + other_model + "--save " + p("ckpt") +
                  " --keep-last-checkpoints 1 --allow-other-models-in-save");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("iter_0000002 is a checkpoint of another model; this save would replace it"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000002/COMMIT")));
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000001/COMMIT")));  // the new model's first save, kept (its newest)
  // Saves that do not collide: both models' checkpoints stay; retention thinned only the new model's.
  fs::remove_all(p("ckpt/iter_0000001"));
  r = run_moecore(train_args() + "--hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --train-iters 5 " +
                  "--save-interval 5 --save " + p("ckpt") + " --keep-last-checkpoints 1 --allow-other-models-in-save");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000002/COMMIT")));
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000005/COMMIT")));
}

// ---- 3. A resume that drops parameters ---------------------------------------------------------------------

// A resume whose flags drop parameters is refused: by the recorded model (the flags change its function). Where the
// weights are taken anyway (--finetune, or a checkpoint without the record) the tensors of the checkpoint that the
// model has no parameter for are named: in a warning under Megatron's default --dist-ckpt-strictness
// (assume_ok_unexpected: Megatron ignores them), as an Error under raise_all -- never a smaller model without a word.
TEST_F(NothingLost, AResumeThatWouldDropTensorsIsAnError) {
  byte_corpus();
  const std::string base = train_args() + "--position-embedding-type learned_absolute ";
  CmdResult r = run_moecore(base + "--save " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string resume =
      "--load " + p("ckpt") + " --save " + p("ckpt") + " --train-iters 3 --override-opt_param-scheduler ";
  r = run_moecore(train_args() + resume + "--position-embedding-type rope");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("position_embedding_type \"learned_absolute\" (checkpoint) vs \"rope\" (this run)"),
            std::string::npos)
      << r.output;
  r = run_moecore(train_args() + resume + "--position-embedding-type rope --finetune --dist-ckpt-strictness raise_all");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("holds 1 tensor that this model has no parameter for:\n  model.safetensors: "
                          "embedding.position_embeddings.weight"),
            std::string::npos)
      << r.output;
  const std::string elsewhere = "--load " + p("ckpt") + " --save " + p("finetuned") + " --train-iters 3 ";
  r = run_moecore(train_args() + elsewhere + "--position-embedding-type rope --finetune");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("holds 1 tensor that this model has no parameter for, not loaded (--dist-ckpt-strictness "
                          "raise_all refuses them):\n  model.safetensors: embedding.position_embeddings.weight"),
            std::string::npos)
      << r.output;
  r = run_moecore(base + resume + "--disable-bias-linear");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("add_bias_linear true (checkpoint) vs false (this run)"), std::string::npos) << r.output;
  r = run_moecore(base + resume + "--disable-bias-linear --finetune --dist-ckpt-strictness raise_all");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("model.safetensors: decoder.layers.0.self_attention.linear_qkv.bias"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(p("ckpt/iter_0000003"))) << r.output;
  // The same flags resume.
  r = run_moecore(base + resume);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(p("ckpt/iter_0000003/COMMIT")));
}

// The other way round: the model asks for tensors the checkpoint lacks (Megatron's "unexpected" keys). Megatron's
// default (assume_ok_unexpected) and the raise modes refuse the load naming the tensor; log_unexpected, log_all,
// return_* and ignore_all load the rest and leave those parameters at their initial values, named in a warning.
TEST_F(NothingLost, AResumeLackingTensorsFollowsTheStrictness) {
  byte_corpus();
  CmdResult r = run_moecore(train_args() + "--disable-bias-linear --save " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string finetune = "--load " + p("ckpt") + " --save " + p("finetuned") + " --train-iters 3 --finetune ";
  for (const char* mode : {"", "--dist-ckpt-strictness raise_unexpected", "--dist-ckpt-strictness raise_all"}) {
    r = run_moecore(train_args() + finetune + mode);
    EXPECT_EQ(r.status, 1) << mode << "\n" << r.output;
    EXPECT_NE(r.output.find("has no tensor 'decoder.layers.0.self_attention.linear_qkv.bias'"), std::string::npos)
        << mode << "\n"
        << r.output;
  }
  EXPECT_FALSE(fs::exists(p("finetuned/iter_0000003")));
  for (const char* mode : {"log_unexpected", "log_all", "return_all", "ignore_all"}) {
    r = run_moecore(train_args() + finetune + "--dist-ckpt-strictness " + mode);
    EXPECT_EQ(r.status, 0) << mode << "\n" << r.output;
    EXPECT_NE(r.output.find("tensors this model has (Megatron's unexpected keys), left at their initial values, "
                            "moments zero (--dist-ckpt-strictness " +
                            std::string(mode)),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("model.safetensors: decoder.layers.0.self_attention.linear_qkv.bias"), std::string::npos)
        << r.output;
  }
  EXPECT_TRUE(fs::exists(p("finetuned/iter_0000003/COMMIT")));
}

// ---- 5. The recorded model ---------------------------------------------------------------------------------

// Flags that change the model's function are compared with the checkpoint's record on resume (an Error listing each)
// and on generate; --finetune continues from the weights with a note. (The export of the trained model's config.json:
// HfModels.ExportWritesTheTrainedModelsConfig.)
TEST_F(NothingLost, FlagsThatChangeTheMathAreComparedWithTheCheckpoint) {
  byte_corpus();
  const std::string moe = train_args() + "--num-experts 4 --moe-router-topk 2 ";
  CmdResult r = run_moecore(moe + "--save " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string resume = "--load " + p("ckpt") + " --train-iters 3 --override-opt_param-scheduler ";
  r = run_moecore(train_args() + "--num-experts 4 --moe-router-topk 3 --norm-epsilon 1e-6 " + resume);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("was trained with settings that change what the model computes from its weights"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("moe_router_topk 2 (checkpoint) vs 3 (this run)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("norm_epsilon "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
  r = run_moecore(train_args() + "--num-experts 4 --moe-router-topk 3 --finetune " + resume);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint: note: "), std::string::npos) << r.output;
  // Training-only settings may change on resume.
  r = run_moecore(moe + resume + "--hidden-dropout 0.2 --moe-aux-loss-coeff 0.1 --moe-expert-capacity-factor 2");
  EXPECT_EQ(r.status, 0) << r.output;
  // generate with flags of another model is refused rather than run as a different model.
  r = run_moecore("generate --load " + p("ckpt") +
                  " --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 "
                  "--seq-length 16 --max-new-tokens 5 --num-experts 4 --moe-router-topk 3");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("moe_router_topk 2 (checkpoint) vs 3 (this run)"), std::string::npos) << r.output;
}

// ---- 4. Ranks agree on the iteration -------------------------------------------------------------------------

#ifdef MOECORE_HAVE_MPI
// One node's view of --load has a stale tracker (here: rank 1 sees an older copy of the directory, bind-mounted over
// it in its own mount namespace): every rank fails before loading, naming each rank's iteration, instead of the ranks
// training different states until MPI_ERR_TRUNCATE or a hang.
TEST_F(NothingLost, RanksThatDisagreeOnTheResumeIterationFailNamingEach) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "mpirun not found";
  if (run_shell("unshare -m sh -c 'mount --bind / /mnt'").status != 0)
    GTEST_SKIP() << "no private mount namespaces here (unshare -m, mount --bind): one node's stale view of --load "
                    "cannot be made on one machine";
  byte_corpus();
  CmdResult r = run_moecore(train_args() + "--save-interval 1 --save " + p("ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  fs::copy(p("ckpt"), p("stale"), fs::copy_options::recursive);
  std::ofstream(p("stale/latest_checkpointed_iteration.txt")) << "1";
  const std::string run = std::string(MOECORE_BINARY) + " " + train_args() + "--train-iters 4 --load " + p("ckpt");
  const std::string script = "if [ $OMPI_COMM_WORLD_RANK = 1 ]; then exec unshare -m sh -c \"mount --bind " +
                             p("stale") + " " + p("ckpt") + " && exec " + run + "\"; else exec " + run + "; fi";
  r = run_shell("MOECORE_COMM_TIMEOUT_S=120 timeout 300 env " + testing::mpirun_command(2) + "sh -c '" + script + "'");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the ranks do not agree on the checkpoint to resume from under --load " + p("ckpt")),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 0 (host "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("): iteration 2 (" + p("ckpt") + "/iter_0000002)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("): iteration 1 (" + p("ckpt") + "/iter_0000001)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loaded checkpoint"), std::string::npos) << r.output;
}
#endif

// ---- 8. Non-finite models ---------------------------------------------------------------------------------

// --nan-action skip logs each skipped step as skipped (no grad norm of 0.0 for a step that never happened) and
// stops after kMaxConsecutiveSkippedSteps (10) in a row instead of "training" a NaN model to the end; generate refuses
// a checkpoint whose logits are not finite, naming it, instead of sampling text from NaN.
TEST_F(NothingLost, NonFiniteModelsAreRefusedNotUsed) {
  byte_corpus();
  const std::string diverge = "--lr 1e38 --clip-grad 0 ";  // the first update overflows the weights to inf
  CmdResult r = run_moecore(train_args() + diverge + "--train-iters 40 --nan-action skip --save " + p("skip"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("training: 10 consecutive steps skipped under --nan-action skip (iterations 2 to 11; the "
                          "last: non-finite value in lm loss)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(" iteration 11: non-finite value in lm loss, step skipped"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("grad norm - (step skipped)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("skipped iterations 1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("grad norm 0.000"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("iteration     12/"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("skip/iter_0000040"))) << r.output;
  // A checkpoint of NaN weights (saved without the NaN check) gives no text.
  r = run_moecore(train_args() + diverge + "--train-iters 3 --no-check-for-nan-in-loss-and-grad --save " + p("nan"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_moecore("generate --load " + p("nan") +
                  " --tokenizer-type ByteLevel --num-layers 1 --hidden-size 16 --num-attention-heads 2 "
                  "--seq-length 16 --max-new-tokens 5");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("generate: the model's logits are not finite (NaN or Inf) at generated token 1"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(checkpoint " + p("nan") + "/iter_0000003)"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace moecore
