// MoE inside the GPT: the layer pattern, the memory plan, gradient accumulation, expert-bias updates once per
// optimizer step, and learning on tinyshakespeare (skipped when ../shared is absent). Models live on
// testing::test_device(); parameters, gradients and router states are read through host copies.
#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "model/shakespeare_run.h"
#include "model/synthetic_training.h"
#include "moecore/model/gpt.h"
#include "moecore/model/param_specs.h"
#include "moecore/optim/adamw.h"
#include "moecore/train/trainer.h"
#include "test_util.h"

namespace moecore {
namespace {

model::ModelConfig tiny_moe() {
  model::ModelConfig c;
  c.num_layers = 3;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.moe.num_experts = 4;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = 24;
  c.moe.aux_loss_coeff = {1e-2f};
  return c;
}

model::GptModel make_model(const model::ModelConfig& c, int64_t micro_batch, uint64_t seed) {
  return model::GptModel(c, micro_batch, seed, {}, testing::test_device());
}
const ops::Context kDev{testing::test_device()};

Tensor ids(int64_t n, const char* name, int64_t V) {
  Tensor t = Tensor::empty({2, n / 2}, DType::i32);
  for (int64_t i = 0; i < n; ++i)
    t.data<int32_t>()[i] = static_cast<int32_t>(philox_uniform(philox_key(9, name), i) * V);
  return t;
}

// The MoE layers see Megatron's sequence-major token order (token s*B + b), so seq_aux_loss's sequence b is sample
// b: the B = 2 model's loss is the mean of the two single-sample models' losses. Fed batch-major, the layer's
// "sequences" t % B would mix the two samples' tokens and the values would not match.
TEST(MoeModel, MoeLayersSeeMegatronsSequenceMajorTokenOrder) {
  model::ModelConfig c = tiny_moe();
  c.moe.load_balancing_type = {moe::LoadBalancing::seq_aux_loss};
  const Tensor tok = ids(32, "order", 64), lab = ids(32, "order_labels", 64);
  model::GptModel both = make_model(c, 2, 11);
  both.forward_backward(tok, lab, 1.0f);
  std::vector<std::vector<double>> single(2);
  for (int64_t b = 0; b < 2; ++b) {
    model::GptModel one = make_model(c, 1, 11);
    one.forward_backward(tok.slice(0, b, b + 1).clone(), lab.slice(0, b, b + 1).clone(), 1.0f);
    for (int64_t l = 0; l < c.num_layers; ++l)
      single[b].push_back(moe::router_stats_host(*one.moe_stats(l)).seq_aux_loss);
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const double s0 = single[0][l], s1 = single[1][l];
    EXPECT_GT(std::fabs(s0 - s1), 1e-4) << "layer " << l << ": the samples must route differently for this test";
    EXPECT_NEAR(moe::router_stats_host(*both.moe_stats(l)).seq_aux_loss, 0.5 * (s0 + s1), 1e-6 * (s0 + s1))
        << "layer " << l;
  }
}

TEST(MoeModel, LayerFreqSelectsMoeLayers) {
  model::ModelConfig c = tiny_moe();
  c.moe_layer_freq = "2";
  model::GptModel a = make_model(c, 2, 1);
  EXPECT_TRUE(a.is_moe_layer(0));
  EXPECT_FALSE(a.is_moe_layer(1));
  EXPECT_TRUE(a.is_moe_layer(2));
  c.moe_layer_freq = "[0,1,1]";
  model::GptModel b = make_model(c, 2, 1);
  EXPECT_FALSE(b.is_moe_layer(0));
  EXPECT_TRUE(b.is_moe_layer(1));
  EXPECT_NO_THROW(b.param("decoder.layers.0.mlp.linear_fc1.weight"));
  EXPECT_NO_THROW(b.param("decoder.layers.1.mlp.experts.linear_fc1.weight"));
  c.moe_layer_freq = "[0,1]";
  EXPECT_THROW(make_model(c, 2, 1), Error);  // wrong length names the flag
}

// MoE models of every layer kind: a gated shared expert; Megatron's defaults; partial RoPE; MLA (DeepSeek- and
// V2-Lite-style); MLA with MTP.
std::vector<model::ModelConfig> varied_moe_configs() {
  model::ModelConfig shared = tiny_moe();
  shared.moe.shared_expert_intermediate_size = 16;
  shared.moe.shared_expert_gate = true;
  // Megatron's defaults: LayerNorm, learned positions, biases everywhere, dropout.
  model::ModelConfig megatron = tiny_moe();
  megatron.normalization = model::Normalization::layernorm;
  megatron.position_embedding_type = model::PositionEmbedding::learned_absolute;
  megatron.max_position_embeddings = 24;
  megatron.add_bias_linear = true;
  megatron.hidden_dropout = megatron.attention_dropout = 0.1f;
  // Partial RoPE with a qkv bias only.
  model::ModelConfig partial = tiny_moe();
  partial.rotary_percent = 0.5f;
  partial.add_qkv_bias = true;
  // DeepSeek-style: MLA with q LoRA, latent norms, YaRN, sigmoid group-limited routing with expert bias, first
  // layer dense; and V2-Lite-style MLA (no q LoRA) in bf16.
  model::ModelConfig mla = tiny_moe();
  mla.multi_latent_attention = mla.qk_layernorm = mla.yarn = true;
  mla.q_lora_rank = 12;
  mla.kv_lora_rank = 8;
  mla.qk_head_dim = 6;
  mla.qk_pos_emb_head_dim = 4;
  mla.v_head_dim = 5;
  mla.yarn_config.scaling_factor = 4.0f;
  mla.yarn_config.original_max_position_embeddings = 8;
  mla.yarn_config.mscale_all_dim = 1.0f;
  mla.moe_layer_freq = "[0]+[1]*2";
  mla.moe.score_function = moe::ScoreFunction::sigmoid;
  mla.moe.enable_expert_bias = true;
  mla.moe.shared_expert_intermediate_size = 16;
  model::ModelConfig lite = mla;
  lite.q_lora_rank = 0;
  lite.yarn = false;
  lite.compute_dtype = DType::bf16;
  model::ModelConfig mtp = mla;  // with two multi-token-prediction depths
  mtp.mtp_num_layers = 2;
  return {shared, megatron, partial, mla, lite, mtp};
}

TEST(MoeModel, MemoryPlanTotalEqualsTrackedAllocations) {
  for (const model::ModelConfig& c : varied_moe_configs()) {
    const MemoryStats before = memory_stats();
    const model::MemoryPlan ahead = model::GptModel::plan_memory(
        c, 2, {}, {}, [](const Param&) { return optim::AdamW::state_bytes_per_param(optim::AdamWConfig{}); });
    EXPECT_EQ(memory_stats().total_current, before.total_current) << c.summary();
    model::GptModel m = make_model(c, 2, 5);
    optim::AdamW opt(m.params(), optim::AdamWConfig{});
    const MemoryStats after = memory_stats();
    const model::MemoryPlan plan = m.memory_plan([&](const Param&) { return opt.state_bytes_per_param(); });
    EXPECT_EQ(after.total_current - before.total_current, plan.total()) << c.summary();
    for (int k = 0; k < kNumMemCategories; ++k)  // (before anything was allocated: the same plan)
      EXPECT_EQ(ahead.bytes[k], plan.bytes[k]) << mem_category_name(static_cast<MemCategory>(k)) << " " << c.summary();
    for (MemCategory k : {MemCategory::parameters, MemCategory::gradients, MemCategory::optimizer_state}) {
      const int i = static_cast<int>(k);
      EXPECT_EQ(after.current[i] - before.current[i], plan.bytes[i]) << mem_category_name(k) << " " << c.summary();
    }
  }
}

// Every parameter of the table has a role and a layer that name it once (the model binds its modules by them) and
// agree with its Megatron name: decoder layer l's under "decoder.layers.l.", MTP depth k's (layer num_layers + k) under
// "mtp.layers.k.", the model's own (layer -1) elsewhere; a transformer layer's roles exactly inside a transformer
// layer.
TEST(ParamSpecs, RoleAndLayerNameEveryParameterOnce) {
  for (const model::ModelConfig& c : varied_moe_configs()) {
    std::set<std::pair<int, int64_t>> seen;
    for (const model::ParamSpec& s : model::parameter_specs(c)) {
      EXPECT_TRUE(seen.insert({static_cast<int>(s.role), s.layer}).second) << s.name;
      const bool in_layer =
          s.name.starts_with("decoder.layers.") || s.name.find(".transformer_layer.") != std::string::npos;
      EXPECT_EQ(model::layer_role(s.role), in_layer) << s.name;
      if (s.layer < 0)
        EXPECT_FALSE(s.name.starts_with("decoder.layers.") || s.name.starts_with("mtp.")) << s.name;
      else if (s.layer < c.num_layers)
        EXPECT_TRUE(s.name.starts_with("decoder.layers." + std::to_string(s.layer) + ".")) << s.name;
      else
        EXPECT_TRUE(s.name.starts_with("mtp.layers." + std::to_string(s.layer - c.num_layers) + ".")) << s.name;
    }
    EXPECT_EQ(seen.size(), model::parameter_specs(c).size()) << c.summary();
  }
}

TEST(MoeModel, BackwardTwiceDoublesGradientsIncludingRouterAndExperts) {
  model::GptModel m = make_model(tiny_moe(), 2, 5);
  const Tensor tok = ids(32, "tok", 64), lab = ids(32, "lab", 64);
  m.zero_grad();
  m.forward_backward(tok, lab, 1.0f);
  std::vector<Tensor> once;
  for (auto& p : m.params()) once.push_back(p.grad.clone());
  m.forward_backward(tok, lab, 1.0f);
  const std::vector<Param>& weights = m.params();
  for (size_t i = 0; i < once.size(); ++i) {
    Tensor twice = once[i].clone();
    ops::scale(twice, 2.0f, kDev);
    EXPECT_LE(testing::tolerance_ratio(weights[i].grad, twice, 1e-5, 1e-9), 1.0) << weights[i].name;
  }
  EXPECT_GT(testing::sum_squares(m.param("decoder.layers.0.mlp.router.weight").grad), 0.0);
}

TEST(MoeModel, ExpertBiasMovesOncePerOptimizerStep) {
  model::ModelConfig c = tiny_moe();
  c.moe.score_function = moe::ScoreFunction::sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 0.1f;
  model::GptModel m = make_model(c, 2, 5);
  const Tensor tok = ids(32, "tok", 64), lab = ids(32, "lab", 64);
  m.forward_backward(tok, lab, 0.5f);
  m.forward_backward(tok, lab, 0.5f);  // two micro-batches: counts add up, the bias does not move yet
  const Tensor bias_before = m.router_state(0)->expert_bias.clone();
  EXPECT_EQ(testing::sum_squares(bias_before), 0.0);
  // The counters are device tensors: read through a host copy.
  auto counts = [&] {
    const Tensor c = testing::host(m.router_state(0)->local_tokens_per_expert);
    return std::vector<int64_t>(c.data<int64_t>(), c.data<int64_t>() + c.numel());
  };
  int64_t total = 0;
  for (int64_t c_e : counts()) total += c_e;
  EXPECT_EQ(total, 2 * 32 * 2);  // two micro-batches of 32 tokens, top-2
  m.finish_step();
  const auto b = testing::to_vector(m.router_state(0)->expert_bias);
  for (int e = 0; e < 4; ++e) EXPECT_TRUE(b[e] == 0.1f || b[e] == -0.1f || b[e] == 0.0f) << b[e];
  EXPECT_GT(testing::sum_squares(m.router_state(0)->expert_bias), 0.0);
  for (int64_t c_e : counts()) EXPECT_EQ(c_e, 0);
}

// f16 compute (fp32 masters, f16 activations and GEMM operands, f32 math) trains the small MoE like f32: the same
// initial parameters and batches, 8 AdamW steps (lr 3e-3), the backward under a static loss scale of 1024 that is
// divided out of the gradients before the step, as --fp16 training does. Each f16 rounding is 2^-11 relative and
// they average out over the batch: the first loss differs by ~2e-6, and the difference grows with the trajectory to
// at most 3.3e-5 relative in 8 steps (measured; bf16, 8x coarser, reaches 1.3e-4), so 1.5e-4. The trained f16
// model's logits are finite and, on the same master weights, within 5e-3 of the f32 model's (three layers of
// 2^-11 roundings; measured ~1e-3).
TEST(MoeModel, F16ComputeTrainsLikeF32) {
  constexpr float kLossScale = 1024.0f;
  auto run = [](DType dt, std::vector<double>& losses) {
    model::ModelConfig c = tiny_moe();
    c.compute_dtype = dt;
    model::GptModel m = make_model(c, 2, 5);
    optim::AdamW opt(m.params(), optim::AdamWConfig{});
    Tensor tok = Tensor::empty({2, 16}, DType::i32), lab = Tensor::empty({2, 16}, DType::i32);
    for (int step = 0; step < 8; ++step) {
      testing::synthetic_batch(tok, lab, false, step);
      m.zero_grad();
      losses.push_back(m.forward_backward(tok, lab, kLossScale).mean());
      for (auto& p : m.params()) ops::scale(p.grad, 1.0f / kLossScale, kDev);
      opt.step(3e-3f);
      m.refresh_compute_weights();
      m.finish_step();
    }
    return m;
  };
  std::vector<double> l32, l16;
  run(DType::f32, l32);
  model::GptModel m16 = run(DType::f16, l16);
  for (int step = 0; step < 8; ++step) EXPECT_NEAR(l16[step], l32[step], 1.5e-4 * l32[step]) << "step " << step;
  EXPECT_LT(l16.back(), l16.front() - 0.3);  // it does train (f32: 4.17 -> 3.63)
  // The logits compare with every expert taken (top-4 of 4): in top-2 a token whose second and third experts are a
  // near tie in f32 may take the other one in f16 (one token of 32 here on an AVX512-FP16 Xeon, its logits 6e-3
  // off), a jump that says nothing of the kernels' precision. With all experts routed the output is continuous.
  auto all_experts = [&](DType dt) {
    model::ModelConfig c = tiny_moe();
    c.compute_dtype = dt;
    c.moe.router_topk = c.moe.num_experts;
    model::GptModel m = make_model(c, 2, 5);
    for (size_t i = 0; i < m.params().size(); ++i) m.params()[i].value.copy_from(m16.params()[i].value);
    m.refresh_compute_weights();
    return m;
  };
  model::GptModel f16 = all_experts(DType::f16), f32 = all_experts(DType::f32);
  Tensor tok = Tensor::empty({2, 16}, DType::i32), lab = Tensor::empty({2, 16}, DType::i32);
  testing::synthetic_batch(tok, lab, true, 0);
  Tensor a = Tensor::empty({32, 64}, DType::f32, MemCategory::other, testing::test_device());
  Tensor b = Tensor::empty({32, 64}, DType::f32, MemCategory::other, testing::test_device());
  f16.forward_logits(a, tok);
  f32.forward_logits(b, tok);
  EXPECT_TRUE(testing::all_finite(a));
  const double scale = std::sqrt(testing::sum_squares(b) / static_cast<double>(b.numel()));
  EXPECT_TENSOR_NEAR(a, b, 5e-3, 5e-3 * scale);
}

// An 8-expert top-2 byte-level MoE on tinyshakespeare gets below the same bound as the dense model test.
TEST(MoeModel, LearnsTinyShakespeare) {
  const std::string dir = testing::shared_data_dir();
  if (dir.empty()) GTEST_SKIP() << "../shared/data is absent: tinyshakespeare is not available here";
  model::ModelConfig c = testing::shakespeare_config();
  c.moe.num_experts = 8;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = 128;
  c.moe.aux_loss_coeff = {1e-2f};
  const train::TrainLog log = testing::run_shakespeare(c, dir).log;
  ASSERT_FALSE(log.valid_loss.empty());
  const double after = log.valid_loss.back().second;
  std::printf("tinyshakespeare MoE validation loss: %.4f, final load_balancing_loss %.4f\n", after,
              log.metrics.back().value("load_balancing_loss"));
  EXPECT_LT(after, 2.5);
  EXPECT_LT(log.metrics.back().value("load_balancing_loss"), 1.5);  // 1.0 = perfectly balanced
}

}  // namespace
}  // namespace moecore

namespace moecore {
namespace {

// End-to-end finite differences through a 3-layer MoE model whose layers share their scratch buffers: the
// objective is the LM loss plus every router loss, as back-propagated. Top-k equals the number of experts so
// that the objective is smooth (no routing flips under perturbation). Checked on the largest-gradient
// entries of parameters before, inside and after the MoE layers (h = 1e-2 in float32; tolerance 3% + 3e-5).
TEST(MoeModel, EndToEndGradientMatchesFiniteDifferences) {
  model::ModelConfig c = tiny_moe();
  c.moe.router_topk = 4;
  c.moe.z_loss_coeff = 1e-3f;
  c.moe.shared_expert_intermediate_size = 8;
  c.moe.shared_expert_gate = true;
  model::GptModel m = make_model(c, 2, 21);
  const Tensor tok = ids(32, "fd_tok", 64), lab = ids(32, "fd_lab", 64);
  auto objective = [&]() {
    double obj = m.forward_backward(tok, lab, 1.0f).mean();
    for (int64_t l = 0; l < c.num_layers; ++l) obj += moe::router_stats_host(*m.moe_stats(l)).weighted_loss;
    return obj;
  };
  m.zero_grad();
  objective();
  std::vector<std::pair<std::string, Tensor>> grads;
  for (const char* name :
       {"decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.experts.linear_fc1.weight", "decoder.layers.2.mlp.experts.linear_fc2.weight",
        "decoder.layers.2.mlp.shared_experts.gate_weight", "embedding.word_embeddings.weight"})
    grads.emplace_back(name, testing::host(m.param(name).grad).clone());
  for (auto& [name, g] : grads) {
    Param& p = m.param(name);
    std::vector<int64_t> order(static_cast<size_t>(g.numel()));
    for (int64_t i = 0; i < g.numel(); ++i) order[static_cast<size_t>(i)] = i;
    const float* gp = g.data<float>();
    std::partial_sort(order.begin(), order.begin() + 5, order.end(),
                      [&](int64_t a, int64_t b) { return std::fabs(gp[a]) > std::fabs(gp[b]); });
    // The parameter is perturbed in a host copy and uploaded before each evaluation.
    Tensor host_value = testing::host(p.value).clone();
    auto set = [&](int64_t i, float x) {
      host_value.data<float>()[i] = x;
      p.value.copy_from(host_value);
      m.refresh_compute_weights();
    };
    for (int k = 0; k < 5; ++k) {
      const int64_t i = order[static_cast<size_t>(k)];
      const float orig = host_value.data<float>()[i], h = 1e-2f;
      set(i, orig + h);
      const double up = objective();
      set(i, orig - h);
      const double down = objective();
      set(i, orig);
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(fd, gp[i], 0.03 * std::fabs(gp[i]) + 3e-5) << name << "[" << i << "]";
    }
  }
}

}  // namespace
}  // namespace moecore

namespace moecore {
namespace {

// Model FLOPs against docs/echo-folding-perf.md's worked split for DeepSeek-V3 at S = 4096 (MLP 57 %, attention
// projections 27 %, attention core 12 %, logits 4 %, MTP extra < 1 %): the total is the formula's value for
// V3's config (61 layers, 3 dense, MLA, 256 experts top-8 of 2048, one shared, one MTP depth, vocab 129280).
TEST(ModelFlops, DeepSeekV3MatchesTheWorkedSplit) {
  model::ModelConfig c;
  c.num_layers = 61;
  c.hidden_size = 7168;
  c.num_attention_heads = 128;
  c.ffn_hidden_size = 18432;
  c.vocab_size = 129280;
  c.seq_length = 4096;
  c.swiglu = true;
  c.multi_latent_attention = c.qk_layernorm = true;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_head_dim = 128;
  c.qk_pos_emb_head_dim = 64;
  c.v_head_dim = 128;
  c.mtp_num_layers = 1;
  c.moe.num_experts = 256;
  c.moe.router_topk = 8;
  c.moe.ffn_hidden_size = 2048;
  c.moe.shared_expert_intermediate_size = 2048;
  c.moe.swiglu = true;
  c.moe_layer_freq = "[0]*3+[1]*58";
  const double total = model::model_flops_per_step(c, 1);
  EXPECT_NEAR(total, 1.064931126411264e15, 1e-9 * total);
  const model::AttentionCost a = model::attention_cost(c, model::AttentionKind::mla);
  const double T = 4096, layers = 62;
  EXPECT_NEAR(T * layers * 6 * a.p_attn / total, 0.27, 0.005);      // attention projections
  EXPECT_NEAR(T * T * 6 * a.a_core * layers / total, 0.12, 0.005);  // attention core
  EXPECT_NEAR(T * 6 * 7168.0 * 129280 * 2 / total, 0.043, 0.001);   // logits, main + MTP head
}

}  // namespace
}  // namespace moecore
