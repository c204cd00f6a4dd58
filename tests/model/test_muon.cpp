// Muon (optim/muon.h) against tools/muon_reference.py's goldens (float64 with f32 products, and Megatron's default
// bf16 products): three steps of the chained Muon + AdamW update on a small MoE model's parameters -- per-expert
// matrices, the QKV weight cut into Q, K and V, the router under Muon, embeddings, output layer, norms and a bias under
// AdamW, the global clip. Which parameters Muon takes; bad settings named. Training with --optimizer muon: the loss
// falls, a resume is bitwise the uninterrupted run (momentum and moments in the checkpoint), a checkpoint of the other
// optimizer is refused naming both, and the memory plan counts Muon's state. Lion as the scalar optimizer
// (--muon-scalar-optimizer lion): its step, resume, checkpoint and plan.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "moecore/io/checkpoint.h"
#include "moecore/io/safetensors.h"
#include "moecore/optim/muon.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/trainer.h"
#include "synthetic_training.h"
#include "test_util.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

struct Golden {
  io::SafetensorsFile f;
  nlohmann::json meta(const std::string& k) const { return nlohmann::json::parse(f.metadata.at(k)); }
  const Tensor& t(const std::string& k) const { return f.tensors.at(k); }
};

class MuonGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(MuonGolden, ThreeStepsMatchTheReference) {
  Golden g{io::safetensors_load(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/muon_steps_" + GetParam() +
                                ".safetensors")};
  optim::MuonConfig mc;
  mc.momentum = g.meta("momentum").get<float>();
  mc.nesterov = g.meta("nesterov").get<bool>();
  mc.split_qkv = g.meta("split_qkv").get<bool>();
  mc.num_ns_steps = g.meta("ns_steps").get<int>();
  mc.coefficient_type = enum_parse<ops::NsCoefficients>(g.meta("coefficients").get<std::string>(), "coefficients");
  mc.scale_mode = enum_parse<optim::MuonScaleMode>(g.meta("scale_mode").get<std::string>(), "scale_mode");
  mc.extra_scale_factor = g.meta("extra_scale_factor").get<float>();
  mc.fp32_matmul_prec = enum_parse<optim::MuonMatmulPrecision>(g.meta("precision").get<std::string>(), "precision");
  optim::AdamWConfig ac;
  ac.beta1 = g.meta("adam_beta1").get<float>();
  ac.beta2 = g.meta("adam_beta2").get<float>();
  ac.eps = g.meta("adam_eps").get<float>();
  ac.weight_decay = g.meta("weight_decay").get<float>();
  ac.clip_grad = g.meta("clip_grad").get<float>();
  const float lr = g.meta("lr").get<float>();
  const int64_t D = g.meta("kv_channels").get<int64_t>(),
                q = g.meta("num_attention_heads").get<int64_t>() / g.meta("num_query_groups").get<int64_t>() * D;

  std::vector<Param> params;
  std::vector<optim::MuonParam> kinds;
  for (const auto& [key, t] : g.f.tensors) {
    if (key.rfind("param.", 0) != 0) continue;
    Param p;
    p.name = key.substr(6);
    p.expert_parallel = p.name.find(".experts.") != std::string::npos;
    p.value = testing::on_test_device(t);
    p.grad = testing::on_test_device(Tensor::zeros(t.shape(), DType::f32));
    p.compute = p.value;
    p.weight_decay = t.dim() >= 2;
    optim::MuonParam k;
    k.managed = optim::muon_managed(p.name, t.dim(), p.expert_parallel);
    if (k.managed && mc.split_qkv && p.name.find("linear_qkv.weight") != std::string::npos) k.pieces = {q, D, D};
    params.push_back(p);
    kinds.push_back(k);
  }
  int managed = 0;
  for (const auto& k : kinds) managed += k.managed;
  EXPECT_EQ(managed, 5);  // qkv, proj, router, the experts' fc1 and fc2
  optim::Muon muon(params, kinds, mc, ac, optim::MuonGroups{});
  // f32 products: the float64 reference within f32 rounding of the update; bf16 products: the reference's own bf16
  // rounding (PyTorch's CPU addmm) against oneDNN's, within bf16's.
  const bool bf16 = mc.fp32_matmul_prec == optim::MuonMatmulPrecision::medium;
  Tensor acc = Tensor::zeros({1}, DType::f64, MemCategory::other, testing::test_device());
  const int steps = std::stoi(g.f.metadata.at("steps"));
  for (int s = 0; s < steps; ++s) {
    for (Param& p : params) p.grad.copy_from(g.t("grad" + std::to_string(s) + "." + p.name));
    const double norm = optim::global_grad_norm(params, acc);
    EXPECT_NEAR(norm, g.t("traj.grad_norm").data<float>()[s], 1e-5 * norm);
    std::map<std::string, Tensor> before;
    for (const Param& p : params) before[p.name] = testing::host(p.value).clone();
    muon.step(lr, norm);
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      SCOPED_TRACE(p.name + " step " + std::to_string(s + 1));
      const Tensor want = g.t("after" + std::to_string(s) + "." + p.name), got = testing::host(p.value);
      // The update of this step, ours against the reference's from the same start.
      Tensor dwant = want.clone(), dgot = got.clone();
      double scale = 0, values = 0;
      for (int64_t e = 0; e < want.numel(); ++e) {
        dwant.data<float>()[e] -= before[p.name].data<float>()[e];
        dgot.data<float>()[e] -= before[p.name].data<float>()[e];
        scale = std::max(scale, std::fabs(double(dwant.data<float>()[e])));
        values = std::max(values, std::fabs(double(want.data<float>()[e])));
      }
      // (plus the f32 rounding of the parameters themselves, which the differences inherit)
      const double tol = !kinds[i].managed ? 1e-6 : bf16 ? 2e-2 : 1e-5;
      EXPECT_TENSOR_NEAR(dgot, dwant, 0.0, tol * scale + 1.2e-7 * values);
      // (from the reference's own start on the next step, so that differences do not compound)
      params[i].value.copy_from(want);
    }
  }
  // The state: a momentum for each Muon matrix, moments for each other parameter.
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(muon.momentum()[i].defined(), kinds[i].managed) << params[i].name;
    EXPECT_EQ(muon.exp_avg()[i].defined(), !kinds[i].managed) << params[i].name;
    EXPECT_EQ(muon.exp_avg_sq()[i].defined(), !kinds[i].managed) << params[i].name;
  }
  EXPECT_EQ(muon.steps_taken(), steps);
}

INSTANTIATE_TEST_SUITE_P(Variants, MuonGolden, ::testing::Values("f64", "f64_nesterov", "bf16"));

TEST(Muon, WhichParametersItTakes) {
  EXPECT_TRUE(optim::muon_managed("decoder.layers.0.self_attention.linear_qkv.weight", 2, false));
  EXPECT_TRUE(optim::muon_managed("decoder.layers.3.mlp.router.weight", 2, false));
  EXPECT_TRUE(optim::muon_managed("embedding.position_embeddings.weight", 2, false));  // (as Megatron)
  EXPECT_TRUE(optim::muon_managed("decoder.layers.1.mlp.experts.linear_fc1.weight", 3, true));
  EXPECT_TRUE(optim::muon_managed("mtp.layers.0.eh_proj.weight", 2, false));
  EXPECT_FALSE(optim::muon_managed("embedding.word_embeddings.weight", 2, false));
  EXPECT_FALSE(optim::muon_managed("output_layer.weight", 2, false));
  EXPECT_FALSE(optim::muon_managed("decoder.layers.0.input_layernorm.weight", 1, false));
  EXPECT_FALSE(optim::muon_managed("decoder.layers.1.mlp.experts.linear_fc2.bias", 2, true));
}

TEST(Muon, BadSettingsAreNamed) {
  optim::MuonConfig c;
  c.momentum = 1.0f;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--muon-momentum"), std::string::npos);
  c = {};
  c.num_ns_steps = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--muon-num-ns-steps"), std::string::npos);
  c = {};
  c.scalar_optimizer = optim::ScalarOptimizer::lion;
  c.lion_beta2 = 1.0f;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--lion-beta2 (1) must lie in [0, 1)"), std::string::npos);
  // A QKV weight whose rows are no whole number of query groups.
  std::vector<Param> params(1);
  params[0].name = "decoder.layers.0.self_attention.linear_qkv.weight";
  params[0].value = Tensor::zeros({10, 4}, DType::f32);
  params[0].grad = Tensor::zeros({10, 4}, DType::f32);
  const std::vector<optim::MuonParam> kinds = {{true, {4, 1, 1}}};
  EXPECT_NE(error_of([&] { optim::Muon(params, kinds, {}, {}, {}); }).find("does not split into row groups of 6"),
            std::string::npos);
  train::TrainConfig t = testing::small_train_config(2);
  t.optimizer = optim::OptimizerKind::muon;
  t.use_distributed_optimizer = true;
  t.num_distributed_optimizer_instances = 2;
  EXPECT_NE(error_of([&] { t.validate(); }).find("--num-distributed-optimizer-instances 1"), std::string::npos);
}

fs::path fresh_dir(const char* name) {
  const fs::path p =
      fs::temp_directory_path() / (std::string("moecore_muon_") + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

struct RunResult {
  std::vector<double> losses;
  uint64_t hash = 0;
  std::string error;
};

RunResult run(train::TrainConfig t, optim::OptimizerKind kind, const fs::path& save = {}, const fs::path& load = {},
              optim::ScalarOptimizer scalar = optim::ScalarOptimizer::adam) {
  model::GptModel m(testing::small_moe_model(4), t.micro_batch_size, 77, {}, testing::test_device());
  optim::AdamW opt(m.params(), optim::AdamWConfig{}, kind == optim::OptimizerKind::adam);
  t.optimizer = kind;
  t.muon.scalar_optimizer = scalar;
  t.muon.extra_scale_factor = 0.2f;
  t.save = save.string();
  t.load = load.string();
  RunResult r;
  try {
    const auto log = train::train(m, opt, t, testing::synthetic_batch, nullptr);
    r.losses = log.train_loss;
  } catch (const Error& e) {
    r.error = e.what();
  }
  r.hash = train::parameter_hash(m);
  return r;
}

// Muon with `scalar` trains 8 steps (the loss falls); 4 steps saved in dir and 4 more resumed from it are bitwise the
// uninterrupted run (losses and final parameters). Returns the uninterrupted run.
RunResult expect_bitwise_resume(const fs::path& dir, optim::ScalarOptimizer scalar) {
  const RunResult straight = run(testing::small_train_config(8), optim::OptimizerKind::muon, {}, {}, scalar);
  EXPECT_EQ(straight.error, "");
  EXPECT_LT(straight.losses.back(), straight.losses.front() - 0.3) << "the loss does not fall";
  train::TrainConfig half = testing::small_train_config(8);
  half.exit_interval = 4;
  const RunResult first = run(half, optim::OptimizerKind::muon, dir, {}, scalar);
  const RunResult second = run(testing::small_train_config(8), optim::OptimizerKind::muon, dir, dir, scalar);
  EXPECT_EQ(second.losses.size(), 4u);
  for (size_t i = 0; i < 4 && i < first.losses.size() && i < second.losses.size(); ++i) {
    EXPECT_EQ(first.losses[i], straight.losses[i]) << i;
    EXPECT_EQ(second.losses[i], straight.losses[i + 4]) << i + 4;
  }
  EXPECT_EQ(second.hash, straight.hash);
  return straight;
}

TEST(Muon, TrainsAndResumesBitIdentical) {
  const fs::path dir = fresh_dir("resume");
  expect_bitwise_resume(dir, optim::ScalarOptimizer::adam);
  // The checkpoint holds Muon's momentum for the matrices and AdamW's moments for the rest, and says so.
  const auto ck = io::checkpoint_load(*io::checkpoint_find_latest(dir.string()));
  const auto& optim = ck.files.at("optimizer.safetensors").tensors;
  EXPECT_TRUE(optim.count("momentum_buffer.decoder.layers.0.self_attention.linear_qkv.weight"));
  EXPECT_TRUE(optim.count("momentum_buffer.decoder.layers.1.mlp.experts.linear_fc1.weight"));
  EXPECT_FALSE(optim.count("exp_avg.decoder.layers.0.self_attention.linear_qkv.weight"));
  EXPECT_TRUE(optim.count("exp_avg.embedding.word_embeddings.weight"));
  EXPECT_FALSE(optim.count("momentum_buffer.decoder.final_layernorm.weight"));
  EXPECT_NE(ck.state_json.find("\"optimizer\": \"muon\""), std::string::npos);
  // Resuming it with AdamW (or an AdamW checkpoint with Muon) is refused naming both.
  const RunResult adam = run(testing::small_train_config(8), optim::OptimizerKind::adam, {}, dir);
  EXPECT_NE(adam.error.find("--optimizer muon but this run uses --optimizer adam"), std::string::npos) << adam.error;
  fs::remove_all(dir);
}

// --muon-scalar-optimizer lion: the parameters Muon leaves take Lion (emerging_optimizers' update: decoupled decay,
// then the sign of beta1 m + (1 - beta1) g, then m moved towards g by 1 - beta2). From zero momentum the first step
// moves each such element by exactly -lr * sign(g) after the decay, and leaves m = (1 - beta2) g; Muon's matrices are
// untouched by the choice. Training with it falls, resumes bitwise (Lion's one moment in the checkpoint, which names
// it), a resume with Adam's scalars is refused naming both, and the plan counts 4 bytes per Lion element.
TEST(Muon, LionScalarsStepAsLionAndResume) {
  model::GptModel m(testing::small_moe_model(4), 2, 5, {}, testing::test_device());
  Tensor tok = Tensor::empty({2, 16}, DType::i32), lab = Tensor::empty({2, 16}, DType::i32);
  testing::synthetic_batch(tok, lab, false, 0);
  m.zero_grad();
  m.forward_backward(tok, lab, 1.0f);
  std::vector<optim::MuonParam> kinds;
  for (const Param& p : m.params())
    kinds.push_back({optim::muon_managed(p.name, p.value.dim(), p.expert_parallel), {}});
  optim::MuonConfig mc;
  mc.scalar_optimizer = optim::ScalarOptimizer::lion;
  mc.lion_beta1 = 0.9f;
  mc.lion_beta2 = 0.99f;
  optim::AdamWConfig run_cfg;
  run_cfg.weight_decay = 0.1f;
  run_cfg.clip_grad = 0;  // (clip scale 1)
  std::vector<Tensor> before, grads;
  for (const Param& p : m.params()) {
    before.push_back(testing::host(p.value).clone());
    grads.push_back(testing::host(p.grad).clone());
  }
  optim::Muon muon(m.params(), kinds, mc, run_cfg, {});
  const float lr = 1e-2f;
  muon.step(lr, 1.0);
  const std::vector<Tensor> exp_avg = muon.exp_avg(), exp_avg_sq = muon.exp_avg_sq();
  int checked = 0;
  for (size_t i = 0; i < m.params().size(); ++i) {
    const Param& p = m.params()[i];
    if (kinds[i].managed) {
      EXPECT_TRUE(muon.momentum()[i].defined()) << p.name;
      continue;
    }
    ASSERT_TRUE(exp_avg[i].defined()) << p.name;
    EXPECT_FALSE(exp_avg_sq[i].defined()) << p.name << ": Lion keeps one moment";
    const Tensor v = testing::host(p.value), m1 = testing::host(exp_avg[i]);
    const double decay = 1.0 - static_cast<double>(lr) * (p.weight_decay ? 0.1 : 0.0);
    for (int64_t j = 0; j < v.numel(); ++j) {
      const double g = grads[i].data<float>()[j], p0 = before[i].data<float>()[j];
      const double want = p0 * decay - lr * (g > 0 ? 1.0 : g < 0 ? -1.0 : 0.0);
      ASSERT_NEAR(v.data<float>()[j], want, 1e-7 * std::max(1.0, std::fabs(want))) << p.name << " element " << j;
      ASSERT_NEAR(m1.data<float>()[j], (1 - 0.99) * g, 1e-6 * std::fabs(g) + 1e-12) << p.name << " element " << j;
    }
    ++checked;
  }
  EXPECT_GT(checked, 3);
  // Training: the loss falls, a resume is bitwise, the checkpoint holds and names Lion's state.
  const fs::path dir = fresh_dir("lion");
  const RunResult straight = expect_bitwise_resume(dir, optim::ScalarOptimizer::lion);
  const RunResult adam_scalars = run(testing::small_train_config(8), optim::OptimizerKind::muon);
  ASSERT_FALSE(straight.losses.empty());
  EXPECT_NE(adam_scalars.losses.back(), straight.losses.back());
  const auto ck = io::checkpoint_load(*io::checkpoint_find_latest(dir.string()));
  const auto& optim = ck.files.at("optimizer.safetensors").tensors;
  EXPECT_TRUE(optim.count("exp_avg.embedding.word_embeddings.weight"));
  EXPECT_FALSE(optim.count("exp_avg_sq.embedding.word_embeddings.weight"));
  EXPECT_TRUE(optim.count("momentum_buffer.decoder.layers.0.self_attention.linear_qkv.weight"));
  EXPECT_NE(ck.state_json.find("\"muon_scalar_optimizer\": \"lion\""), std::string::npos);
  const RunResult adam = run(testing::small_train_config(8), optim::OptimizerKind::muon, {}, dir);
  EXPECT_NE(adam.error.find("--muon-scalar-optimizer lion but this run uses --muon-scalar-optimizer adam"),
            std::string::npos)
      << adam.error;
  fs::remove_all(dir);
  // The plan's bytes: Muon's momentum and Lion's, 4 per element each.
  train::TrainConfig t = testing::small_train_config(2);
  t.optimizer = optim::OptimizerKind::muon;
  t.muon = mc;
  const model::MemoryPlan plan =
      model::GptModel::plan_memory(testing::small_moe_model(4), 2, {}, {}, train::optimizer_state_bytes(t, {}));
  EXPECT_EQ(plan.bytes[static_cast<int>(MemCategory::optimizer_state)], muon.state_bytes());
  EXPECT_EQ(muon.state_bytes(), 4 * m.num_parameters());
}

// The plan before the model exists counts 4 bytes of momentum per Muon element and AdamW's 8 per other element, and
// equals what Muon allocates.
TEST(Muon, MemoryPlanCountsItsState) {
  const model::ModelConfig c = testing::small_moe_model(4);
  train::TrainConfig t = testing::small_train_config(2);
  t.optimizer = optim::OptimizerKind::muon;
  const model::MemoryPlan plan = model::GptModel::plan_memory(c, 2, {}, {}, train::optimizer_state_bytes(t, {}));
  model::GptModel m(c, 2, 5, {}, testing::test_device());
  const MemoryStats before = memory_stats();
  std::vector<optim::MuonParam> kinds;
  int64_t want = 0;
  for (const Param& p : m.params()) {
    optim::MuonParam k;
    k.managed = optim::muon_managed(p.name, p.value.dim(), p.expert_parallel);
    want += (k.managed ? 4 : 8) * p.value.numel();
    kinds.push_back(k);
  }
  optim::Muon real(m.params(), kinds, {}, {}, {});
  EXPECT_EQ(memory_stats().current[static_cast<int>(MemCategory::optimizer_state)] -
                before.current[static_cast<int>(MemCategory::optimizer_state)],
            want);
  EXPECT_EQ(real.state_bytes(), want);
  EXPECT_EQ(plan.bytes[static_cast<int>(MemCategory::optimizer_state)], want);
  EXPECT_LT(want, 8 * m.num_parameters());
}

}  // namespace
}  // namespace moecore
