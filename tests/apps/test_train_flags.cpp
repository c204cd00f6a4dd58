// The training flags' table (apps/train_flags.cpp): its defaults are TrainConfig's and AdamWConfig's (one source),
// an empty command line reads back exactly those structs, every enum flag accepts its enum's names and refuses
// others naming the flag, the value and the accepted names.
#include "apps/train_flags.h"

#include <string>
#include <vector>

#include "apps/model_flags.h"
#include "moecore/core/enum_names.h"
#include "test_util.h"

namespace moecore {
namespace {

apps::Args train_args() {
  apps::Args a("train");
  model::ModelConfig sizes;  // (the flags Megatron requires default to these)
  sizes.num_layers = 2;
  sizes.hidden_size = 64;
  sizes.num_attention_heads = 4;
  apps::add_model_flags(a, sizes);
  apps::add_training_flags(a);
  return a;
}

apps::Args parsed(std::vector<std::string> words) {
  words.insert(words.begin(), "train");
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  apps::Args a = train_args();
  EXPECT_TRUE(a.parse(static_cast<int>(argv.size()), argv.data()));
  return a;
}

// The default --help shows for `flag`: the second cell of its --list-flags line.
std::string listed_default(const std::string& flags, const std::string& flag) {
  const size_t at = flags.find(flag + "\t");
  if (at == std::string::npos || (at > 0 && flags[at - 1] != '\n')) return "<absent>";
  const size_t kind_end = flags.find('\t', at + flag.size() + 1);
  return flags.substr(kind_end + 1, flags.find('\t', kind_end + 1) - kind_end - 1);
}

TEST(TrainFlags, AnEmptyCommandLineGivesTheStructsDefaults) {
  const apps::Args a = parsed({});
  const auto read = apps::train_flag_fields(apps::train_config_from(a, 1), apps::optimizer_config_from(a));
  const auto defaults = apps::train_flag_fields(train::TrainConfig{}, optim::AdamWConfig{});
  ASSERT_EQ(read.size(), defaults.size());
  EXPECT_GE(read.size(), 60u) << "too few rows fill a field: is the table complete?";
  for (size_t i = 0; i < read.size(); ++i) {
    if (read[i].ruled) continue;  // a Megatron rule changes it after reading (--async-strategy: mcore without a save)
    EXPECT_EQ(read[i].value, defaults[i].value) << read[i].flag;
  }
  // TrainConfig{} is the command line's run: the defaults that depend on the data-parallel size agree at dp 1.
  const train::TrainConfig t = apps::train_config_from(a, 1);
  EXPECT_EQ(t.global_batch_size, train::TrainConfig{}.global_batch_size);
  EXPECT_EQ(t.ddp_bucket_size, train::TrainConfig{}.ddp_bucket_size);
  EXPECT_EQ(t.async_strategy, train::AsyncStrategy::mcore);  // Megatron's validate_args, without --async-save
}

// Each row's --help default is its field's initializer (the 7 defaults TrainConfig and the command line used to
// disagree on among them: --micro-batch-size 8, --train-iters 200, --lr 3e-3, linear decay, --log-interval 100,
// --eval-iters 100, no signal handler).
TEST(TrainFlags, HelpDefaultsAreTheFieldsInitializers) {
  apps::Args a = train_args();
  std::vector<std::string> w = {"train", "--list-flags"};
  std::vector<char*> argv = {w[0].data(), w[1].data()};
  ::testing::internal::CaptureStdout();
  EXPECT_FALSE(a.parse(2, argv.data()));
  const std::string flags = ::testing::internal::GetCapturedStdout();
  for (const auto& f : apps::train_flag_fields(train::TrainConfig{}, optim::AdamWConfig{})) {
    const std::string shown = listed_default(flags, f.flag);
    if (shown.empty()) continue;  // a switch, or Megatron's None (the field holds "unset")
    EXPECT_EQ(shown, f.value) << f.flag;
  }
  const train::TrainConfig t;
  EXPECT_EQ(t.micro_batch_size, 8);
  EXPECT_EQ(t.train_iters, 200);
  EXPECT_FLOAT_EQ(t.lr, 3e-3f);
  EXPECT_EQ(t.lr_decay_style, train::LrDecayStyle::linear);
  EXPECT_EQ(t.log_interval, 100);
  EXPECT_EQ(t.eval_iters, 100);
  EXPECT_FALSE(t.exit_signal_handler);
  EXPECT_EQ(listed_default(flags, "--lr"), "0.003");
  EXPECT_EQ(listed_default(flags, "--lr-decay-style"), "linear");
}

TEST(TrainFlags, EnumFlagsReadTheirNames) {
  const train::TrainConfig t = apps::train_config_from(
      parsed({"--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5", "--lr-wsd-decay-style", "minus_sqrt",
              "--nan-action", "skip", "--timing-log-option", "all", "--dist-ckpt-strictness", "log_all", "--async-save",
              "--use-persistent-ckpt-worker", "--async-strategy", "nvrx"}),
      2);
  EXPECT_EQ(t.lr_decay_style, train::LrDecayStyle::wsd);
  EXPECT_EQ(t.lr_wsd_decay_style, train::WsdDecayStyle::minus_sqrt);
  EXPECT_EQ(t.nan_action, train::NanAction::skip);
  EXPECT_EQ(t.timing_log_option, train::TimingLogOption::all);
  EXPECT_EQ(t.ckpt_strictness, train::CkptStrictness::log_all);
  EXPECT_EQ(t.async_strategy, train::AsyncStrategy::nvrx);
  EXPECT_EQ(t.global_batch_size, 16);                // unset: micro-batch x dp
  EXPECT_STREQ(enum_name(t.lr_decay_style), "WSD");  // the spelling checkpoints and log lines keep
}

TEST(TrainFlags, AnUnknownEnumValueIsRefusedNamingTheAcceptedOnes) {
  std::vector<std::string> w = {"train", "--nan-action", "halt"};
  std::vector<char*> argv = {w[0].data(), w[1].data(), w[2].data()};
  apps::Args a = train_args();
  testing::expect_error([&] { a.parse(3, argv.data()); }, {"--nan-action", "halt", "stop", "skip"});
  testing::expect_error([&] { (void)enum_parse<train::LrDecayStyle>("wsd", "--lr-decay-style"); },
                        {"--lr-decay-style 'wsd' is not one of constant, linear, cosine, WSD"});
  testing::expect_error([&] { (void)enum_parse<train::CkptStrictness>("strict", "--dist-ckpt-strictness"); },
                        {"--dist-ckpt-strictness 'strict'", "assume_ok_unexpected", "ignore_all"});
}

TEST(TrainFlags, AliasesFillOneField) {
  EXPECT_TRUE(apps::train_config_from(parsed({"--override-opt-param-scheduler"}), 1).override_opt_param_scheduler);
  EXPECT_FALSE(
      apps::train_config_from(parsed({"--disable-log-loss-scale-to-tensorboard"}), 1).log_loss_scale_to_tensorboard);
  EXPECT_FALSE(apps::train_config_from(parsed({"--no-load-optim"}), 1).load_optim);
  EXPECT_EQ(apps::train_config_from(parsed({"--async-ckpt-cpu-priority", "40"}), 1).async_ckpt_cpu_priority, 19);
}

// Muon's flags fill TrainConfig::muon with Megatron's defaults; they need --optimizer muon; dist_muon is muon with the
// layer-wise distributed optimizer; an unknown coefficient set is refused at start-up; Lion's betas apply to Lion's
// scalars only.
TEST(TrainFlags, MuonFlags) {
  const train::TrainConfig d = apps::train_config_from(parsed({}), 1);
  EXPECT_EQ(d.optimizer, optim::OptimizerKind::adam);
  EXPECT_FLOAT_EQ(d.muon.momentum, 0.9f);  // (the command line's; Megatron's OptimizerConfig says 0.95)
  EXPECT_FALSE(d.muon.nesterov);
  EXPECT_TRUE(d.muon.split_qkv);
  EXPECT_EQ(d.muon.num_ns_steps, 5);
  EXPECT_EQ(d.muon.coefficient_type, ops::NsCoefficients::quintic);
  EXPECT_EQ(d.muon.scale_mode, optim::MuonScaleMode::spectral);
  EXPECT_FLOAT_EQ(d.muon.extra_scale_factor, 1.0f);
  EXPECT_EQ(d.muon.tp_mode, optim::MuonTpMode::duplicated);
  EXPECT_EQ(d.muon.fp32_matmul_prec, optim::MuonMatmulPrecision::medium);
  EXPECT_EQ(d.muon.scalar_optimizer, optim::ScalarOptimizer::adam);
  const train::TrainConfig t = apps::train_config_from(
      parsed({"--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov", "--muon-no-split-qkv",
              "--muon-num-ns-steps", "7", "--muon-coefficient-type", "cans", "--muon-scale-mode", "unit_rms_norm",
              "--muon-extra-scale-factor", "0.2", "--muon-tp-mode", "distributed", "--muon-fp32-matmul-prec", "high"}),
      1);
  EXPECT_EQ(t.optimizer, optim::OptimizerKind::muon);
  EXPECT_FLOAT_EQ(t.muon.momentum, 0.95f);
  EXPECT_TRUE(t.muon.nesterov);
  EXPECT_FALSE(t.muon.split_qkv);
  EXPECT_EQ(t.muon.num_ns_steps, 7);
  EXPECT_EQ(t.muon.coefficient_type, ops::NsCoefficients::cans);
  EXPECT_EQ(t.muon.scale_mode, optim::MuonScaleMode::unit_rms_norm);
  EXPECT_FLOAT_EQ(t.muon.extra_scale_factor, 0.2f);
  EXPECT_EQ(t.muon.tp_mode, optim::MuonTpMode::distributed);
  EXPECT_EQ(t.muon.fp32_matmul_prec, optim::MuonMatmulPrecision::high);
  const auto error = [](std::vector<std::string> words) {
    return testing::error_of([&] { apps::train_config_from(parsed(words), 1); });
  };
  EXPECT_NE(error({"--muon-momentum", "0.5"}).find("--muon-momentum sets the Muon optimizer, but --optimizer is adam"),
            std::string::npos);
  const train::TrainConfig dist = apps::train_config_from(parsed({"--optimizer", "dist_muon"}), 1);
  EXPECT_EQ(dist.optimizer, optim::OptimizerKind::muon);
  EXPECT_TRUE(dist.use_distributed_optimizer);
  EXPECT_NE(
      error({"--optimizer", "muon", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"})
          .find("--overlap-param-gather with --optimizer muon"),
      std::string::npos);
  std::vector<std::string> w = {"train", "--muon-coefficient-type", "custom"};
  std::vector<char*> argv = {w[0].data(), w[1].data(), w[2].data()};
  apps::Args a = train_args();
  testing::expect_error([&] { a.parse(3, argv.data()); }, {"--muon-coefficient-type", "custom", "quintic", "cans"});
  EXPECT_FLOAT_EQ(d.muon.lion_beta1, 0.95f);
  EXPECT_FLOAT_EQ(d.muon.lion_beta2, 0.98f);
  const train::TrainConfig lion = apps::train_config_from(
      parsed({"--optimizer", "muon", "--muon-scalar-optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99"}),
      1);
  EXPECT_EQ(lion.muon.scalar_optimizer, optim::ScalarOptimizer::lion);
  EXPECT_FLOAT_EQ(lion.muon.lion_beta1, 0.9f);
  EXPECT_FLOAT_EQ(lion.muon.lion_beta2, 0.99f);
  EXPECT_NE(error({"--optimizer", "muon", "--lion-beta1", "0.9"})
                .find("--lion-beta1 0.9 sets Lion, which only --optimizer muon --muon-scalar-optimizer lion uses"),
            std::string::npos);
}

}  // namespace
}  // namespace moecore
