// Megatron-FSDP's memory plan (train::fsdp_memory_plan; the MPI test MegatronFsdpMemoryPlanEqualsAllocation shows it
// equals what a rank allocates): issue 31's target -- under optim_grads_params at DP 4 the per-rank parameter, gradient
// and optimizer-state bytes are within 5% of a quarter of the unsharded figure plus one layer's gathered parameters --
// on a Mixtral-8x7B-shaped model built on the meta device (no memory), and each strategy's bytes fall as it shards
// more. The figures are printed for docs/performance.md.
#include <gtest/gtest.h>

#include <cstdio>

#include "moecore/model/gpt.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/trainer.h"

namespace moecore {
namespace {

// Mixtral 8x7B's shapes (32 layers of 8 experts, top-2), at a short sequence: the plan's parameters do not depend on
// it.
model::ModelConfig mixtral_like() {
  model::ModelConfig c;
  c.num_layers = 32;
  c.hidden_size = 4096;
  c.num_attention_heads = 32;
  c.num_query_groups = 8;
  c.ffn_hidden_size = 14336;
  c.vocab_size = 32000;
  c.seq_length = 64;
  c.untie_embeddings_and_output_weights = true;
  c.compute_dtype = DType::bf16;
  c.moe.num_experts = 8;
  c.moe.router_topk = 2;
  c.moe.ffn_hidden_size = 14336;
  return c;
}

int64_t state_bytes(const model::MemoryPlan& p) {
  return p.bytes[static_cast<int>(MemCategory::parameters)] + p.bytes[static_cast<int>(MemCategory::gradients)] +
         p.bytes[static_cast<int>(MemCategory::optimizer_state)];
}

TEST(FsdpPlan, OptimGradsParamsAtDp4IsAQuarterPlusOneLayer) {
  const model::ModelConfig c = mixtral_like();
  const model::GptModel meta(c, 1, 0, {}, Device::meta);
  train::TrainConfig t;
  t.use_distributed_optimizer = true;
  const optim::AdamWConfig adam;
  const model::MemoryPlan whole = meta.memory_plan(train::optimizer_state_bytes(t, adam));
  const int64_t unsharded = state_bytes(whole);
  // One decoder layer's gathered parameters (f32 masters and bf16 compute copies): the largest unit.
  int64_t layer = 0;
  for (const auto& [first, end] : meta.fsdp_units()) {
    int64_t b = 0;
    for (size_t i = first; i < end; ++i) {
      const Param& p = meta.params()[i];
      b += p.value.nbytes() + (p.compute.same_data(p.value) ? 0 : p.compute.nbytes());
    }
    layer = std::max(layer, b);
  }
  int64_t previous = unsharded;
  for (train::FsdpStrategy s : {train::FsdpStrategy::optim_grads, train::FsdpStrategy::optim_grads_params}) {
    t.fsdp = s;
    const int64_t got = state_bytes(train::fsdp_memory_plan(meta, whole, t, adam, 4, 4, 1));
    std::printf(
        "[ fsdp plan ] %s at DP 4: %.2f GiB of parameters, gradients and optimizer state per rank (unsharded "
        "%.2f GiB; a quarter plus one layer %.2f GiB)\n",
        s == train::FsdpStrategy::optim_grads ? "optim_grads" : "optim_grads_params",
        static_cast<double>(got) / (1 << 30), static_cast<double>(unsharded) / (1 << 30),
        static_cast<double>(unsharded / 4 + layer) / (1 << 30));
    EXPECT_LT(got, previous);
    previous = got;
  }
  EXPECT_LE(static_cast<double>(previous), 1.05 * static_cast<double>(unsharded / 4 + layer));
  t.fsdp = train::FsdpStrategy::optim;  // (the distributed optimizer's plan: apps' run_memory_plan divides the state)
  EXPECT_EQ(state_bytes(train::fsdp_memory_plan(meta, whole, t, adam, 4, 4, 1)), unsharded);
}

}  // namespace
}  // namespace moecore
