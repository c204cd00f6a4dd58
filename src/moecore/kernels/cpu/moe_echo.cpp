// CPU kernels of MoE ECHO (ops.h, "MoE ECHO"): the clone planner, the local rerouting of tokens to clone columns and
// its fold. The planner loops over the [P, E] counts on one thread, as the reference's single-threaded planner kernel
// does; its integer arithmetic makes it the same on every rank. No CUDA kernels yet: a cuda context raises.
#include <algorithm>
#include <deque>
#include <numeric>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

struct Layout {
  int64_t P = 1, E = 0, El = 0, Sl = 0;
  int64_t S() const { return P * Sl; }
  int64_t columns() const { return P * (El + Sl); }
  int64_t home_column(int64_t e) const { return e / El * (El + Sl) + e % El; }
  int64_t slot_column(int64_t j) const { return j / Sl * (El + Sl) + El + j % Sl; }
};

// Step 1: loads, avg, spare capacity per rank, spill-over per expert.
struct Loads {
  std::vector<int64_t> expert, rank, spare, spill;
  int64_t avg = 0;
};
Loads loads_of(const int64_t* C, const Layout& L) {
  Loads o;
  o.expert.assign(static_cast<size_t>(L.E), 0);
  o.rank.assign(static_cast<size_t>(L.P), 0);
  for (int64_t s = 0; s < L.P; ++s)
    for (int64_t e = 0; e < L.E; ++e) o.expert[static_cast<size_t>(e)] += C[s * L.E + e];
  int64_t total = 0;
  for (int64_t e = 0; e < L.E; ++e) o.rank[static_cast<size_t>(e / L.El)] += o.expert[static_cast<size_t>(e)];
  for (int64_t r : o.rank) total += r;
  o.avg = total / L.P;
  o.spare.resize(static_cast<size_t>(L.P));
  o.spill.assign(static_cast<size_t>(L.E), 0);
  std::vector<int64_t> order(static_cast<size_t>(L.El));
  for (int64_t r = 0; r < L.P; ++r) {
    o.spare[static_cast<size_t>(r)] = std::max<int64_t>(0, o.avg - o.rank[static_cast<size_t>(r)]);
    std::iota(order.begin(), order.end(), r * L.El);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return o.expert[static_cast<size_t>(a)] < o.expert[static_cast<size_t>(b)];
    });
    int64_t below = 0;
    for (int64_t e : order) {
      const int64_t above = below + o.expert[static_cast<size_t>(e)];
      o.spill[static_cast<size_t>(e)] = std::max<int64_t>(0, above - std::max(below, o.avg));
      below = above;
    }
  }
  return o;
}

// Experts with spill, by spill descending (ties: lower index); ranks with spare, by spare descending (ties: lower
// rank).
std::vector<int64_t> by_descending(const std::vector<int64_t>& v) {
  std::vector<int64_t> idx;
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] > 0) idx.push_back(static_cast<int64_t>(i));
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int64_t a, int64_t b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  return idx;
}

// Step 2, one slot per rank: the approximate bin packing. budget[j] gets the pairs slot j runs.
void bin_pack(std::vector<int64_t>& slot_expert, std::vector<int64_t>& budget, const Loads& ld, const Layout& L) {
  constexpr int64_t kBuckets = 8;
  auto bucket_of = [&](int64_t spill) {
    return spill >= ld.avg ? int64_t{0} : std::min(kBuckets - 1, 1 + (ld.avg - spill) * (kBuckets - 1) / ld.avg);
  };
  std::vector<std::deque<int64_t>> buckets(static_cast<size_t>(kBuckets));
  std::vector<int64_t> left = ld.spill;
  for (int64_t e : by_descending(ld.spill))
    buckets[static_cast<size_t>(bucket_of(left[static_cast<size_t>(e)]))].push_back(e);
  for (int64_t r : by_descending(ld.spare)) {
    auto b = std::find_if(buckets.begin(), buckets.end(), [](const auto& q) { return !q.empty(); });
    if (b == buckets.end()) break;
    const int64_t e = b->front();
    b->pop_front();
    const int64_t moved = std::min(left[static_cast<size_t>(e)], ld.spare[static_cast<size_t>(r)]);
    slot_expert[static_cast<size_t>(r * L.Sl)] = e;
    budget[static_cast<size_t>(r * L.Sl)] = moved;
    left[static_cast<size_t>(e)] -= moved;
    if (left[static_cast<size_t>(e)] > 0)
      buckets[static_cast<size_t>(bucket_of(left[static_cast<size_t>(e)]))].push_back(e);
  }
}

// Step 2, several slots per rank: water-filling, then each rank's Sl largest transfers.
void water_fill(std::vector<int64_t>& slot_expert, std::vector<int64_t>& budget, const Loads& ld, const Layout& L) {
  struct Transfer {
    int64_t expert, amount;
  };
  std::vector<std::vector<Transfer>> incoming(static_cast<size_t>(L.P));
  const std::vector<int64_t> experts = by_descending(ld.spill), ranks = by_descending(ld.spare);
  size_t i = 0, k = 0;
  int64_t spill_left = experts.empty() ? 0 : ld.spill[static_cast<size_t>(experts[0])];
  int64_t spare_left = ranks.empty() ? 0 : ld.spare[static_cast<size_t>(ranks[0])];
  while (i < experts.size() && k < ranks.size()) {
    const int64_t n = std::min(spill_left, spare_left);
    incoming[static_cast<size_t>(ranks[k])].push_back({experts[i], n});
    spill_left -= n;
    spare_left -= n;
    if (spill_left == 0 && ++i < experts.size()) spill_left = ld.spill[static_cast<size_t>(experts[i])];
    if (spare_left == 0 && ++k < ranks.size()) spare_left = ld.spare[static_cast<size_t>(ranks[k])];
  }
  for (int64_t r = 0; r < L.P; ++r) {
    auto& in = incoming[static_cast<size_t>(r)];
    std::stable_sort(in.begin(), in.end(), [](const Transfer& a, const Transfer& b) {
      return a.amount > b.amount || (a.amount == b.amount && a.expert < b.expert);
    });
    for (int64_t q = 0; q < std::min<int64_t>(L.Sl, static_cast<int64_t>(in.size())); ++q) {
      slot_expert[static_cast<size_t>(r * L.Sl + q)] = in[static_cast<size_t>(q)].expert;
      budget[static_cast<size_t>(r * L.Sl + q)] = in[static_cast<size_t>(q)].amount;
    }
  }
}

// Debug mode: random clones of other ranks' experts, each taking 20-40 % of the pairs its expert has left.
void random_clones(std::vector<int64_t>& slot_expert, std::vector<int64_t>& budget, const Loads& ld, const Layout& L,
                   uint64_t seed) {
  const PhiloxKey key = philox_key(seed, "moe_echo_random_plan");
  std::vector<int64_t> left = ld.expert;
  for (int64_t j = 0; j < L.S(); ++j) {
    const int64_t d = j / L.Sl, others = L.E - L.El;
    if (others == 0) continue;
    int64_t pick = std::min<int64_t>(others - 1, static_cast<int64_t>(philox_uniform(key, 2 * j) * others));
    const int64_t e = pick < d * L.El ? pick : pick + L.El;  // skip rank d's own experts
    const float frac = 0.2f + 0.2f * philox_uniform(key, 2 * j + 1);
    const int64_t moved = static_cast<int64_t>(frac * static_cast<float>(left[static_cast<size_t>(e)]));
    if (moved <= 0) continue;
    slot_expert[static_cast<size_t>(j)] = e;
    budget[static_cast<size_t>(j)] = moved;
    left[static_cast<size_t>(e)] -= moved;
  }
}

// Step 3: each slot's budget over the source ranks, proportional floors first, then the residues depth-first.
void split_over_sources(int64_t* T, const int64_t* C, const std::vector<int64_t>& slot_expert,
                        const std::vector<int64_t>& budget, const Loads& ld, const Layout& L) {
  const int64_t S = L.S();
  std::fill(T, T + L.P * S, int64_t{0});
  std::vector<int64_t> taken(static_cast<size_t>(L.P));
  for (int64_t e = 0; e < L.E; ++e) {
    const int64_t load = ld.expert[static_cast<size_t>(e)];
    std::fill(taken.begin(), taken.end(), int64_t{0});
    for (int64_t j = 0; j < S; ++j) {
      if (slot_expert[static_cast<size_t>(j)] != e) continue;
      for (int64_t s = 0; s < L.P; ++s) {
        const auto share = static_cast<__int128>(budget[static_cast<size_t>(j)]) * C[s * L.E + e] / load;
        T[s * S + j] = static_cast<int64_t>(share);
        taken[static_cast<size_t>(s)] += T[s * S + j];
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      if (slot_expert[static_cast<size_t>(j)] != e) continue;
      int64_t residue = budget[static_cast<size_t>(j)];
      for (int64_t s = 0; s < L.P; ++s) residue -= T[s * S + j];
      for (int64_t s = 0; s < L.P && residue > 0; ++s) {
        const int64_t n = std::min(residue, C[s * L.E + e] - taken[static_cast<size_t>(s)]);
        T[s * S + j] += n;
        taken[static_cast<size_t>(s)] += n;
        residue -= n;
      }
      MOECORE_CHECK(residue == 0, "moe_echo_plan: slot ", j, " of expert ", e, " is ", residue,
                    " pairs short of its budget");
    }
  }
}

Layout layout_of(const cpu::Checker& ck, int64_t P, int64_t E, int64_t slots_per_rank) {
  if (P < 1 || E < 1 || E % P != 0 || slots_per_rank < 1)
    ck.fail("need P >= 1 ranks, E >= 1 experts divisible by P and slots_per_rank >= 1; got P ", P, ", E ", E,
            ", slots_per_rank ", slots_per_rank);
  return {P, E, E / P, slots_per_rank};
}

}  // namespace

void moe_echo_plan(Tensor& slot_expert, Tensor& slot_tokens, Tensor& loads, const Tensor& counts,
                   int64_t slots_per_rank, uint64_t seed, const Context& ctx) {
  const cpu::Checker ck(
      "moe_echo_plan", ctx,
      {{"slot_expert", &slot_expert}, {"slot_tokens", &slot_tokens}, {"loads", &loads}, {"counts", &counts}});
  ck.rank("counts", 2);
  ck.dtype("counts", DType::i64);
  ck.contiguous("counts");
  const Layout L = layout_of(ck, counts.size(0), counts.size(1), slots_per_rank);
  const int64_t S = L.S();
  for (const char* n : {"slot_expert", "slot_tokens", "loads"}) {
    ck.dtype(n, DType::i64);
    ck.contiguous(n);
  }
  ck.shape("slot_expert", Shape{S});
  ck.shape("slot_tokens", Shape{L.P, S});
  ck.shape("loads", Shape{2, L.P});
  const int64_t* C = counts.data<int64_t>();
  for (int64_t i = 0; i < L.P * L.E; ++i)
    if (C[i] < 0) ck.fail("counts must be >= 0, got ", C[i], " at [", i / L.E, ", ", i % L.E, "]");
  const Loads ld = loads_of(C, L);
  std::vector<int64_t> expert(static_cast<size_t>(S), -1), budget(static_cast<size_t>(S), 0);
  if (seed != 0)
    random_clones(expert, budget, ld, L, seed);
  else if (ld.avg > 0 && L.Sl == 1)
    bin_pack(expert, budget, ld, L);
  else if (ld.avg > 0)
    water_fill(expert, budget, ld, L);
  split_over_sources(slot_tokens.data<int64_t>(), C, expert, budget, ld, L);
  std::copy(expert.begin(), expert.end(), slot_expert.data<int64_t>());
  int64_t* before = loads.data<int64_t>();
  int64_t* after = before + L.P;
  for (int64_t r = 0; r < L.P; ++r) before[r] = after[r] = ld.rank[static_cast<size_t>(r)];
  for (int64_t j = 0; j < S; ++j) {
    if (expert[static_cast<size_t>(j)] < 0) continue;
    after[expert[static_cast<size_t>(j)] / L.El] -= budget[static_cast<size_t>(j)];
    after[j / L.Sl] += budget[static_cast<size_t>(j)];
  }
}

void moe_echo_reroute(Tensor& map2, Tensor& probs2, const Tensor& map, const Tensor& probs, const Tensor& slot_expert,
                      const Tensor& slot_tokens, int64_t rank, int64_t slots_per_rank, const Context& ctx) {
  const cpu::Checker ck("moe_echo_reroute", ctx,
                        {{"map2", &map2},
                         {"probs2", &probs2},
                         {"map", &map},
                         {"probs", &probs},
                         {"slot_expert", &slot_expert},
                         {"slot_tokens", &slot_tokens}});
  ck.rank("slot_tokens", 2);
  ck.rank("map", 2);
  const int64_t T = map.size(0), E = map.size(1);
  const Layout L = layout_of(ck, slot_tokens.size(0), E, slots_per_rank);
  if (rank < 0 || rank >= L.P) ck.fail("rank ", rank, " outside [0, ", L.P, ")");
  ck.dtype("map", DType::boolean);
  ck.dtype("map2", DType::boolean);
  ck.dtype("probs", DType::f32);
  ck.dtype("probs2", DType::f32);
  ck.shape("probs", Shape{T, E});
  ck.shape("map2", Shape{T, L.columns()});
  ck.shape("probs2", Shape{T, L.columns()});
  ck.shape("slot_expert", Shape{L.S()});
  ck.shape("slot_tokens", Shape{L.P, L.S()});
  for (const char* n : {"map2", "probs2", "map", "probs", "slot_expert", "slot_tokens"}) ck.contiguous(n);
  const int64_t S = L.S(), W = L.columns();
  const bool* m = map.data<bool>();
  const float* p = probs.data<float>();
  bool* m2 = map2.data<bool>();
  float* p2 = probs2.data<float>();
  const int64_t* se = slot_expert.data<int64_t>();
  const int64_t* quota = slot_tokens.data<int64_t>() + rank * S;
  std::fill(m2, m2 + T * W, false);
  std::fill(p2, p2 + T * W, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      m2[t * W + L.home_column(e)] = m[t * E + e];
      p2[t * W + L.home_column(e)] = p[t * E + e];
    }
  for (int64_t j = 0; j < S; ++j) {
    if (se[j] < -1 || se[j] >= E) ck.fail("slot_expert[", j, "] = ", se[j], " is not an expert or -1");
    if (quota[j] < 0 || (se[j] < 0 && quota[j] != 0))
      ck.fail("slot_tokens[", rank, ", ", j, "] = ", quota[j], " for a slot of expert ", se[j]);
  }
  // Per expert, its slots in ascending order take consecutive runs of the expert's tokens.
  for (int64_t e = 0; e < E; ++e) {
    int64_t t = 0;
    const int64_t he = L.home_column(e);
    for (int64_t j = 0; j < S; ++j) {
      if (se[j] != e) continue;
      const int64_t sc = L.slot_column(j);
      for (int64_t n = quota[j]; n > 0; ++t) {
        if (t == T)
          ck.fail("slot ", j, " asks rank ", rank, " for ", quota[j], " tokens of expert ", e, ", more than it routes");
        if (!m[t * E + e]) continue;
        m2[t * W + he] = false;
        p2[t * W + he] = 0.0f;
        m2[t * W + sc] = true;
        p2[t * W + sc] = p[t * E + e];
        --n;
      }
    }
  }
}

void moe_echo_fold(Tensor& out, const Tensor& in, const Tensor& slot_expert, int64_t slots_per_rank,
                   const Context& ctx) {
  const cpu::Checker ck("moe_echo_fold", ctx, {{"out", &out}, {"in", &in}, {"slot_expert", &slot_expert}});
  ck.rank("out", 2);
  ck.rank("in", 2);
  ck.rank("slot_expert", 1);
  ck.same_dtype("in", "out");
  if (out.dtype() != DType::f32 && out.dtype() != DType::boolean)
    ck.fail("out must be f32 or bool, got ", dtype_name(out.dtype()));
  ck.dtype("slot_expert", DType::i64);
  const int64_t T = out.size(0), E = out.size(1), S = slot_expert.numel();
  if (slots_per_rank < 1 || S % slots_per_rank != 0) ck.fail("slot_expert has ", S, " slots, not P x ", slots_per_rank);
  const Layout L = layout_of(ck, S / slots_per_rank, E, slots_per_rank);
  ck.shape("in", Shape{T, L.columns()});
  for (const char* n : {"out", "in", "slot_expert"}) ck.contiguous(n);
  const int64_t* se = slot_expert.data<int64_t>();
  for (int64_t j = 0; j < S; ++j)
    if (se[j] < -1 || se[j] >= E) ck.fail("slot_expert[", j, "] = ", se[j], " is not an expert or -1");
  const int64_t W = L.columns();
  auto fold = [&](auto* o, const auto* i, auto add) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) o[t * E + e] = i[t * W + L.home_column(e)];
      for (int64_t j = 0; j < S; ++j)
        if (se[j] >= 0) o[t * E + se[j]] = add(o[t * E + se[j]], i[t * W + L.slot_column(j)]);
    }
  };
  if (out.dtype() == DType::f32)
    fold(out.data<float>(), in.data<float>(), [](float a, float b) { return a + b; });
  else
    fold(out.data<bool>(), in.data<bool>(), [](bool a, bool b) { return a || b; });
}

}  // namespace moecore::ops
