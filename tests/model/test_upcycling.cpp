// Upcycling (docs/megatron-moe-spec.md §10): a dense model turned into an MoE model computes the same function —
// exactly for granularity 1 with post-softmax routing, and within Megatron's 0.1 tolerance for granular upcycling. Both
// models live on testing::test_device(); logits and parameters are read through host copies.
#include "moecore/model/upcycling.h"
#include "test_util.h"

namespace moecore {
namespace {

model::ModelConfig base_config() {
  model::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 64;
  c.vocab_size = 50;
  c.seq_length = 8;
  return c;
}

model::GptModel make_model(const model::ModelConfig& c, uint64_t seed) {
  return model::GptModel(c, 1, seed, {}, testing::test_device());
}

Tensor logits_of(model::GptModel& m) {
  Tensor tok = Tensor::empty({1, 8}, DType::i32);
  for (int i = 0; i < 8; ++i) tok.data<int32_t>()[i] = (7 * i + 3) % 50;
  Tensor logits = Tensor::empty({8, 50}, DType::f32, MemCategory::other, testing::test_device());
  m.forward_logits(logits, tok);
  return logits;
}

model::ModelConfig moe_config(int64_t E, int64_t F) {
  model::ModelConfig c = base_config();
  c.moe.num_experts = E;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = F;
  return c;
}

TEST(Upcycling, Granularity1ReproducesTheDenseModel) {
  model::GptModel dense = make_model(base_config(), 3);
  model::GptModel moe = make_model(moe_config(4, 64), 4);
  model::upcycle_dense_to_moe(dense, moe);
  // Every expert is the dense MLP and post-softmax top-k weights sum to 1: same function up to float32 sums.
  EXPECT_TENSOR_NEAR(logits_of(moe), logits_of(dense), 1e-4, 1e-5);
}

TEST(Upcycling, GranularUpcyclingApproximatesTheDenseModel) {
  model::GptModel dense = make_model(base_config(), 3);
  model::GptModel moe = make_model(moe_config(4, 32), 4);  // g = 64 / 32 = 2
  model::upcycle_dense_to_moe(dense, moe);
  // Megatron's test tolerance for granular upcycling (silu(w z) != w silu(z)).
  EXPECT_TENSOR_NEAR(logits_of(moe), logits_of(dense), 0.1, 0.1);
  // Router rows are tied in blocks of g.
  const Tensor r = testing::host(moe.param("decoder.layers.0.mlp.router.weight").value);
  EXPECT_EQ(r.data<float>()[0 * 32 + 5], r.data<float>()[1 * 32 + 5]);
  EXPECT_EQ(r.data<float>()[2 * 32 + 7], r.data<float>()[3 * 32 + 7]);
}

TEST(Upcycling, RejectsIndivisibleSizes) {
  model::GptModel dense = make_model(base_config(), 3);
  model::GptModel moe = make_model(moe_config(3, 32), 4);  // g = 2 does not divide 3 experts
  EXPECT_THROW(model::upcycle_dense_to_moe(dense, moe), Error);
}

}  // namespace
}  // namespace moecore
