// The arithmetic of MoE ECHO's planner (ops.h, "MoE ECHO"), shared by the CPU kernel and the CUDA kernel (one
// thread): plain loops over one caller-provided int64 scratch array, integer arithmetic only, so both backends make
// the same plan bit for bit. The draw of the debug mode is a template argument (philox_uniform on either side).
// Not here: the entry checks (kernels/cpu/moe_echo.cpp), the rerouting and the fold.
// Letters that differ from core/dims.h's: P is the EP size (El = E / P as there), Sl the clone slots per rank,
// S = P * Sl all slots, C the [P, E] token counts.
#pragma once
#include <cstdint>

#include "moecore/kernels/common/hd.h"

namespace moecore::ops::echo_plan {

constexpr int64_t kBuckets = 8;  // the approximate bin packing's buckets of spill sizes

// Scratch words plan() needs for P ranks, E experts and S slots.
MOECORE_HD inline int64_t scratch_words(int64_t P, int64_t E, int64_t S) {
  const int64_t Q = E + P;  // a bucket's FIFO: every expert once, plus at most one re-queue per rank
  return 4 * E + 3 * P + 2 * (E + P) + S + kBuckets * (Q + 2) + 3 * Q;
}

namespace detail {
// Indices [0, n) with key[i] > 0 (or all, with all_of), stably sorted by key (descending or ascending); returns how
// many. Insertion sort: n is small (experts or ranks) and the order of equal keys is the lower index first.
MOECORE_HD inline int64_t sorted(int64_t* idx, const int64_t* key, int64_t n, bool descending, bool all_of,
                                 int64_t first = 0) {
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!all_of && key[i] <= 0) continue;
    const int64_t v = key[i];
    int64_t j = m++;
    while (j > 0 && (descending ? key[idx[j - 1]] < v : key[idx[j - 1]] > v)) {
      idx[j] = idx[j - 1];
      --j;
    }
    idx[j] = i;
  }
  for (int64_t i = 0; i < m; ++i) idx[i] += first;
  return m;
}
MOECORE_HD inline int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}
MOECORE_HD inline int64_t max64(int64_t a, int64_t b) {
  return a > b ? a : b;
}
// plan()'s arrays, laid out in its scratch w (scratch_words(P, E, S) words); Q = E + P.
struct Scratch {
  int64_t* load;    // [E] tokens routed to each expert
  int64_t* spill;   // [E] each expert's tokens above the average of its rank
  int64_t* left;    // [E] tokens not yet given to a clone
  int64_t* rank;    // [P] tokens routed to each rank's experts
  int64_t* spare;   // [P] each rank's room below the average
  int64_t* taken;   // [P] tokens of one expert given to clones, per source rank
  int64_t* order;   // [E + P]
  int64_t* budget;  // [S] tokens each slot's clone takes
  int64_t* order2;  // [E + P]
  int64_t* queue;   // [kBuckets, Q]
  int64_t* head;    // [kBuckets]
  int64_t* tail;    // [kBuckets]
  int64_t* xr;      // [Q] water-filling transfers: rank, expert, amount
  int64_t* xe;      // [Q]
  int64_t* xa;      // [Q]
};

MOECORE_HD inline Scratch scratch_arrays(int64_t* w, int64_t P, int64_t E, int64_t S) {
  const int64_t Q = E + P;
  Scratch a;
  a.load = w;
  a.spill = w + E;
  a.left = w + 2 * E;
  a.rank = w + 3 * E;
  a.spare = a.rank + P;
  a.taken = a.spare + P;
  a.order = a.taken + P;
  a.budget = a.order + (E + P);
  a.order2 = a.budget + S;
  a.queue = a.order2 + (E + P);
  a.head = a.queue + kBuckets * Q;
  a.tail = a.head + kBuckets;
  a.xr = a.tail + kBuckets;
  a.xe = a.xr + Q;
  a.xa = a.xe + Q;
  return a;
}

// Step 1: loads, the average, spare capacity, spill-over. Returns the average (total / P).
MOECORE_HD inline int64_t plan_loads(const Scratch& a, const int64_t* C, int64_t P, int64_t E, int64_t El) {
  int64_t* load = a.load;
  int64_t* spill = a.spill;
  int64_t* rank = a.rank;
  int64_t* spare = a.spare;
  int64_t* order = a.order;
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    load[e] = 0;
    for (int64_t s = 0; s < P; ++s) load[e] += C[s * E + e];
  }
  for (int64_t r = 0; r < P; ++r) {
    rank[r] = 0;
    for (int64_t e = r * El; e < (r + 1) * El; ++e) rank[r] += load[e];
    total += rank[r];
  }
  const int64_t avg = total / P;
  for (int64_t r = 0; r < P; ++r) {
    spare[r] = max64(0, avg - rank[r]);
    const int64_t n = detail::sorted(order, load + r * El, El, /*descending=*/false, /*all_of=*/true, r * El);
    int64_t below = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = order[i], above = below + load[e];
      spill[e] = max64(0, above - max64(below, avg));
      below = above;
    }
  }
  return avg;
}

// Step 2, the debug mode: slot j, an expert of another rank, 20-40 % of its pairs not yet moved.
template <class Uniform>
MOECORE_HD void clones_random(int64_t* slot_expert, const Scratch& a, int64_t E, int64_t El, int64_t S, int64_t Sl,
                              const Uniform& uniform) {
  int64_t* load = a.load;
  int64_t* left = a.left;
  int64_t* budget = a.budget;
  for (int64_t e = 0; e < E; ++e) left[e] = load[e];
  const int64_t others = E - El;
  for (int64_t j = 0; j < S && others > 0; ++j) {
    const int64_t d = j / Sl;
    const int64_t pick = min64(others - 1, static_cast<int64_t>(uniform(2 * j) * static_cast<float>(others)));
    const int64_t e = pick < d * El ? pick : pick + El;
    const float frac = 0.2f + 0.2f * uniform(2 * j + 1);
    const int64_t moved = static_cast<int64_t>(frac * static_cast<float>(left[e]));
    if (moved <= 0) continue;
    slot_expert[j] = e;
    budget[j] = moved;
    left[e] -= moved;
  }
}

// The bucket of the approximate bin packing for s tokens still to move (0: at least the average).
MOECORE_HD inline int64_t bucket_of(int64_t s, int64_t avg) {
  return s >= avg ? int64_t{0} : min64(kBuckets - 1, 1 + (avg - s) * (kBuckets - 1) / avg);
}

// Step 2 with one clone slot per rank (avg > 0): approximate bin packing.
MOECORE_HD inline void clones_bin_packing(int64_t* slot_expert, const Scratch& a, int64_t P, int64_t E, int64_t Sl,
                                          int64_t avg) {
  const int64_t Q = E + P;
  int64_t* spill = a.spill;
  int64_t* left = a.left;
  int64_t* spare = a.spare;
  int64_t* order = a.order;
  int64_t* budget = a.budget;
  int64_t* order2 = a.order2;
  int64_t* queue = a.queue;
  int64_t* head = a.head;
  int64_t* tail = a.tail;
  for (int64_t b = 0; b < kBuckets; ++b) head[b] = tail[b] = 0;
  for (int64_t e = 0; e < E; ++e) left[e] = spill[e];
  const int64_t ne = detail::sorted(order, spill, E, /*descending=*/true, /*all_of=*/false);
  for (int64_t i = 0; i < ne; ++i) {
    const int64_t b = bucket_of(left[order[i]], avg);
    queue[b * Q + tail[b]++] = order[i];
  }
  const int64_t nr = detail::sorted(order2, spare, P, /*descending=*/true, /*all_of=*/false);
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t r = order2[i];
    int64_t b = 0;
    while (b < kBuckets && head[b] == tail[b]) ++b;
    if (b == kBuckets) break;
    const int64_t e = queue[b * Q + head[b]++];
    const int64_t moved = min64(left[e], spare[r]);
    slot_expert[r * Sl] = e;
    budget[r * Sl] = moved;
    left[e] -= moved;
    if (left[e] > 0) {
      const int64_t nb = bucket_of(left[e], avg);
      queue[nb * Q + tail[nb]++] = e;
    }
  }
}

// Step 2 with several clone slots per rank (avg > 0): water-filling, then each rank's Sl largest transfers.
MOECORE_HD inline void clones_water_filling(int64_t* slot_expert, const Scratch& a, int64_t P, int64_t E, int64_t Sl) {
  int64_t* spill = a.spill;
  int64_t* spare = a.spare;
  int64_t* order = a.order;
  int64_t* budget = a.budget;
  int64_t* order2 = a.order2;
  int64_t* xr = a.xr;
  int64_t* xe = a.xe;
  int64_t* xa = a.xa;
  const int64_t ne = detail::sorted(order, spill, E, /*descending=*/true, /*all_of=*/false);
  const int64_t nr = detail::sorted(order2, spare, P, /*descending=*/true, /*all_of=*/false);
  int64_t nx = 0, i = 0, k = 0;
  int64_t spill_left = ne > 0 ? spill[order[0]] : 0, spare_left = nr > 0 ? spare[order2[0]] : 0;
  while (i < ne && k < nr) {
    const int64_t n = min64(spill_left, spare_left);
    xr[nx] = order2[k], xe[nx] = order[i], xa[nx] = n, ++nx;
    spill_left -= n;
    spare_left -= n;
    if (spill_left == 0 && ++i < ne) spill_left = spill[order[i]];
    if (spare_left == 0 && ++k < nr) spare_left = spare[order2[k]];
  }
  for (int64_t r = 0; r < P; ++r) {
    for (int64_t q = 0; q < Sl; ++q) {  // the q-th largest transfer into r (ties: the lower expert)
      int64_t best = -1;
      for (int64_t x = 0; x < nx; ++x) {
        if (xr[x] != r || xa[x] < 0) continue;
        if (best < 0 || xa[x] > xa[best] || (xa[x] == xa[best] && xe[x] < xe[best])) best = x;
      }
      if (best < 0) break;
      slot_expert[r * Sl + q] = xe[best];
      budget[r * Sl + q] = xa[best];
      xa[best] = -1;  // taken
    }
  }
}

// Step 3: each slot's budget over the source ranks: proportional floors, then the residues depth-first.
MOECORE_HD inline void split_budgets(int64_t* slot_tokens, const int64_t* slot_expert, const Scratch& a,
                                     const int64_t* C, int64_t P, int64_t E, int64_t S) {
  int64_t* load = a.load;
  int64_t* taken = a.taken;
  int64_t* budget = a.budget;
  for (int64_t i = 0; i < P * S; ++i) slot_tokens[i] = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t s = 0; s < P; ++s) taken[s] = 0;
    for (int64_t j = 0; j < S; ++j) {
      if (slot_expert[j] != e) continue;
      for (int64_t s = 0; s < P; ++s) {
        // budget <= load and counts <= load: the product stays below load^2 (< 2^63 for any real token count)
        const int64_t share = budget[j] * C[s * E + e] / load[e];
        slot_tokens[s * S + j] = share;
        taken[s] += share;
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      if (slot_expert[j] != e) continue;
      int64_t residue = budget[j];
      for (int64_t s = 0; s < P; ++s) residue -= slot_tokens[s * S + j];
      for (int64_t s = 0; s < P && residue > 0; ++s) {
        const int64_t n = min64(residue, C[s * E + e] - taken[s]);
        slot_tokens[s * S + j] += n;
        taken[s] += n;
        residue -= n;
      }
    }
  }
}
}  // namespace detail

// slot_expert [S], slot_tokens [P, S], loads [2, P] written from counts [P, E] (every count >= 0, E = P El, S = P Sl).
// uniform(i): philox_uniform(key, i) of the debug mode's key; random: the debug mode.
template <class Uniform>
MOECORE_HD void plan(int64_t* slot_expert, int64_t* slot_tokens, int64_t* loads, const int64_t* C, int64_t P, int64_t E,
                     int64_t Sl, bool random, const Uniform& uniform, int64_t* w) {
  const int64_t El = E / P, S = P * Sl;
  const detail::Scratch a = detail::scratch_arrays(w, P, E, S);
  int64_t* rank = a.rank;
  int64_t* budget = a.budget;
  const int64_t avg = detail::plan_loads(a, C, P, E, El);
  for (int64_t j = 0; j < S; ++j) slot_expert[j] = -1, budget[j] = 0;
  // Step 2: the clones and their budgets.
  if (random)
    detail::clones_random(slot_expert, a, E, El, S, Sl, uniform);
  else if (avg > 0 && Sl == 1)
    detail::clones_bin_packing(slot_expert, a, P, E, Sl, avg);
  else if (avg > 0)
    detail::clones_water_filling(slot_expert, a, P, E, Sl);
  detail::split_budgets(slot_tokens, slot_expert, a, C, P, E, S);
  // Loads before and after.
  for (int64_t r = 0; r < P; ++r) loads[r] = loads[P + r] = rank[r];
  for (int64_t j = 0; j < S; ++j) {
    if (slot_expert[j] < 0) continue;
    loads[P + slot_expert[j] / El] -= budget[j];
    loads[P + j / Sl] += budget[j];
  }
}

}  // namespace moecore::ops::echo_plan
