// Layer-2 tests of the training step's pieces for pipeline schedules: the 1F1B order (Megatron's warm-up, steady
// state and cool-down per stage), and the model's activation slots -- several micro-batches between forward and
// backward at once give the gradients of one micro-batch after another, and every slot is in the memory plan.
#include <cstring>
#include <set>

#include "moecore/core/memory.h"
#include "moecore/core/rng.h"
#include "moecore/model/gpt.h"
#include "moecore/train/schedule.h"
#include "test_util.h"

namespace moecore {
namespace {

TEST(Schedule, OneFOneBIsMegatronsOrderPerStage) {
  // 4 stages, 4 micro-batches: stage s runs 3 - s warm-up forwards.
  EXPECT_EQ(train::one_f_one_b(4, 4, 0).str(), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(train::one_f_one_b(4, 4, 1).str(), "F0 F1 F2 B0 F3 B1 B2 B3");
  EXPECT_EQ(train::one_f_one_b(4, 4, 2).str(), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(train::one_f_one_b(4, 4, 3).str(), "F0 B0 F1 B1 F2 B2 F3 B3");
  EXPECT_EQ(train::one_f_one_b(4, 4, 0).in_flight, 4);
  EXPECT_EQ(train::one_f_one_b(4, 4, 2).in_flight, 2);
  EXPECT_EQ(train::one_f_one_b(4, 4, 3).in_flight, 1);
  // Fewer micro-batches than stages: the warm-up is cut to them.
  EXPECT_EQ(train::one_f_one_b(2, 4, 0).str(), "F0 F1 B0 B1");
  EXPECT_EQ(train::one_f_one_b(2, 4, 0).in_flight, 2);
  // One stage: gradient accumulation.
  EXPECT_EQ(train::one_f_one_b(3).str(), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(train::one_f_one_b(3).in_flight, 1);
}

TEST(Schedule, EveryMicroBatchRunsOnceAndItsSlotIsFreeWhenItStarts) {
  for (int64_t p = 1; p <= 5; ++p)
    for (int64_t s = 0; s < p; ++s)
      for (int64_t m = 1; m <= 9; ++m) {
        const train::Schedule sch = train::one_f_one_b(m, p, s);
        ASSERT_EQ(static_cast<int64_t>(sch.ops.size()), 2 * m);
        std::set<int64_t> forwarded, busy_slots;
        int64_t next_backward = 0, most = 0;
        for (const train::ScheduleOp& op : sch.ops) {
          if (op.kind == train::ScheduleOp::forward) {
            EXPECT_TRUE(forwarded.insert(op.micro_batch).second) << sch.str();
            EXPECT_TRUE(busy_slots.insert(sch.slot(op.micro_batch)).second) << "slot reused early: " << sch.str();
          } else {
            EXPECT_EQ(op.micro_batch, next_backward++) << "backwards in forward order: " << sch.str();
            EXPECT_TRUE(forwarded.count(op.micro_batch)) << sch.str();
            busy_slots.erase(sch.slot(op.micro_batch));
          }
          most = std::max(most, static_cast<int64_t>(busy_slots.size()));
        }
        EXPECT_EQ(next_backward, m);
        EXPECT_EQ(most, sch.in_flight) << sch.str();
      }
}

TEST(Schedule, BadArgumentsAreErrors) {
  EXPECT_THROW(train::one_f_one_b(0), Error);
  EXPECT_THROW(train::one_f_one_b(4, 2, 2), Error);
  EXPECT_THROW(train::one_f_one_b(4, 0, 0), Error);
}

// Megatron's --pipeline-model-parallel-layout syntax: '|' between stages, 'x*N' and '(...)*N' repeats, commas ignored,
// empty stages; moecore's placement rules (E first, MTP and L last) and counts are checked, naming the layout.
TEST(PipelineLayout, ParsesMegatronsSyntax) {
  using model::pipeline_layout_stage_layers;
  EXPECT_EQ(pipeline_layout_stage_layers("Et*3|(tt|)*2,tmL", 8, 1, 4), (std::vector<int64_t>{3, 2, 2, 1}));
  EXPECT_EQ(pipeline_layout_stage_layers("E||t|tL", 2, 0, 4), (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(pipeline_layout_stage_layers("E, t*2 | t*2, L", 4, 0, 2), (std::vector<int64_t>{2, 2}));
}

TEST(PipelineLayout, BadLayoutsNameTheProblem) {
  using model::pipeline_layout_stage_layers;
  auto error = [](const std::string& layout, int64_t layers, int64_t mtp, int64_t pp, const std::string& text) {
    testing::expect_error([&] { pipeline_layout_stage_layers(layout, layers, mtp, pp); },
                          {"--pipeline-model-parallel-layout '" + layout + "'", text});
  };
  error("Et|tL", 3, 0, 2, "names 2 decoder layers (t), --num-layers is 3");
  error("Et|t|t|tL", 4, 0, 2, "4 stages make 2 virtual stages per rank");
  error("Et|t|tL", 3, 0, 2, "3 stages for --pipeline-model-parallel-size 2");
  error("tE|tL", 2, 0, 2, "the embedding (E) must appear once, first on the first stage");
  error("Et|Lt", 2, 0, 2, "the loss (L) must appear once, last on the last stage");
  error("Etm|tL", 2, 1, 2, "MTP layers (m) on the last stage");
  error("Et|tmL", 2, 2, 2, "names 1 MTP layers (m), --mtp-num-layers is 2");
  error("Et|tX", 2, 0, 2, "'X' is not one of");
  error("E(t|tL", 2, 0, 2, "unclosed '('");
  error("Et)|tL", 2, 0, 2, "unmatched ')'");
  error("Et*|tL", 2, 0, 2, "'*' needs a repeat count");
}

model::ModelConfig slots_config(bool moe, bool tied, int64_t mtp) {
  model::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 48;
  c.vocab_size = 64;
  c.seq_length = 16;
  c.hidden_dropout = 0.1f;  // masks keyed per micro-batch: each slot keeps its own
  c.untie_embeddings_and_output_weights = !tied;
  c.mtp_num_layers = mtp;
  if (moe) {
    c.moe.num_experts = 4;
    c.moe.router_topk = 2;
    c.moe.ffn_hidden_size = 24;
    c.moe.aux_loss_coeff = {1e-2f};
  }
  return c;
}

Tensor random_ids(int64_t B, int64_t S, int64_t V, const std::string& name) {
  Tensor t = Tensor::empty({B, S}, DType::i32, MemCategory::other);
  for (int64_t i = 0; i < B * S; ++i)
    t.data<int32_t>()[i] = static_cast<int32_t>(philox_uniform(philox_key(3, name), i) * V);
  return t;
}

struct Grads {
  std::vector<double> losses;
  std::vector<Tensor> grads;
};

// Three micro-batches: one after another in slot 0, or all forwards (slots 0..2) before the backwards in `order`.
Grads run(const model::ModelConfig& c, bool pipelined, const std::vector<int64_t>& order = {0, 1, 2}) {
  model::GptModel m(c, 2, 7, {}, testing::test_device());
  m.set_micro_batch_slots(pipelined ? 3 : 1);
  m.zero_grad();
  Grads out;
  auto fwd = [&](int64_t mb, int64_t slot) {
    m.set_dropout_step(0, mb);
    const std::string n = std::to_string(mb);
    out.losses.push_back(
        m.forward(slot, random_ids(2, 16, 64, "tok" + n), random_ids(2, 16, 64, "lab" + n), 1.0f / 3).mean());
  };
  if (pipelined) {
    for (int64_t mb = 0; mb < 3; ++mb) fwd(mb, mb);
    for (int64_t mb : order) m.backward(mb, 1.0f / 3);
  } else {
    for (int64_t mb = 0; mb < 3; ++mb) {
      fwd(mb, 0);
      m.backward(0, 1.0f / 3);
    }
  }
  for (const Param& p : m.params()) out.grads.push_back(testing::host(p.grad));
  return out;
}

// Untied, without MTP, every parameter's gradient adds the micro-batches' parts in the same order either way: equal
// bits. A tied embedding (or MTP) takes the loss heads' parts during the forwards, so its sums are reordered.
TEST(GptModelSlots, MicroBatchesInFlightGiveTheSequentialGradients) {
  for (bool moe : {false, true})
    for (bool tied : {false, true})
      for (int64_t mtp : {0, 1}) {
        const model::ModelConfig c = slots_config(moe, tied, mtp);
        const Grads seq = run(c, false), pipe = run(c, true), reversed = run(c, true, {2, 0, 1});
        const bool bitwise = !tied && mtp == 0;
        SCOPED_TRACE(std::string(moe ? "moe" : "dense") + (tied ? " tied" : " untied") + " mtp " + std::to_string(mtp));
        ASSERT_EQ(seq.losses, pipe.losses);  // forwards do not depend on other slots
        for (size_t i = 0; i < seq.grads.size(); ++i) {
          if (bitwise)
            EXPECT_EQ(std::memcmp(seq.grads[i].raw(), pipe.grads[i].raw(), static_cast<size_t>(seq.grads[i].nbytes())),
                      0)
                << i;
          else
            EXPECT_TENSOR_NEAR(pipe.grads[i], seq.grads[i], 1e-5, 1e-7);
          EXPECT_TENSOR_NEAR(reversed.grads[i], seq.grads[i], 1e-5, 1e-7);
        }
      }
}

TEST(GptModelSlots, EverySlotIsInTheMemoryPlan) {
  for (bool moe : {false, true}) {
    const model::ModelConfig c = slots_config(moe, false, 1);
    model::GptModel m(c, 2, 7, {}, testing::test_device());
    const int64_t act = static_cast<int>(MemCategory::activations);
    const int64_t one = m.memory_plan(0).bytes[act];
    const MemoryStats before = memory_stats();
    m.set_micro_batch_slots(3);
    const MemoryStats after = memory_stats();
    const int64_t three = m.memory_plan(0).bytes[act];
    EXPECT_EQ(after.current[act] - before.current[act], three - one);
    m.set_micro_batch_slots(2);
    const int64_t two = m.memory_plan(0).bytes[act];
    EXPECT_GT(two, one);
    EXPECT_EQ(three - two, two - one);  // each slot the same bytes (MoE scratch: once, in slot 0)
    EXPECT_EQ(memory_stats().current[act] - before.current[act], two - one);
  }
}

TEST(GptModelSlots, SlotOutOfRangeIsAnError) {
  model::GptModel m(slots_config(false, false, 0), 2, 7, {}, testing::test_device());
  m.set_micro_batch_slots(2);
  try {
    m.forward(2, random_ids(2, 16, 64, "t"), random_ids(2, 16, 64, "l"), 1.0f);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot 2 out of range: the model has 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.set_micro_batch_slots(0), Error);
}

}  // namespace
}  // namespace moecore
