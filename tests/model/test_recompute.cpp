// Layer-2 tests of full activation recompute (--recompute-granularity full, --recompute-method uniform | block,
// --recompute-num-layers): every setting gives the gradients and losses of the run without recompute bit for bit
// (dense with dropout; MoE with jitter noise, aux/seq-aux/z losses and the expert bias; MLA), with micro-batches in
// flight (activation slots); the memory plan's activation bytes fall by the caches the recomputed layers no longer
// keep, the tracked allocations equal the plan, and a step allocates nothing beyond it; bad settings name the flags.
#include <algorithm>
#include <cstring>

#include "moecore/core/memory.h"
#include "moecore/core/rng.h"
#include "moecore/model/gpt.h"
#include "test_util.h"

namespace moecore {
namespace {

model::ModelConfig dense(int64_t layers) {
  model::ModelConfig c;
  c.num_layers = layers;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.hidden_dropout = 0.1f;
  c.attention_dropout = 0.1f;
  return c;
}

model::ModelConfig moe(bool mla) {
  model::ModelConfig c = dense(4);
  c.moe_layer_freq = "[0,1,1,1]";
  c.moe.num_experts = 4;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = 24;
  c.moe.input_jitter_eps = 0.01f;  // noise drawn per forward: a recompute must not draw again
  c.moe.load_balancing_type = {moe::LoadBalancing::aux_loss, moe::LoadBalancing::seq_aux_loss};
  c.moe.aux_loss_coeff = {1e-2f, 1e-2f};
  c.moe.z_loss_coeff = 1e-3f;
  c.moe.shared_expert_intermediate_size = 16;
  if (mla) {
    c.multi_latent_attention = c.qk_layernorm = true;
    c.q_lora_rank = 12;
    c.kv_lora_rank = 8;
    c.qk_head_dim = 6;
    c.qk_pos_emb_head_dim = 4;
    c.v_head_dim = 5;
  }
  return c;
}

model::ModelConfig with_recompute(model::ModelConfig c, const std::string& method, int64_t n) {
  c.recompute = {"full", method, n, {}};
  return c;
}
model::ModelConfig with_selective(model::ModelConfig c, std::vector<std::string> modules) {
  c.recompute = {"selective", "", 0, std::move(modules)};
  return c;
}

Tensor ids(const std::string& name) {
  Tensor t = Tensor::empty({2, 16}, DType::i32, MemCategory::other);
  for (int64_t i = 0; i < 32; ++i)
    t.data<int32_t>()[i] = static_cast<int32_t>(philox_uniform(philox_key(5, name), i) * 64);
  return t;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<Tensor> grads;
};

// Two optimizer-free steps of three micro-batches, the forwards of each step before its backwards (slots).
Outcome run(const model::ModelConfig& c) {
  model::GptModel m(c, 2, 3, {}, testing::test_device());
  m.set_micro_batch_slots({3});
  Outcome r;
  for (int64_t step = 0; step < 2; ++step) {
    m.zero_grad();
    for (int64_t mb = 0; mb < 3; ++mb) {
      m.set_dropout_step(step, mb);
      const std::string n = std::to_string(step) + "/" + std::to_string(mb);
      r.losses.push_back(m.forward(mb, ids("tok" + n), ids("lab" + n), 1.0f / 3).mean());
    }
    for (int64_t mb = 0; mb < 3; ++mb) m.backward(mb, 1.0f / 3);
    m.finish_step();
  }
  for (const Param& p : m.params()) r.grads.push_back(testing::host(p.grad));
  return r;
}

void expect_bitwise(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_EQ(got.losses, want.losses) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_EQ(std::memcmp(got.grads[i].raw(), want.grads[i].raw(), static_cast<size_t>(want.grads[i].nbytes())), 0)
        << what << ": parameter " << i;
}

TEST(Recompute, EverySettingIsBitwiseTheRunWithout) {
  for (const model::ModelConfig& c : {dense(4), moe(false), moe(true)}) {
    const Outcome plain = run(c);
    for (const std::vector<std::string>& modules :
         std::vector<std::vector<std::string>>{{"layernorm"},
                                               {"moe_act"},
                                               {"moe_act", "layernorm"},
                                               {},  // Megatron's default: core_attn
                                               {"mlp"},
                                               {"moe"},
                                               {"shared_experts"},
                                               {"moe", "moe_act", "shared_experts", "layernorm"},
                                               {"mla_up_proj", "layernorm"},
                                               {"core_attn", "mlp", "layernorm", "moe_act", "shared_experts"}})
      if (c.multi_latent_attention || std::find(modules.begin(), modules.end(), "mla_up_proj") == modules.end())
        expect_bitwise(run(with_selective(c, modules)), plain,
                       "selective " + (modules.empty() ? std::string("(default)") : modules[0]) +
                           (modules.size() > 1 ? "+" + std::to_string(modules.size() - 1) + " more" : "") +
                           (c.moe.enabled() ? " moe" : " dense") + (c.multi_latent_attention ? " mla" : ""));
    for (const auto& [method, n] : std::vector<std::pair<std::string, int64_t>>{
             {"uniform", 1}, {"uniform", 2}, {"uniform", 3}, {"uniform", 8}, {"block", 1}, {"block", 3}})
      expect_bitwise(run(with_recompute(c, method, n)), plain,
                     method + " " + std::to_string(n) + (c.moe.enabled() ? " moe" : " dense") +
                         (c.multi_latent_attention ? " mla" : ""));
  }
}

int64_t activations(const model::GptModel& m) {
  return m.memory_plan(model::GptModel::no_optimizer_state).bytes[static_cast<int>(MemCategory::activations)];
}

// A dense layer's cache: the 4-layer model's activations minus the 3-layer model's, minus the residual stream's
// [N, H] f32 entry of the extra layer.
TEST(Recompute, ActivationBytesFallByTheCachesNoLongerKept) {
  const model::GptModel four(dense(4), 2, 3, {}, testing::test_device()),
      three(dense(3), 2, 3, {}, testing::test_device());
  const int64_t layer = activations(four) - activations(three) - 2 * 16 * 32 * 4;
  ASSERT_GT(layer, 0);
  struct Case {
    std::string method;
    int64_t n;
  };
  for (const Case& k : {Case{"uniform", 1}, Case{"uniform", 2}, Case{"uniform", 4}, Case{"block", 1}, Case{"block", 2},
                        Case{"block", 4}})
    for (int64_t slots : {1, 3}) {
      const MemoryStats before = memory_stats();
      model::GptModel m(with_recompute(dense(4), k.method, k.n), 2, 3, {}, testing::test_device());
      model::GptModel plain(dense(4), 2, 3, {}, testing::test_device());
      const int64_t at = static_cast<int>(MemCategory::activations);
      EXPECT_EQ(memory_stats().current[at] - before.current[at], activations(m) + activations(plain));
      m.set_micro_batch_slots({slots});
      plain.set_micro_batch_slots({slots});
      // block keeps its last layers per slot; the recomputed ones share one set (block) or a chunk's (uniform)
      const int64_t recomputed = k.method == "uniform" ? 4 : std::min<int64_t>(k.n, 4);
      const int64_t shared_sets = k.method == "uniform" ? std::min<int64_t>(k.n, 4) : 1;
      EXPECT_EQ(activations(plain) - activations(m), recomputed * slots * layer - shared_sets * layer)
          << k.method << " " << k.n << ", " << slots << " slots";
      // One step allocates nothing beyond the plan.
      memory_reset_peaks();
      const int64_t now = memory_stats().current[at];
      for (int64_t mb = 0; mb < slots; ++mb) {
        m.set_dropout_step(0, mb);
        m.forward(mb, ids("t"), ids("l"), 1.0f);
      }
      for (int64_t mb = 0; mb < slots; ++mb) m.backward(mb, 1.0f);
      EXPECT_EQ(memory_stats().peak[at], now);
    }
}

// Selective recompute drops, per decoder layer and slot, the norm outputs h1 and h2 ([T, H] each: layernorm), the
// routed experts' activations ([T * K, F]: moe_act), the attention output and log-sum-exp ([T, heads * D] and
// [B, heads, S]: core_attn) or a dense MLP's h2, fc1 output and activation ([T, H], [T, 2F], [T, F]: mlp), keeping one
// shared buffer of each.
TEST(Recompute, SelectiveDropsTheNamedOutputs) {
  const int64_t h = 2 * 16 * 32 * 4, act = 2 * 16 * 2 * 24 * 4;  // [T, H] f32; [T * topk, F] f32
  const int64_t attn = h + 2 * 4 * 16 * 4, mlp = h + 32 * 96 * 4 + 32 * 48 * 4;
  const int64_t shared = 32 * 32 * 4 + 32 * 16 * 4;
  const int64_t mla_qkv = 32 * 4 * 3 * (6 + 4) * 4;  // MLA's kernel input [T, heads * 3 * (dn + dr)] (v padded)  // the
                                                     // shared expert's fc1 output [T, 2Fs] and activation [T, Fs]
  struct Case {
    model::ModelConfig c;
    std::vector<std::string> modules;
    int64_t per_layer_slot, layers, shared;
  };
  for (const Case& k :
       {Case{dense(4), {"layernorm"}, 2 * h, 4, 2 * h}, Case{moe(false), {"moe_act"}, act, 3, act},
        Case{moe(false), {"layernorm"}, 2 * h, 4, 3 * h}, Case{dense(4), {"core_attn"}, attn, 4, attn},
        Case{moe(false), {"core_attn"}, attn, 4, attn}, Case{dense(4), {"mlp"}, mlp, 4, mlp},
        Case{moe(false), {"mlp"}, mlp, 1, mlp}, Case{dense(4), {"layernorm", "mlp"}, h + mlp, 4, h + mlp},
        Case{moe(false), {"shared_experts"}, shared, 3, shared}, Case{moe(true), {"mla_up_proj"}, mla_qkv, 4, mla_qkv}})
    for (int64_t slots : {1, 3}) {
      const MemoryStats before = memory_stats();
      model::GptModel m(with_selective(k.c, k.modules), 2, 3, {}, testing::test_device());
      m.set_micro_batch_slots({slots});
      EXPECT_EQ(memory_stats().total_current - before.total_current,
                m.memory_plan(model::GptModel::no_optimizer_state).total())
          << k.modules[0];
      EXPECT_EQ(model::GptModel::plan_memory(with_selective(k.c, k.modules), 2, {}, {slots},
                                             model::GptModel::no_optimizer_state)
                    .total(),
                m.memory_plan(model::GptModel::no_optimizer_state).total())
          << k.modules[0];
      model::GptModel plain(k.c, 2, 3, {}, testing::test_device());
      plain.set_micro_batch_slots({slots});
      EXPECT_EQ(activations(plain) - activations(m), k.per_layer_slot * k.layers * slots - k.shared)
          << k.modules[0] << (k.c.moe.enabled() ? " moe" : " dense") << ", " << slots << " slots";
    }
}

// Selective moe: the MoE layers' dispatched rows and expert activations (R bytes a layer) share one set (which has a
// routing part of its own, r bytes, unused), so 3 MoE layers keep 3 R - R - r fewer bytes in one slot and
// 9 R - R - r in three; the tracked allocations equal the plan.
TEST(Recompute, SelectiveMoeSharesOneRefilledSet) {
  int64_t fewer[2] = {0, 0};
  for (int64_t slots : {1, 3}) {
    const MemoryStats before = memory_stats();
    model::GptModel m(with_selective(moe(false), {"moe"}), 2, 3, {}, testing::test_device());
    m.set_micro_batch_slots({slots});
    EXPECT_EQ(memory_stats().total_current - before.total_current,
              m.memory_plan(model::GptModel::no_optimizer_state).total());
    model::GptModel plain(moe(false), 2, 3, {}, testing::test_device());
    plain.set_micro_batch_slots({slots});
    fewer[slots == 3] = activations(plain) - activations(m);
  }
  EXPECT_EQ((fewer[1] - fewer[0]) % 6, 0) << fewer[0] << ", " << fewer[1];
  const int64_t R = (fewer[1] - fewer[0]) / 6, r = 2 * R - fewer[0];
  EXPECT_GT(r, 0);
  EXPECT_LT(r, R);
}

// (MoE scratch is allocated as workspace and planned with the caches: the totals agree.)
TEST(Recompute, MoeMemoryPlanEqualsTrackedAllocations) {
  for (const auto& [method, n] : std::vector<std::pair<std::string, int64_t>>{{"uniform", 2}, {"block", 2}}) {
    const MemoryStats before = memory_stats();
    const model::ModelConfig c = with_recompute(moe(false), method, n);
    const int64_t ahead = model::GptModel::plan_memory(c, 2, {}, {2}, model::GptModel::no_optimizer_state)
                              .total();  // (allocates nothing)
    model::GptModel m(c, 2, 3, {}, testing::test_device());
    EXPECT_EQ(memory_stats().total_current - before.total_current,
              m.memory_plan(model::GptModel::no_optimizer_state).total())
        << method;
    m.set_micro_batch_slots({2});
    EXPECT_EQ(memory_stats().total_current - before.total_current,
              m.memory_plan(model::GptModel::no_optimizer_state).total())
        << method;
    EXPECT_EQ(ahead, m.memory_plan(model::GptModel::no_optimizer_state).total()) << method;
    model::GptModel plain(moe(false), 2, 3, {}, testing::test_device());
    plain.set_micro_batch_slots({2});
    EXPECT_LT(activations(m), activations(plain)) << method;
  }
}

TEST(Recompute, BadSettingsNameTheFlags) {
  auto expect = [](model::RecomputeConfig rc, const std::string& text) {
    model::ModelConfig c = dense(2);
    c.recompute = rc;
    testing::expect_error([&] { c.validate(); }, {text});
  };
  expect({"full", "", 1, {}}, "--recompute-granularity full needs --recompute-method uniform or block, got 'unset'");
  expect({"full", "blocks", 1, {}}, "got 'blocks'");
  expect({"full", "uniform", 0, {}}, "--recompute-num-layers >= 1, got 0");
  expect({"", "uniform", 0, {}}, "need --recompute-granularity full");
  expect({"everything", "uniform", 1, {}}, "--recompute-granularity 'everything' is not one of full, selective");
  expect({"selective", "", 0, {"moe_act", "mla_up_proj"}},
         "--recompute-modules mla_up_proj needs --multi-latent-attention");
  expect({"selective", "", 0, {"attention"}}, "'attention' is not one of core_attn, moe_act, layernorm");
  expect({"selective", "uniform", 1, {"moe_act"}}, "are for --recompute-granularity full, not selective");
  expect({"full", "uniform", 1, {"moe_act"}}, "--recompute-modules needs --recompute-granularity selective");
}

}  // namespace
}  // namespace moecore
