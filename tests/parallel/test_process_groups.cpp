// The rank generator without communication: the worked examples of docs/echo-folding-perf.md §B.4 table by
// table, invariants over every layout of worlds up to 32 ranks, and the start-up errors naming the values.
// Also the size-1 collectives (comm_single), which run identically in MPI and local builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>

#include "moecore/core/error.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"
#include "parallel_config.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::parallel_config;

using Groups = std::vector<std::vector<int>>;

Groups seq_groups(int n_groups, int size, int step_in,
                  int step_out) {  // [[0,step_in,...], [step_out,...], ...]
  Groups g(static_cast<size_t>(n_groups));
  for (int i = 0; i < n_groups; ++i)
    for (int k = 0; k < size; ++k) g[static_cast<size_t>(i)].push_back(i * step_out + k * step_in);
  return g;
}

Groups singletons(int n) {
  return seq_groups(n, 1, 1, 1);
}

const Groups& G(const RankLayout& l, GroupKind k) {
  return l.groups[static_cast<size_t>(k)];
}

using testing::error_of;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

// Example 1 — attention TP2 CP2 DP2 PP2; MoE ETP1 EP4 EDP2 PP2.
TEST(RankLayout, FoldingExample1) {
  const RankLayout l = rank_layout(parallel_config(2, 2, 2, 4, 1), 16, 8);
  EXPECT_EQ(l.sizes.dp, 2);
  EXPECT_EQ(l.sizes.edp, 2);
  EXPECT_EQ(G(l, GroupKind::tp), seq_groups(8, 2, 1, 2));
  EXPECT_EQ(G(l, GroupKind::cp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(G(l, GroupKind::dp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(G(l, GroupKind::dp_cp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(G(l, GroupKind::tp_cp), seq_groups(4, 4, 1, 4));
  EXPECT_EQ(G(l, GroupKind::pp), seq_groups(8, 2, 8, 1));
  EXPECT_EQ(G(l, GroupKind::etp), singletons(16));
  EXPECT_EQ(G(l, GroupKind::ep), seq_groups(4, 4, 1, 4));
  EXPECT_EQ(G(l, GroupKind::etp_ep), G(l, GroupKind::ep));
  EXPECT_EQ(G(l, GroupKind::edp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(G(l, GroupKind::etp_ep_pp), (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  // The point of folding: the EP all-to-all stays inside the attention TP×CP block.
  EXPECT_EQ(G(l, GroupKind::ep), G(l, GroupKind::tp_cp));
}

// Example 2 — attention TP2 DP4 PP2; MoE ETP1 EP8 EDP1 PP2 (EP 8 > DP 4).
TEST(RankLayout, FoldingExample2) {
  const RankLayout l = rank_layout(parallel_config(2, 1, 2, 8, 1), 16, 16);
  EXPECT_EQ(l.sizes.dp, 4);
  EXPECT_EQ(l.sizes.edp, 1);
  EXPECT_EQ(G(l, GroupKind::tp), seq_groups(8, 2, 1, 2));
  EXPECT_EQ(G(l, GroupKind::dp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(G(l, GroupKind::ep), seq_groups(2, 8, 1, 8));
  EXPECT_EQ(G(l, GroupKind::edp), singletons(16));
  EXPECT_EQ(G(l, GroupKind::pp), seq_groups(8, 2, 8, 1));
}

// Example 3 — attention TP4 DP2 PP2; MoE ETP2 EP2 EDP2 PP2.
TEST(RankLayout, FoldingExample3) {
  const RankLayout l = rank_layout(parallel_config(4, 1, 2, 2, 2), 16, 4);
  EXPECT_EQ(G(l, GroupKind::tp), seq_groups(4, 4, 1, 4));
  EXPECT_EQ(G(l, GroupKind::etp), seq_groups(8, 2, 1, 2));
  EXPECT_EQ(G(l, GroupKind::ep), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(G(l, GroupKind::etp_ep), G(l, GroupKind::tp));
  EXPECT_EQ(G(l, GroupKind::edp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(G(l, GroupKind::pp), seq_groups(8, 2, 8, 1));
}

// Counter-example 4 — attention TP2 DP4 PP2, MoE ETP1 EP2 EDP4, pp not last. The doc writes the order as
// "tp-pp-dp", which leaves out ep (size 2) and is refused first; with ep placed after pp the stated
// groups appear and the identical-pp-groups check fires even though EDP == DP.
TEST(RankLayout, CounterExample4PipelineGroupsDiffer) {
  ParallelConfig c = parallel_config(2, 1, 2, 2, 1);
  c.order = "tp-pp-dp";
  const std::string missing = error_of([&] { c.validate(16, 4); });
  EXPECT_HAS(missing, "leaves out ep, whose size is 2");
  c.order = "tp-pp-ep-dp";
  EXPECT_EQ(rank_generator_groups({2, 1, 1, 4, 2}, c.order, "pp"),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(rank_generator_groups({1, 1, 2, 4, 2}, c.order, "pp"), seq_groups(8, 2, 1, 2));
  const std::string msg = error_of([&] { c.validate(16, 4); });
  EXPECT_HAS(msg, "different pipeline groups");
  EXPECT_HAS(msg, "[0,2] [1,3]");
  EXPECT_HAS(msg, "[0,1] [2,3]");
}

// Megatron's enumeration details: member order follows the order string whatever the token's order, and
// size-1 dims missing from the order are appended.
TEST(RankGenerator, TokenOrderAndAppendedDims) {
  const RankGeneratorSizes s{2, 2, 1, 2, 1};
  EXPECT_EQ(rank_generator_groups(s, "tp-cp-ep-dp-pp", "dp-cp"), rank_generator_groups(s, "tp-cp-ep-dp-pp", "cp-dp"));
  EXPECT_EQ(rank_generator_groups(s, "tp-cp-dp", "dp"), rank_generator_groups(s, "tp-cp-ep-dp-pp", "dp"));
  EXPECT_EQ(rank_generator_groups({2, 1, 1, 2, 2}, "tp-cp-ep-pp-dp", "dp"), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(rank_generator_groups({2, 1, 1, 2, 2}, "tp-cp-ep-pp-dp", "pp"), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
}

// Every layout of every world up to 32 ranks: partitions, sizes, coordinates and the folding invariants.
TEST(RankLayout, InvariantsOverAllSmallWorlds) {
  int layouts = 0;
  for (int world = 1; world <= 32; ++world)
    for (int tp = 1; tp <= world; ++tp)
      for (int cp = 1; tp * cp <= world; ++cp)
        for (int pp = 1; tp * cp * pp <= world; ++pp)
          for (int ep = 1; ep * pp <= world; ++ep)
            for (int etp = 1; etp * ep * pp <= world; ++etp) {
              if (world % (tp * cp * pp) || world % (etp * ep * pp)) continue;
              const RankLayout l = rank_layout(parallel_config(tp, cp, pp, ep, etp), world, ep * 2);
              const ParallelSizes& s = l.sizes;
              ++layouts;
              const std::pair<GroupKind, int> expect[] = {{GroupKind::tp, tp},
                                                          {GroupKind::cp, cp},
                                                          {GroupKind::dp, s.dp},
                                                          {GroupKind::pp, pp},
                                                          {GroupKind::dp_cp, s.dp * cp},
                                                          {GroupKind::tp_cp, tp * cp},
                                                          {GroupKind::tp_dp, tp * s.dp},
                                                          {GroupKind::tp_dp_cp, world / pp},
                                                          {GroupKind::mp, tp * pp},
                                                          {GroupKind::etp, etp},
                                                          {GroupKind::ep, ep},
                                                          {GroupKind::etp_ep, etp * ep},
                                                          {GroupKind::etp_ep_pp, etp * ep * pp},
                                                          {GroupKind::edp, s.edp}};
              for (auto [kind, size] : expect) {
                std::vector<int> seen(static_cast<size_t>(world), 0);
                for (const auto& grp : G(l, kind)) {
                  ASSERT_EQ(static_cast<int>(grp.size()), size) << group_kind_name(kind) << " world " << world;
                  for (int r : grp) ++seen[static_cast<size_t>(r)];
                }
                ASSERT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }))
                    << group_kind_name(kind) << ": a rank is in zero or several groups (world " << world << ")";
              }
              // Folding: both layouts cover the same ranks per pipeline stage, and share the pp groups.
              const auto moe_stage = rank_generator_groups({etp, 1, ep, s.edp, pp}, s.order, "tp-ep-dp");
              ASSERT_EQ(moe_stage.size(), G(l, GroupKind::tp_dp_cp).size());
              for (size_t i = 0; i < moe_stage.size(); ++i) {
                const std::set<int> a(moe_stage[i].begin(), moe_stage[i].end());
                const auto& attn = G(l, GroupKind::tp_dp_cp)[i];
                ASSERT_EQ(a, std::set<int>(attn.begin(), attn.end())) << "stage " << i << " world " << world;
              }
              for (int r = 0; r < world; ++r) {
                const RankCoords c = l.coords(r);
                ASSERT_EQ(r, c.tp + tp * (c.cp + cp * (c.dp + s.dp * c.pp)));
                ASSERT_EQ(r, c.etp + etp * (c.ep + ep * (c.edp + s.edp * c.pp)));
              }
            }
  EXPECT_GT(layouts, 500);
}

TEST(ParallelConfig, ErrorsNameTheValues) {
  EXPECT_HAS(error_of([] { parallel_config(2, 1, 2, 1, 0).validate(6, 0); }),
             "world_size (6) must be divisible by tensor_model_parallel_size (2) x context_parallel_size (1) "
             "x pipeline_model_parallel_size (2) = 4");
  const std::string moe = error_of([] { parallel_config(1, 1, 1, 4, 1).validate(6, 8); });
  EXPECT_HAS(moe, "world_size (6)");
  EXPECT_HAS(moe, "expert_model_parallel_size (4)");
  EXPECT_HAS(error_of([] { parallel_config(1, 1, 1, 4, 1).validate(8, 6); }),
             "num_experts (6) must be divisible by expert_model_parallel_size (4)");
  EXPECT_HAS(error_of([] { parallel_config(1, 1, 1, 2, 1).validate(2, 0); }),
             "expert_model_parallel_size (2) > 1 needs an MoE model");
  EXPECT_HAS(error_of([] { parallel_config(0, 1, 1, 1, 1).validate(2, 0); }),
             "tensor_model_parallel_size (0) must be >= 1");
  EXPECT_HAS(error_of([] { parallel_config(1, 1, 1, 1, -1).validate(2, 0); }), "expert_tensor_parallel_size (-1)");
  EXPECT_HAS(error_of([] { parallel_config(1, 1, 1, 1, 1).validate(0, 0); }), "world_size (0) must be >= 1");
  ParallelConfig c = parallel_config(1, 1, 2, 2, 1);
  c.order = "tp-cp-ep-pp-dp";  // pp not last: EDP (2) != DP (4) with PP 2
  const std::string order = error_of([&] { c.validate(8, 4); });
  EXPECT_HAS(order, "DP (4) must equal the expert data-parallel size EDP (2)");
  c.order = "tp-cp-ep-dp-pp-xx";
  EXPECT_HAS(error_of([&] { c.validate(8, 4); }), "unknown dim \"xx\"");
  c.order = "tp-cp-tp-ep-dp-pp";
  EXPECT_HAS(error_of([&] { c.validate(8, 4); }), "lists \"tp\" twice");
  ParallelConfig d = parallel_config(1, 1, 1, 2, 1);
  d.num_distributed_optimizer_instances = 4;  // DP·CP = 6
  EXPECT_HAS(error_of([&] { d.validate(6, 4); }),
             "(6 x 1 = 6) must be divisible by num_distributed_optimizer_instances (4)");
  // ETP defaults to TP (Megatron): world 4, TP 2, EP 4 -> ETP·EP = 8 does not divide 4.
  EXPECT_HAS(error_of([] { parallel_config(2, 1, 1, 4, 0).validate(4, 8); }),
             "expert_tensor_parallel_size (2, from tensor_model_parallel_size)");
}

// ---------------------------------------------------------------------------------------------------
// Size-1 groups: collectives are identities and argument errors name the op, group and sizes.
// ---------------------------------------------------------------------------------------------------

TEST(CommSingle, CollectivesAreIdentities) {
  const ProcessGroup g = comm_single("solo");
  EXPECT_EQ(g.size(), 1);
  EXPECT_EQ(g.rank(), 0);
  std::vector<float> a = {1.5f, -2.0f, 3.25f};
  all_reduce_sum(a, g);
  EXPECT_EQ(a, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<float> out(3);
  all_gather(out, a, g);
  EXPECT_EQ(out, a);
  std::vector<int64_t> counts = {3};
  std::fill(out.begin(), out.end(), 0.0f);
  all_gather_v(out, a, counts, g);
  EXPECT_EQ(out, a);
  std::vector<double> rs_in = {1.0, 2.0}, rs_out(2);
  reduce_scatter_sum(rs_out, rs_in, g);
  EXPECT_EQ(rs_out, rs_in);
  std::vector<int64_t> i_in = {7, 8, 9}, i_out(3);
  all_to_all_v(i_out, counts, i_in, counts, g);
  EXPECT_EQ(i_out, i_in);
  broadcast(a, 0, g);
  barrier(g);
  Tensor t = Tensor::zeros({2, 3}, DType::f32);
  t.fill_(2.0f);
  all_reduce_sum(t, g);
  EXPECT_EQ(t.data<float>()[5], 2.0f);
}

TEST(CommSingle, ArgumentErrors) {
  const ProcessGroup g = comm_single("solo");
  std::vector<float> in(3), out(4);
  EXPECT_HAS(error_of([&] { all_gather(out, in, g); }), "all_gather on group solo (size 1)");
  EXPECT_HAS(error_of([&] { all_gather(out, in, g); }),
             "output has 4 elements but must hold group size × input = 1 × 3");
  std::vector<int64_t> two = {1, 2};
  EXPECT_HAS(error_of([&] { all_to_all_v(out, two, in, two, g); }),
             "send_counts has 2 entries but the group has 1 ranks");
  EXPECT_HAS(error_of([&] { broadcast(in, 1, g); }), "root 1 is not a rank of the group");
  Tensor half = Tensor::zeros({2}, DType::f16);
  EXPECT_HAS(error_of([&] { all_reduce_sum(half, g); }), "dtype f16 cannot be reduced");
  EXPECT_HAS(error_of([&] { all_gather(std::span<float>(in), std::span<const float>(in), g); }), "overlap");
  EXPECT_HAS(error_of([&] { all_reduce_sum(in, ProcessGroup()); }), "default-constructed");
}

TEST(CommSingle, ProcessGroupsOnOneRank) {
  const ProcessGroups pg = make_process_groups(ParallelConfig{}, 8, comm_single("world"));
  for (int k = 0; k < kNumGroupKinds; ++k) {
    EXPECT_EQ(pg.groups[static_cast<size_t>(k)].size(), 1);
    EXPECT_EQ(pg.groups[static_cast<size_t>(k)].name(), group_kind_name(static_cast<GroupKind>(k)));
  }
  const std::string msg =
      error_of([] { make_process_groups(parallel_config(1, 1, 1, 2, 1), 8, comm_single("world")); });
  EXPECT_HAS(msg, "world_size (1)");
  if (!comm_available()) {
    EXPECT_HAS(msg, "built without MPI");
  }
}

}  // namespace
}  // namespace moecore
