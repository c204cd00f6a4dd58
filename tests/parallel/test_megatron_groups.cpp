// Megatron-Core's process groups as literals, written by tools/megatron_rank_groups.py from Megatron's own
// RankGenerator (parallel_state.py), for both rank orders (--use-tp-pp-dp-mapping selects "tp-cp-ep-pp-dp") and the
// partial distributed optimizer's instance groups; then those groups' invariants over every layout of worlds up to 24
// ranks, both orders and every instance count, and the errors naming the values.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "moecore/parallel/process_groups.h"
#include "parallel_config.h"
#include "test_util.h"

namespace moecore {
namespace {

using testing::parallel_config;

using Groups = std::vector<std::vector<int>>;
using testing::error_of;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

std::string text(const Groups& groups) {  // "0,1 2,3 ...": the script's notation
  std::string s;
  for (const auto& g : groups) {
    s += s.empty() ? "" : " ";
    for (size_t i = 0; i < g.size(); ++i) s += (i ? "," : "") + std::to_string(g[i]);
  }
  return s;
}

struct Case {
  int world, tp, cp, pp, ep, etp;  // etp 0: TP (Megatron's default)
  std::string order;
  int n;                                                  // --num-distributed-optimizer-instances
  std::vector<std::pair<std::string, std::string>> rows;  // kind name -> Megatron's groups
};

// python3 tools/megatron_rank_groups.py MEGATRON_ROOT WORLD TP CP PP EP ETP ORDER N, for each case.
const std::vector<Case>& megatron_cases() {
  static const std::vector<Case> cases = {
      {8,
       2,
       1,
       1,
       2,
       1,
       "tp-cp-ep-dp-pp",
       2,  // TP 2, CP 1, PP 1, EP 2, ETP 1
       {
           {"tp", "0,1 2,3 4,5 6,7"},
           {"cp", "0 1 2 3 4 5 6 7"},
           {"dp", "0,2,4,6 1,3,5,7"},
           {"pp", "0 1 2 3 4 5 6 7"},
           {"dp_cp", "0,2,4,6 1,3,5,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,1,2,3,4,5,6,7"},
           {"tp_dp_cp", "0,1,2,3,4,5,6,7"},
           {"mp", "0,1 2,3 4,5 6,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1 2,3 4,5 6,7"},
           {"edp", "0,2,4,6 1,3,5,7"},
           {"intra_dp_cp", "0,2 4,6 1,3 5,7"},
           {"intra_edp", "0,2 4,6 1,3 5,7"},
           {"inter_dist_opt", "0,4 2,6 1,5 3,7"},
       }},
      {8,
       2,
       1,
       2,
       1,
       0,
       "tp-cp-ep-dp-pp",
       1,  // TP 2, CP 1, PP 2, EP 1, ETP TP
       {
           {"tp", "0,1 2,3 4,5 6,7"},
           {"cp", "0 1 2 3 4 5 6 7"},
           {"dp", "0,2 1,3 4,6 5,7"},
           {"pp", "0,4 1,5 2,6 3,7"},
           {"dp_cp", "0,2 1,3 4,6 5,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,1,2,3 4,5,6,7"},
           {"tp_dp_cp", "0,1,2,3 4,5,6,7"},
           {"mp", "0,1,4,5 2,3,6,7"},
           {"etp", "0,1 2,3 4,5 6,7"},
           {"ep", "0 1 2 3 4 5 6 7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,4,5 2,3,6,7"},
           {"edp", "0,2 1,3 4,6 5,7"},
           {"intra_dp_cp", "0,2 1,3 4,6 5,7"},
           {"intra_edp", "0,2 1,3 4,6 5,7"},
           {"inter_dist_opt", "0 2 1 3 4 6 5 7"},
       }},
      {8,
       2,
       1,
       2,
       2,
       1,
       "tp-cp-ep-dp-pp",
       1,  // TP 2, CP 1, PP 2, EP 2, ETP 1
       {
           {"tp", "0,1 2,3 4,5 6,7"},
           {"cp", "0 1 2 3 4 5 6 7"},
           {"dp", "0,2 1,3 4,6 5,7"},
           {"pp", "0,4 1,5 2,6 3,7"},
           {"dp_cp", "0,2 1,3 4,6 5,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,1,2,3 4,5,6,7"},
           {"tp_dp_cp", "0,1,2,3 4,5,6,7"},
           {"mp", "0,1,4,5 2,3,6,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,4,5 2,3,6,7"},
           {"edp", "0,2 1,3 4,6 5,7"},
           {"intra_dp_cp", "0,2 1,3 4,6 5,7"},
           {"intra_edp", "0,2 1,3 4,6 5,7"},
           {"inter_dist_opt", "0 2 1 3 4 6 5 7"},
       }},
      {8,
       1,
       2,
       2,
       2,
       1,
       "tp-cp-ep-dp-pp",
       1,  // TP 1, CP 2, PP 2, EP 2, ETP 1
       {
           {"tp", "0 1 2 3 4 5 6 7"},
           {"cp", "0,1 2,3 4,5 6,7"},
           {"dp", "0,2 1,3 4,6 5,7"},
           {"pp", "0,4 1,5 2,6 3,7"},
           {"dp_cp", "0,1,2,3 4,5,6,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,2 1,3 4,6 5,7"},
           {"tp_dp_cp", "0,1,2,3 4,5,6,7"},
           {"mp", "0,4 1,5 2,6 3,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,4,5 2,3,6,7"},
           {"edp", "0,2 1,3 4,6 5,7"},
           {"intra_dp_cp", "0,1,2,3 4,5,6,7"},
           {"intra_edp", "0,2 1,3 4,6 5,7"},
           {"inter_dist_opt", "0 2 1 3 4 6 5 7"},
       }},
      {8,
       1,
       2,
       2,
       2,
       1,
       "tp-cp-ep-dp-pp",
       2,  // TP 1, CP 2, PP 2, EP 2, ETP 1
       {
           {"tp", "0 1 2 3 4 5 6 7"},
           {"cp", "0,1 2,3 4,5 6,7"},
           {"dp", "0,2 1,3 4,6 5,7"},
           {"pp", "0,4 1,5 2,6 3,7"},
           {"dp_cp", "0,1,2,3 4,5,6,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,2 1,3 4,6 5,7"},
           {"tp_dp_cp", "0,1,2,3 4,5,6,7"},
           {"mp", "0,4 1,5 2,6 3,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,4,5 2,3,6,7"},
           {"edp", "0,2 1,3 4,6 5,7"},
           {"intra_dp_cp", "0,1 2,3 4,5 6,7"},
           {"intra_edp", "0 2 1 3 4 6 5 7"},
           {"inter_dist_opt", "0,2 1,3 4,6 5,7"},
       }},
      {8,
       2,
       1,
       2,
       1,
       0,
       "tp-cp-ep-pp-dp",
       1,  // TP 2, CP 1, PP 2, EP 1, ETP TP
       {
           {"tp", "0,1 2,3 4,5 6,7"},
           {"cp", "0 1 2 3 4 5 6 7"},
           {"dp", "0,4 1,5 2,6 3,7"},
           {"pp", "0,2 1,3 4,6 5,7"},
           {"dp_cp", "0,4 1,5 2,6 3,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,1,4,5 2,3,6,7"},
           {"tp_dp_cp", "0,1,4,5 2,3,6,7"},
           {"mp", "0,1,2,3 4,5,6,7"},
           {"etp", "0,1 2,3 4,5 6,7"},
           {"ep", "0 1 2 3 4 5 6 7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,2,3 4,5,6,7"},
           {"edp", "0,4 1,5 2,6 3,7"},
           {"intra_dp_cp", "0,4 1,5 2,6 3,7"},
           {"intra_edp", "0,4 1,5 2,6 3,7"},
           {"inter_dist_opt", "0 4 1 5 2 6 3 7"},
       }},
      {8,
       2,
       1,
       2,
       2,
       1,
       "tp-cp-ep-pp-dp",
       1,  // TP 2, CP 1, PP 2, EP 2, ETP 1
       {
           {"tp", "0,1 2,3 4,5 6,7"},
           {"cp", "0 1 2 3 4 5 6 7"},
           {"dp", "0,4 1,5 2,6 3,7"},
           {"pp", "0,2 1,3 4,6 5,7"},
           {"dp_cp", "0,4 1,5 2,6 3,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,1,4,5 2,3,6,7"},
           {"tp_dp_cp", "0,1,4,5 2,3,6,7"},
           {"mp", "0,1,2,3 4,5,6,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,2,3 4,5,6,7"},
           {"edp", "0,4 1,5 2,6 3,7"},
           {"intra_dp_cp", "0,4 1,5 2,6 3,7"},
           {"intra_edp", "0,4 1,5 2,6 3,7"},
           {"inter_dist_opt", "0 4 1 5 2 6 3 7"},
       }},
      {8,
       1,
       2,
       2,
       2,
       1,
       "tp-cp-ep-pp-dp",
       1,  // TP 1, CP 2, PP 2, EP 2, ETP 1
       {
           {"tp", "0 1 2 3 4 5 6 7"},
           {"cp", "0,1 2,3 4,5 6,7"},
           {"dp", "0,4 1,5 2,6 3,7"},
           {"pp", "0,2 1,3 4,6 5,7"},
           {"dp_cp", "0,1,4,5 2,3,6,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,4 1,5 2,6 3,7"},
           {"tp_dp_cp", "0,1,4,5 2,3,6,7"},
           {"mp", "0,2 1,3 4,6 5,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,2,3 4,5,6,7"},
           {"edp", "0,4 1,5 2,6 3,7"},
           {"intra_dp_cp", "0,1,4,5 2,3,6,7"},
           {"intra_edp", "0,4 1,5 2,6 3,7"},
           {"inter_dist_opt", "0 4 1 5 2 6 3 7"},
       }},
      {8,
       1,
       2,
       2,
       2,
       1,
       "tp-cp-ep-pp-dp",
       2,  // TP 1, CP 2, PP 2, EP 2, ETP 1
       {
           {"tp", "0 1 2 3 4 5 6 7"},
           {"cp", "0,1 2,3 4,5 6,7"},
           {"dp", "0,4 1,5 2,6 3,7"},
           {"pp", "0,2 1,3 4,6 5,7"},
           {"dp_cp", "0,1,4,5 2,3,6,7"},
           {"tp_cp", "0,1 2,3 4,5 6,7"},
           {"tp_dp", "0,4 1,5 2,6 3,7"},
           {"tp_dp_cp", "0,1,4,5 2,3,6,7"},
           {"mp", "0,2 1,3 4,6 5,7"},
           {"etp", "0 1 2 3 4 5 6 7"},
           {"ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep", "0,1 2,3 4,5 6,7"},
           {"etp_ep_pp", "0,1,2,3 4,5,6,7"},
           {"edp", "0,4 1,5 2,6 3,7"},
           {"intra_dp_cp", "0,1 4,5 2,3 6,7"},
           {"intra_edp", "0 4 1 5 2 6 3 7"},
           {"inter_dist_opt", "0,4 1,5 2,6 3,7"},
       }},
  };
  return cases;
}

// Every group kind of every case equals Megatron's, member order and group order included.
TEST(MegatronGroups, EveryKindEqualsMegatronsInBothOrders) {
  for (const Case& c : megatron_cases()) {
    const std::string what = "world " + std::to_string(c.world) + " TP " + std::to_string(c.tp) + " CP " +
                             std::to_string(c.cp) + " PP " + std::to_string(c.pp) + " EP " + std::to_string(c.ep) +
                             " ETP " + std::to_string(c.etp) + " " + c.order + " N " + std::to_string(c.n);
    const RankLayout l =
        rank_layout(parallel_config(c.tp, c.cp, c.pp, c.ep, c.etp, c.order, c.n), c.world, c.ep > 1 ? 4 : 0);
    ASSERT_EQ(c.rows.size(), static_cast<size_t>(kNumGroupKinds)) << what;
    for (int k = 0; k < kNumGroupKinds; ++k) {
      const auto kind = static_cast<GroupKind>(k);
      const auto row =
          std::find_if(c.rows.begin(), c.rows.end(), [&](const auto& r) { return r.first == group_kind_name(kind); });
      ASSERT_NE(row, c.rows.end()) << what << ": no row for " << group_kind_name(kind);
      EXPECT_EQ(text(l.groups[static_cast<size_t>(k)]), row->second) << what << ": " << group_kind_name(kind);
    }
  }
}

// Every layout of every world up to 24 ranks in both of Megatron's orders (tp-pp-dp with PP > 1 only where DP = EDP,
// which Megatron asserts), with every instance count N dividing DP x CP and EDP: the instance groups partition each
// dp-cp / edp group into N consecutive slices, the inter-instance group joins the same place of every slice of both
// (so one group serves dense and expert shards, as in Megatron), and with N = 1 they are dp_cp, edp and singletons.
// In the tp-pp-dp order a rank is tp + TP (cp + CP (pp + PP dp)).
TEST(MegatronGroups, InstanceGroupsOverAllSmallWorldsInBothOrders) {
  int layouts = 0;
  for (const std::string order : {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"})
    for (int world = 1; world <= 24; ++world)
      for (int tp = 1; tp <= world; ++tp)
        for (int cp = 1; tp * cp <= world; ++cp)
          for (int pp = 1; tp * cp * pp <= world; ++pp)
            for (int ep = 1; ep * pp <= world; ++ep)
              for (int etp = 1; etp * ep * pp <= world; ++etp) {
                if (world % (tp * cp * pp) || world % (etp * ep * pp)) continue;
                const int dp = world / (tp * cp * pp), edp = world / (etp * ep * pp);
                if (order == "tp-cp-ep-pp-dp" && pp > 1 && dp != edp) continue;
                for (int n = 1; n <= std::gcd(dp * cp, edp); ++n) {
                  if ((dp * cp) % n || edp % n) continue;
                  const RankLayout l = rank_layout(parallel_config(tp, cp, pp, ep, etp, order, n), world, ep * 2);
                  ++layouts;
                  const Groups& intra = l.groups[static_cast<size_t>(GroupKind::intra_dp_cp)];
                  const Groups& intra_e = l.groups[static_cast<size_t>(GroupKind::intra_edp)];
                  const Groups& inter = l.groups[static_cast<size_t>(GroupKind::inter_dist_opt)];
                  if (n == 1) {
                    ASSERT_EQ(intra, l.groups[static_cast<size_t>(GroupKind::dp_cp)]);
                    ASSERT_EQ(intra_e, l.groups[static_cast<size_t>(GroupKind::edp)]);
                    ASSERT_EQ(inter.size(), static_cast<size_t>(world));
                  }
                  for (int r = 0; r < world; ++r) {
                    const auto& dense = l.group(GroupKind::dp_cp, r);
                    const auto& expert = l.group(GroupKind::edp, r);
                    const int d = l.index_in_group(GroupKind::dp_cp, r), e = l.index_in_group(GroupKind::edp, r);
                    const int ds = dp * cp / n, es = edp / n;
                    const std::vector<int> want_intra(dense.begin() + d / ds * ds, dense.begin() + (d / ds + 1) * ds);
                    ASSERT_EQ(l.group(GroupKind::intra_dp_cp, r), want_intra) << order << " world " << world;
                    const std::vector<int> want_e(expert.begin() + e / es * es, expert.begin() + (e / es + 1) * es);
                    ASSERT_EQ(l.group(GroupKind::intra_edp, r), want_e) << order << " world " << world;
                    std::vector<int> across_dense, across_expert;
                    for (int i = 0; i < n; ++i) {
                      across_dense.push_back(dense[static_cast<size_t>(i * ds + d % ds)]);
                      across_expert.push_back(expert[static_cast<size_t>(i * es + e % es)]);
                    }
                    ASSERT_EQ(l.group(GroupKind::inter_dist_opt, r), across_expert) << order << " world " << world;
                    ASSERT_EQ(across_dense, across_expert) << order << " world " << world << " N " << n;
                    if (order == "tp-cp-ep-pp-dp") {
                      const RankCoords c = l.coords(r);
                      ASSERT_EQ(r, c.tp + tp * (c.cp + cp * (c.pp + pp * c.dp)));
                      ASSERT_EQ(r, c.etp + etp * (c.ep + ep * (c.pp + pp * c.edp)));
                    }
                  }
                }
              }
  EXPECT_GT(layouts, 1000);
}

// Megatron's assertions, quoted, with the values; and an order outside Megatron's two that splits an instance
// differently for attention and experts.
TEST(MegatronGroups, BadInstanceCountsFailNamingTheValues) {
  const std::string dense = error_of([] { parallel_config(2, 1, 1, 2, 1, "tp-cp-ep-dp-pp", 3).validate(8, 4); });
  EXPECT_HAS(dense, "Data parallel size should be divisible by partial DistOpt shard factor");
  EXPECT_HAS(dense, "(4 x 1 = 4) must be divisible by num_distributed_optimizer_instances (3)");
  // DP 8 allows N = 4, EDP 2 (ETP 1 x EP 4) does not.
  const std::string expert = error_of([] { parallel_config(1, 1, 1, 4, 1, "tp-cp-ep-dp-pp", 4).validate(8, 4); });
  EXPECT_HAS(expert, "Expert data parallel size should be divisible by partial DistOpt shard factor");
  EXPECT_HAS(expert, "expert data-parallel size (2) must be divisible by num_distributed_optimizer_instances (4)");
  EXPECT_HAS(error_of([] { parallel_config(1, 1, 1, 1, 1, "tp-cp-ep-dp-pp", 0).validate(8, 0); }),
             "num_distributed_optimizer_instances (0) must be >= 1");
  // dp before ep: the experts' instances are not the attention layers' (Megatron would reduce the wrong shards).
  const std::string order = error_of([] { rank_layout(parallel_config(1, 1, 1, 2, 1, "tp-cp-dp-ep-pp", 2), 8, 4); });
  EXPECT_HAS(order, "order \"tp-cp-dp-ep-pp\" with num_distributed_optimizer_instances (2)");
  EXPECT_HAS(order, "its inter-instance group [0,2] is not [0,4]");
  EXPECT_HAS(order, "use Megatron's order");
}

}  // namespace
}  // namespace moecore
