// The MoE ECHO ops (ops.h "MoE ECHO"): planner properties on skewed and random counts (budgets split exactly over the
// sources, no slot fed from its own rank, loads conserved, the max load never rises, recipients stay at or below the
// average), the rerouting's invariants (top-k kept, exact fold of map and probabilities, per-slot counts as planned),
// a brute-force optimum on small cases, the debug mode's random clones, and bad input.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/core/rng.h"
#include "moecore/kernels/ops.h"
#include "test_util.h"

namespace moecore {
namespace {

const ops::Context kCpu;

Tensor i64_tensor(const Shape& s, const std::vector<int64_t>& v) {
  Tensor t = Tensor::zeros(s, DType::i64, MemCategory::other);
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}
std::vector<int64_t> values(const Tensor& t) {
  return {t.data<int64_t>(), t.data<int64_t>() + t.numel()};
}

struct Plan {
  std::vector<int64_t> slot_expert, slot_tokens, before, after;
};
Plan plan(const std::vector<int64_t>& counts, int64_t P, int64_t E, int64_t Sl, uint64_t seed = 0) {
  const int64_t S = P * Sl;
  Tensor se = Tensor::zeros({S}, DType::i64, MemCategory::other);
  Tensor st = Tensor::zeros({P, S}, DType::i64, MemCategory::other);
  Tensor ld = Tensor::zeros({2, P}, DType::i64, MemCategory::other);
  ops::moe_echo_plan(se, st, ld, i64_tensor({P, E}, counts), Sl, seed, kCpu);
  const std::vector<int64_t> l = values(ld);
  return {values(se), values(st), {l.begin(), l.begin() + P}, {l.begin() + P, l.end()}};
}

// Counts with a Zipf-like skew over experts (exponent a, hot experts placed by `perm`), noise per source rank.
std::vector<int64_t> skewed_counts(int64_t P, int64_t E, double a, int64_t per_rank, uint64_t seed) {
  const PhiloxKey key = philox_key(seed, "echo_counts");
  std::vector<double> w(static_cast<size_t>(E));
  std::vector<int64_t> perm(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
  for (int64_t e = E - 1; e > 0; --e)
    std::swap(perm[static_cast<size_t>(e)],
              perm[static_cast<size_t>(static_cast<int64_t>(philox_uniform(key, 1000 + e) * (e + 1)) % (e + 1))]);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e)
    sum += w[static_cast<size_t>(perm[static_cast<size_t>(e)])] = 1.0 / std::pow(e + 1, a);
  std::vector<int64_t> c(static_cast<size_t>(P * E));
  for (int64_t s = 0; s < P; ++s)
    for (int64_t e = 0; e < E; ++e)
      c[static_cast<size_t>(s * E + e)] = static_cast<int64_t>(
          per_rank * w[static_cast<size_t>(e)] / sum * (0.5 + philox_uniform(key, static_cast<uint64_t>(s * E + e))));
  return c;
}

// The properties every plan has. Returns the max load after planning.
void check_plan(const Plan& p, const std::vector<int64_t>& C, int64_t P, int64_t E, int64_t Sl, bool planner) {
  const int64_t S = P * Sl, El = E / P;
  int64_t total = 0, avg = 0;
  for (int64_t v : C) total += v;
  avg = total / P;
  std::vector<int64_t> used(static_cast<size_t>(P * E), 0);
  std::vector<int64_t> after = p.before;
  for (int64_t j = 0; j < S; ++j) {
    const int64_t e = p.slot_expert[static_cast<size_t>(j)];
    int64_t budget = 0;
    for (int64_t s = 0; s < P; ++s) {
      const int64_t n = p.slot_tokens[static_cast<size_t>(s * S + j)];
      ASSERT_GE(n, 0);
      if (e < 0) {
        ASSERT_EQ(n, 0) << "empty slot " << j;
        continue;
      }
      used[static_cast<size_t>(s * E + e)] += n;
      budget += n;
    }
    if (e < 0) continue;
    ASSERT_GT(budget, 0) << "slot " << j << " clones expert " << e << " for no pairs";
    ASSERT_NE(e / El, j / Sl) << "slot " << j << " is fed from its own rank";
    after[static_cast<size_t>(e / El)] -= budget;
    after[static_cast<size_t>(j / Sl)] += budget;
  }
  for (int64_t i = 0; i < P * E; ++i) ASSERT_LE(used[static_cast<size_t>(i)], C[static_cast<size_t>(i)]) << i;
  ASSERT_EQ(after, p.after);
  int64_t sum_after = 0;
  for (int64_t v : p.after) sum_after += v;
  ASSERT_EQ(sum_after, total);
  if (!planner) return;
  ASSERT_LE(*std::max_element(p.after.begin(), p.after.end()), *std::max_element(p.before.begin(), p.before.end()));
  for (int64_t r = 0; r < P; ++r) {
    if (p.after[static_cast<size_t>(r)] > p.before[static_cast<size_t>(r)]) {
      ASSERT_LE(p.after[static_cast<size_t>(r)], avg) << "rank " << r;
    }
  }
}

TEST(EchoPlan, PropertiesOnSkewedCounts) {
  for (int64_t P : {2, 4, 8})
    for (int64_t El : {1, 2, 4})
      for (int64_t Sl : {1, 2, 3})
        for (double a : {0.0, 1.0, 2.0})
          for (uint64_t seed = 1; seed <= 4; ++seed) {
            const int64_t E = P * El;
            const std::vector<int64_t> C = skewed_counts(P, E, a, 1000, seed * 7 + static_cast<uint64_t>(P));
            const Plan p = plan(C, P, E, Sl);
            SCOPED_TRACE(::testing::Message()
                         << "P " << P << " El " << El << " Sl " << Sl << " a " << a << " seed " << seed);
            check_plan(p, C, P, E, Sl, true);
            const Plan again = plan(C, P, E, Sl);
            ASSERT_EQ(again.slot_expert, p.slot_expert);
            ASSERT_EQ(again.slot_tokens, p.slot_tokens);
          }
}

// Hot experts with enough slots for them: the max load falls to within avg (1 + 1/Sl), the bound.
TEST(EchoPlan, MaxLoadNearTheAverageWithEnoughSlots) {
  for (int64_t P : {2, 4, 8})
    for (int64_t Sl : {1, 2, 4})
      for (uint64_t seed = 1; seed <= 6; ++seed) {
        const int64_t El = 4, E = P * El;
        const std::vector<int64_t> C = skewed_counts(P, E, 1.0, 4096, seed);
        const Plan p = plan(C, P, E, Sl);
        int64_t total = 0;
        for (int64_t v : C) total += v;
        const double avg = static_cast<double>(total) / static_cast<double>(P);
        const int64_t before = *std::max_element(p.before.begin(), p.before.end());
        const int64_t after = *std::max_element(p.after.begin(), p.after.end());
        EXPECT_LE(after, avg * (1.0 + 1.0 / static_cast<double>(Sl)))
            << "P " << P << " Sl " << Sl << " seed " << seed << ": max load " << before << " -> " << after << ", avg "
            << avg;
      }
}

TEST(EchoPlan, BalancedOrEmptyCountsCloneNothing) {
  const int64_t P = 4, E = 8;
  for (const std::vector<int64_t>& C :
       {std::vector<int64_t>(static_cast<size_t>(P * E), 5), std::vector<int64_t>(static_cast<size_t>(P * E), 0)}) {
    const Plan p = plan(C, P, E, 2);
    for (int64_t e : p.slot_expert) EXPECT_EQ(e, -1);
    EXPECT_EQ(p.before, p.after);
  }
}

// Every token routed to one expert: its clones take the load down to the average on every rank.
TEST(EchoPlan, OneHotExpertSpreadsOverEveryRank) {
  const int64_t P = 4, E = 8, Sl = 1;
  std::vector<int64_t> C(static_cast<size_t>(P * E), 0);
  for (int64_t s = 0; s < P; ++s) C[static_cast<size_t>(s * E + 5)] = 100;  // expert 5 lives on rank 2
  const Plan p = plan(C, P, E, Sl);
  check_plan(p, C, P, E, Sl, true);
  EXPECT_EQ(p.before, (std::vector<int64_t>{0, 0, 400, 0}));
  EXPECT_EQ(p.after, (std::vector<int64_t>{100, 100, 100, 100}));
  EXPECT_EQ(p.slot_expert, (std::vector<int64_t>{5, 5, -1, 5}));
}

// The brute-force optimum of small cases: every choice of clone per slot, each with the best split of the pairs (a
// max-flow feasibility test per load bound). The planner's max load stays within avg/Sl of it on these cases.
int64_t max_flow(std::vector<std::vector<int64_t>> cap, int src, int sink) {
  const int n = static_cast<int>(cap.size());
  int64_t flow = 0;
  for (;;) {
    std::vector<int> prev(static_cast<size_t>(n), -1);
    std::vector<int> q{src};
    prev[static_cast<size_t>(src)] = src;
    for (size_t i = 0; i < q.size() && prev[static_cast<size_t>(sink)] < 0; ++i)
      for (int v = 0; v < n; ++v)
        if (prev[static_cast<size_t>(v)] < 0 && cap[static_cast<size_t>(q[i])][static_cast<size_t>(v)] > 0) {
          prev[static_cast<size_t>(v)] = q[i];
          q.push_back(v);
        }
    if (prev[static_cast<size_t>(sink)] < 0) return flow;
    int64_t f = std::numeric_limits<int64_t>::max();
    for (int v = sink; v != src; v = prev[static_cast<size_t>(v)])
      f = std::min(f, cap[static_cast<size_t>(prev[static_cast<size_t>(v)])][static_cast<size_t>(v)]);
    for (int v = sink; v != src; v = prev[static_cast<size_t>(v)]) {
      cap[static_cast<size_t>(prev[static_cast<size_t>(v)])][static_cast<size_t>(v)] -= f;
      cap[static_cast<size_t>(v)][static_cast<size_t>(prev[static_cast<size_t>(v)])] += f;
    }
    flow += f;
  }
}
// The smallest max load any plan with clone map `slot_expert` reaches.
int64_t best_max_load(const std::vector<int64_t>& load, const std::vector<int64_t>& slot_expert, int64_t P, int64_t El,
                      int64_t Sl) {
  const int64_t E = P * El;
  int64_t total = 0;
  for (int64_t v : load) total += v;
  auto feasible = [&](int64_t bound) {
    const int n = static_cast<int>(E + P + 2), src = n - 2, sink = n - 1;
    std::vector<std::vector<int64_t>> cap(static_cast<size_t>(n), std::vector<int64_t>(static_cast<size_t>(n), 0));
    for (int64_t e = 0; e < E; ++e) {
      cap[static_cast<size_t>(src)][static_cast<size_t>(e)] = load[static_cast<size_t>(e)];
      cap[static_cast<size_t>(e)][static_cast<size_t>(E + e / El)] = total;
    }
    for (int64_t j = 0; j < P * Sl; ++j)
      if (slot_expert[static_cast<size_t>(j)] >= 0)
        cap[static_cast<size_t>(slot_expert[static_cast<size_t>(j)])][static_cast<size_t>(E + j / Sl)] = total;
    for (int64_t r = 0; r < P; ++r) cap[static_cast<size_t>(E + r)][static_cast<size_t>(sink)] = bound;
    return max_flow(cap, src, sink) == total;
  };
  int64_t lo = 0, hi = total;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (feasible(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

TEST(EchoPlan, CloseToTheBruteForceOptimumOnSmallCases) {
  for (int64_t P : {2, 3})
    for (int64_t Sl : {1, 2})
      for (uint64_t seed = 1; seed <= 8; ++seed) {
        if (P * Sl > 4) continue;  // (E + 1)^(P Sl) clone maps
        const int64_t El = 2, E = P * El, S = P * Sl;
        const std::vector<int64_t> C = skewed_counts(P, E, 1.5, 200, seed + 100);
        std::vector<int64_t> load(static_cast<size_t>(E), 0);
        int64_t total = 0;
        for (int64_t s = 0; s < P; ++s)
          for (int64_t e = 0; e < E; ++e) load[static_cast<size_t>(e)] += C[static_cast<size_t>(s * E + e)];
        for (int64_t v : load) total += v;
        const int64_t avg = total / P;
        int64_t best = std::numeric_limits<int64_t>::max();
        std::vector<int64_t> choice(static_cast<size_t>(S), -1);
        std::function<void(int64_t)> search = [&](int64_t j) {
          if (j == S) {
            best = std::min(best, best_max_load(load, choice, P, El, Sl));
            return;
          }
          for (int64_t e = -1; e < E; ++e) {
            choice[static_cast<size_t>(j)] = e;
            search(j + 1);
          }
        };
        search(0);
        const Plan p = plan(C, P, E, Sl);
        const int64_t got = *std::max_element(p.after.begin(), p.after.end());
        const int64_t before = *std::max_element(p.before.begin(), p.before.end());
        EXPECT_GE(got, best);
        EXPECT_LE(got, best + (avg + Sl - 1) / Sl)
            << "P " << P << " Sl " << Sl << " seed " << seed << ": planner " << got << ", optimum " << best
            << ", before " << before << ", avg " << avg;
      }
}

TEST(EchoPlan, DebugModeClonesAtRandom) {
  const int64_t P = 4, E = 8, Sl = 2;
  const std::vector<int64_t> C = skewed_counts(P, E, 0.5, 1000, 3);
  const Plan a = plan(C, P, E, Sl, 42), b = plan(C, P, E, Sl, 42), c = plan(C, P, E, Sl, 43);
  check_plan(a, C, P, E, Sl, false);
  EXPECT_EQ(a.slot_expert, b.slot_expert);
  EXPECT_EQ(a.slot_tokens, b.slot_tokens);
  EXPECT_NE(a.slot_expert, c.slot_expert);
  int64_t clones = 0;
  for (int64_t e : a.slot_expert) clones += e >= 0;
  EXPECT_EQ(clones, P * Sl);  // every expert has pairs here, so every slot clones one
}

// The rerouting on every source rank of a plan: each token keeps its top-k, folding gives back map and probs
// bit-exactly, and each slot column holds the pairs the plan gave it.
TEST(EchoReroute, KeepsTopKAndFoldsBackExactly) {
  const int64_t P = 4, El = 2, E = P * El, T = 64, K = 3;
  for (int64_t Sl : {1, 2})
    for (uint64_t seed : {0u, 9u}) {
      // Per-rank maps with a hot expert, their counts gathered.
      std::vector<Tensor> maps, probs;
      std::vector<int64_t> C(static_cast<size_t>(P * E), 0);
      const PhiloxKey key = philox_key(seed + 1, "echo_maps");
      for (int64_t s = 0; s < P; ++s) {
        Tensor m = Tensor::zeros({T, E}, DType::boolean, MemCategory::other);
        Tensor pr = Tensor::zeros({T, E}, DType::f32, MemCategory::other);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t k = 0, n = 0; n < K; ++k) {
            const float u = philox_uniform(key, static_cast<uint64_t>((s * T + t) * 64 + k));
            const int64_t e = u < 0.4f ? 3 : static_cast<int64_t>(u * 997) % E;
            if (m.data<bool>()[t * E + e]) continue;
            m.data<bool>()[t * E + e] = true;
            pr.data<float>()[t * E + e] = 0.1f + u;
            ++C[static_cast<size_t>(s * E + e)];
            ++n;
          }
        maps.push_back(m);
        probs.push_back(pr);
      }
      const Plan p = plan(C, P, E, Sl, seed);
      check_plan(p, C, P, E, Sl, seed == 0);
      const int64_t S = P * Sl, W = P * (El + Sl);
      const Tensor se = i64_tensor({S}, p.slot_expert), st = i64_tensor({P, S}, p.slot_tokens);
      for (int64_t s = 0; s < P; ++s) {
        Tensor m2 = Tensor::zeros({T, W}, DType::boolean, MemCategory::other);
        Tensor p2 = Tensor::zeros({T, W}, DType::f32, MemCategory::other);
        ops::moe_echo_reroute(m2, p2, maps[static_cast<size_t>(s)], probs[static_cast<size_t>(s)], se, st, s, Sl, kCpu);
        for (int64_t t = 0; t < T; ++t) {
          int64_t n = 0;
          for (int64_t c = 0; c < W; ++c) n += m2.data<bool>()[t * W + c];
          ASSERT_EQ(n, K) << "token " << t;
        }
        for (int64_t j = 0; j < S; ++j) {
          int64_t n = 0;
          const int64_t col = j / Sl * (El + Sl) + El + j % Sl;
          for (int64_t t = 0; t < T; ++t) n += m2.data<bool>()[t * W + col];
          ASSERT_EQ(n, p.slot_tokens[static_cast<size_t>(s * S + j)]) << "slot " << j;
        }
        Tensor mf = Tensor::zeros({T, E}, DType::boolean, MemCategory::other);
        Tensor pf = Tensor::zeros({T, E}, DType::f32, MemCategory::other);
        ops::moe_echo_fold(mf, m2, se, Sl, kCpu);
        ops::moe_echo_fold(pf, p2, se, Sl, kCpu);
        ASSERT_EQ(std::memcmp(mf.raw(), maps[static_cast<size_t>(s)].raw(), static_cast<size_t>(mf.nbytes())), 0);
        ASSERT_EQ(std::memcmp(pf.raw(), probs[static_cast<size_t>(s)].raw(), static_cast<size_t>(pf.nbytes())), 0);
      }
    }
}

TEST(EchoReroute, BadInputRaises) {
  const int64_t P = 2, E = 4, T = 4;
  Tensor map = Tensor::zeros({T, E}, DType::boolean, MemCategory::other);
  Tensor probs = Tensor::zeros({T, E}, DType::f32, MemCategory::other);
  map.data<bool>()[0 * E + 3] = true;
  Tensor m2 = Tensor::zeros({T, P * 3}, DType::boolean, MemCategory::other);
  Tensor p2 = Tensor::zeros({T, P * 3}, DType::f32, MemCategory::other);
  // Slot 0 asks rank 0 for two tokens of expert 3, which it routes once.
  const Tensor se = i64_tensor({2}, {3, -1}), st = i64_tensor({2, 2}, {2, 0, 0, 0});
  EXPECT_THROW(ops::moe_echo_reroute(m2, p2, map, probs, se, st, 0, 1, kCpu), Error);
  EXPECT_THROW(ops::moe_echo_reroute(m2, p2, map, probs, se, i64_tensor({2, 2}, {1, 0, 0, 0}), 2, 1, kCpu), Error);
  Tensor se_bad = i64_tensor({2}, {4, -1});
  EXPECT_THROW(ops::moe_echo_reroute(m2, p2, map, probs, se_bad, i64_tensor({2, 2}, {0, 0, 0, 0}), 0, 1, kCpu), Error);
  Tensor counts = i64_tensor({P, 3}, {1, 2, 3, 4, 5, 6});  // 3 experts over 2 ranks
  Tensor a = Tensor::zeros({2}, DType::i64, MemCategory::other),
         b = Tensor::zeros({2, 2}, DType::i64, MemCategory::other),
         c = Tensor::zeros({2, 2}, DType::i64, MemCategory::other);
  EXPECT_THROW(ops::moe_echo_plan(a, b, c, counts, 1, 0, kCpu), Error);
}

}  // namespace
}  // namespace moecore
