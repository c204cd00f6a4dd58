// Layer-2 tests of the training step's pieces for pipeline schedules: the 1F1B and interleaved 1F1B orders (Megatron's
// warm-up, steady state and cool-down per stage), the transfers between stages (every stage's plan completes against
// the others', messages matched in order), and the model's activation slots -- several micro-batches between forward
// and backward at once give the gradients of one micro-batch after another, and every slot is in the memory plan.
#include <cstring>
#include <map>
#include <set>
#include <tuple>

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
  EXPECT_EQ(train::one_f_one_b(4, 4, 0).in_flight[0], 4);
  EXPECT_EQ(train::one_f_one_b(4, 4, 2).in_flight[0], 2);
  EXPECT_EQ(train::one_f_one_b(4, 4, 3).in_flight[0], 1);
  // Fewer micro-batches than stages: the warm-up is cut to them.
  EXPECT_EQ(train::one_f_one_b(2, 4, 0).str(), "F0 F1 B0 B1");
  EXPECT_EQ(train::one_f_one_b(2, 4, 0).in_flight[0], 2);
  // One stage: gradient accumulation.
  EXPECT_EQ(train::one_f_one_b(3).str(), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(train::one_f_one_b(3).in_flight[0], 1);
}

// Every (micro-batch, chunk) runs forward once and backward once after it; each chunk runs its backwards in forward
// order; a slot is never taken while busy, and in_flight is the most a chunk holds.
void expect_valid(const train::Schedule& sch, int64_t m, int64_t chunks) {
  ASSERT_EQ(static_cast<int64_t>(sch.ops.size()), 2 * m * chunks) << sch.str();
  ASSERT_EQ(static_cast<int64_t>(sch.in_flight.size()), chunks);
  std::set<std::pair<int64_t, int64_t>> forwarded;
  std::vector<std::set<int64_t>> busy(static_cast<size_t>(chunks));
  std::vector<int64_t> next_backward(static_cast<size_t>(chunks), 0), most(static_cast<size_t>(chunks), 0);
  for (const train::ScheduleOp& op : sch.ops) {
    const auto c = static_cast<size_t>(op.chunk);
    if (op.kind == train::ScheduleOp::forward) {
      EXPECT_TRUE(forwarded.insert({op.micro_batch, op.chunk}).second) << sch.str();
      EXPECT_TRUE(busy[c].insert(sch.slot(op)).second) << "slot reused early: " << sch.str();
    } else {
      EXPECT_EQ(op.micro_batch, next_backward[c]++) << "backwards in forward order: " << sch.str();
      EXPECT_TRUE(forwarded.count({op.micro_batch, op.chunk})) << sch.str();
      busy[c].erase(sch.slot(op));
    }
    most[c] = std::max(most[c], static_cast<int64_t>(busy[c].size()));
  }
  for (size_t c = 0; c < busy.size(); ++c) {
    EXPECT_EQ(next_backward[c], m);
    EXPECT_EQ(most[c], sch.in_flight[c]) << sch.str();
  }
}

TEST(Schedule, EveryMicroBatchRunsOnceAndItsSlotIsFreeWhenItStarts) {
  for (int64_t p = 1; p <= 5; ++p)
    for (int64_t s = 0; s < p; ++s)
      for (int64_t m = 1; m <= 9; ++m) expect_valid(train::one_f_one_b(m, p, s), m, 1);
}

TEST(Schedule, InterleavedIsMegatronsOrderPerStage) {
  // Megatron's schedule table for PP 2, 5 micro-batches in groups of 3, 2 chunks: micro-batches 0 1 2 0 1 2 3 4 3 4
  // through chunks 0 0 0 1 1 1 0 0 1 1. Stage 0 runs (2 - 0 - 1) * 2 + (2 - 1) * 3 = 5 warm-up forwards, stage 1 three;
  // the backwards take the table with the chunks reversed.
  EXPECT_EQ(train::interleaved_one_f_one_b(5, 2, 0, 2, 3).str(),
            "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 B0.1 F3.0 B1.1 F4.0 B2.1 F3.1 B0.0 F4.1 B1.0 B2.0 B3.1 B4.1 B3.0 B4.0");
  EXPECT_EQ(train::interleaved_one_f_one_b(5, 2, 1, 2, 3).str(),
            "F0.0 F1.0 F2.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.0 B0.0 F4.0 B1.0 F3.1 B2.0 F4.1 B3.1 B4.1 B3.0 B4.0");
  // As many micro-batches as stages (the default group): every forward is warm-up on the first stage.
  EXPECT_EQ(train::interleaved_one_f_one_b(2, 2, 0, 2, 2).str(), "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0");
  EXPECT_EQ(train::interleaved_one_f_one_b(2, 2, 0, 2, 2).in_flight, (std::vector<int64_t>{2, 2}));
}

TEST(Schedule, InterleavedRunsEveryMicroBatchThroughEveryChunkOnce) {
  for (int64_t p = 2; p <= 4; ++p)
    for (int64_t v = 2; v <= 3; ++v)
      for (int64_t m = p; m <= 9; ++m)
        for (int64_t g = p; g <= m; ++g) {
          if (m % g != 0 && m % g < p) continue;
          for (int64_t s = 0; s < p; ++s) expect_valid(train::interleaved_one_f_one_b(m, p, s, v, g), m, v);
        }
}

// Runs every stage's transfer plan against the others with rendezvous semantics (a send completes once its receive is
// posted, a receive once its send is): fails when no stage can move on before all are done (a deadlock), or when a
// message lands in a buffer meant for another micro-batch or chunk.
void expect_transfers_complete(const std::vector<train::Schedule>& schedules, const std::string& what) {
  using A = train::P2PAction;
  const auto p = static_cast<int64_t>(schedules.size());
  const auto v = static_cast<int64_t>(schedules[0].in_flight.size());
  std::vector<std::vector<A>> plans;
  for (int64_t r = 0; r < p; ++r) plans.push_back(train::pipeline_transfers(schedules[static_cast<size_t>(r)], p, r));
  // Per (stream, sender, receiver): the (chunk, micro-batch) of every posted send, as the receiver will see it; and
  // the receives posted so far.
  using Key = std::tuple<int, int64_t, int64_t>;
  std::map<Key, std::vector<std::pair<int64_t, int64_t>>> sent, recvd;
  std::map<std::tuple<int, int64_t, int64_t, int64_t>, size_t> index;  // (stream, rank, chunk, mb) -> its position
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  auto peer = [&](const A& a, int64_t r, bool send) {  // activations go up the stages, gradients down (wrapping)
    const bool up = (a.stream == A::activations) == send;
    return up ? (r + 1) % p : (r + p - 1) % p;
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t r = 0; r < p; ++r) {
      auto& i = pc[static_cast<size_t>(r)];
      const auto& plan = plans[static_cast<size_t>(r)];
      for (; i < plan.size(); ++i, moved = true) {
        const A& a = plan[i];
        const int s = a.stream;
        if (a.kind == A::run) continue;
        if (a.kind == A::post_send) {  // as the receiver's chunk: the next stage's, across the wrap the next chunk
          const int64_t to = peer(a, r, true);
          const bool wraps = a.stream == A::activations ? r == p - 1 : r == 0;
          const int64_t chunk = a.chunk + (wraps ? (a.stream == A::activations ? 1 : -1) : 0);
          auto& q = sent[{s, r, to}];
          index[{s, r, a.chunk, a.micro_batch}] = q.size();
          q.emplace_back(chunk, a.micro_batch);
        } else if (a.kind == A::post_recv) {
          auto& q = recvd[{s, peer(a, r, false), r}];
          index[{s, r, a.chunk, a.micro_batch}] = q.size();
          q.emplace_back(a.chunk, a.micro_batch);
        } else if (a.kind == A::wait_recv) {
          const size_t k = index.at({s, r, a.chunk, a.micro_batch});
          const auto& q = sent[{s, peer(a, r, false), r}];
          if (q.size() <= k) break;  // not sent yet
          EXPECT_EQ(q[k], std::make_pair(a.chunk, a.micro_batch)) << what << ": stage " << r << " received another "
                                                                  << "message than it expected";
        } else {  // wait_send
          const size_t k = index.at({s, r, a.chunk, a.micro_batch});
          if (recvd[{s, r, peer(a, r, true)}].size() <= k) break;
        }
      }
    }
  }
  for (int64_t r = 0; r < p; ++r)
    EXPECT_EQ(pc[static_cast<size_t>(r)], plans[static_cast<size_t>(r)].size())
        << what << ": stage " << r << " of " << p << " (" << v << " chunks) is stuck: " << schedules[r].str();
}

TEST(Schedule, TransfersBetweenStagesCompleteInOrder) {
  for (int64_t p = 2; p <= 5; ++p)
    for (int64_t m = 1; m <= 9; ++m) {
      std::vector<train::Schedule> s;
      for (int64_t r = 0; r < p; ++r) s.push_back(train::one_f_one_b(m, p, r));
      expect_transfers_complete(s, "1F1B p " + std::to_string(p) + " m " + std::to_string(m));
    }
  for (int64_t p = 2; p <= 4; ++p)
    for (int64_t v = 2; v <= 3; ++v)
      for (int64_t m = p; m <= 10; ++m)
        for (int64_t g = p; g <= m; ++g) {
          if (m % g != 0 && m % g < p) continue;
          std::vector<train::Schedule> s;
          for (int64_t r = 0; r < p; ++r) s.push_back(train::interleaved_one_f_one_b(m, p, r, v, g));
          expect_transfers_complete(s, "interleaved p " + std::to_string(p) + " v " + std::to_string(v) + " m " +
                                           std::to_string(m) + " g " + std::to_string(g));
        }
  // The plan's shape: the last stage of two receives micro-batch 0's activations before running it, sends nothing
  // forward, and sends its input's gradient after the backward.
  const auto plan = train::pipeline_transfers(train::one_f_one_b(1, 2, 1), 2, 1);
  ASSERT_EQ(plan.size(), 6u);
  EXPECT_EQ(plan[0].kind, train::P2PAction::post_recv);
  EXPECT_EQ(plan[1].kind, train::P2PAction::wait_recv);
  EXPECT_EQ(plan[2].kind, train::P2PAction::run);
  EXPECT_EQ(plan[3].kind, train::P2PAction::run);
  EXPECT_EQ(plan[4].kind, train::P2PAction::post_send);
  EXPECT_EQ(plan[4].stream, train::P2PAction::gradients);
  EXPECT_EQ(plan[5].kind, train::P2PAction::wait_send);
}

TEST(Schedule, BadArgumentsAreErrors) {
  EXPECT_THROW(train::one_f_one_b(0), Error);
  EXPECT_THROW(train::one_f_one_b(4, 2, 2), Error);
  EXPECT_THROW(train::one_f_one_b(4, 0, 0), Error);
  // Megatron's conditions on the interleaved schedule, named in the error.
  testing::expect_error([] { train::interleaved_one_f_one_b(4, 2, 0, 2, 5); }, {"must lie in [pipeline size 2"});
  testing::expect_error([] { train::interleaved_one_f_one_b(4, 4, 0, 2, 2); }, {"must lie in [pipeline size 4"});
  testing::expect_error([] { train::interleaved_one_f_one_b(7, 2, 0, 2, 3); }, {"is 1: it must be 0 or at least"});
  EXPECT_THROW(train::interleaved_one_f_one_b(4, 1, 0, 2, 1), Error);
  EXPECT_THROW(train::interleaved_one_f_one_b(4, 2, 0, 1, 2), Error);
}

// Megatron's --pipeline-model-parallel-layout syntax: '|' between stages, 'x*N' and '(...)*N' repeats, commas ignored,
// empty stages; moecore's placement rules (E first, MTP and L last) and counts are checked, naming the layout.
TEST(PipelineLayout, ParsesMegatronsSyntax) {
  using model::pipeline_layout_stage_layers;
  EXPECT_EQ(pipeline_layout_stage_layers("Et*3|(tt|)*2,tmL", 8, 1, 4), (std::vector<int64_t>{3, 2, 2, 1}));
  EXPECT_EQ(pipeline_layout_stage_layers("E||t|tL", 2, 0, 4), (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(pipeline_layout_stage_layers("E, t*2 | t*2, L", 4, 0, 2), (std::vector<int64_t>{2, 2}));
  // Twice as many stages as ranks: two model chunks per rank, virtual stage k on rank k % pp.
  EXPECT_EQ(pipeline_layout_stage_layers("Et|t|tt|tL", 5, 0, 2), (std::vector<int64_t>{1, 1, 2, 1}));
}

TEST(PipelineLayout, BadLayoutsNameTheProblem) {
  using model::pipeline_layout_stage_layers;
  auto error = [](const std::string& layout, int64_t layers, int64_t mtp, int64_t pp, const std::string& text) {
    testing::expect_error([&] { pipeline_layout_stage_layers(layout, layers, mtp, pp); },
                          {"--pipeline-model-parallel-layout '" + layout + "'", text});
  };
  error("Et|tL", 3, 0, 2, "names 2 decoder layers (t), --num-layers is 3");
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
  m.set_micro_batch_slots({pipelined ? 3 : 1});
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
    const int64_t one = m.memory_plan(model::GptModel::no_optimizer_state).bytes[act];
    const MemoryStats before = memory_stats();
    m.set_micro_batch_slots({3});
    const MemoryStats after = memory_stats();
    const int64_t three = m.memory_plan(model::GptModel::no_optimizer_state).bytes[act];
    EXPECT_EQ(after.current[act] - before.current[act], three - one);
    m.set_micro_batch_slots({2});
    const int64_t two = m.memory_plan(model::GptModel::no_optimizer_state).bytes[act];
    EXPECT_GT(two, one);
    EXPECT_EQ(three - two, two - one);  // each slot the same bytes (MoE scratch: once, in slot 0)
    EXPECT_EQ(memory_stats().current[act] - before.current[act], two - one);
  }
}

TEST(GptModelSlots, SlotOutOfRangeIsAnError) {
  model::GptModel m(slots_config(false, false, 0), 2, 7, {}, testing::test_device());
  m.set_micro_batch_slots({2});
  try {
    m.forward(2, random_ids(2, 16, 64, "t"), random_ids(2, 16, 64, "l"), 1.0f);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot 2 out of range: chunk 0 has 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.set_micro_batch_slots({0}), Error);
}

}  // namespace
}  // namespace moecore
