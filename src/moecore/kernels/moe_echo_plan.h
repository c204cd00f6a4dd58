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
}  // namespace detail

// slot_expert [S], slot_tokens [P, S], loads [2, P] written from counts [P, E] (every count >= 0, E = P El, S = P Sl).
// uniform(i): philox_uniform(key, i) of the debug mode's key; random: the debug mode.
template <class Uniform>
MOECORE_HD void plan(int64_t* slot_expert, int64_t* slot_tokens, int64_t* loads, const int64_t* C, int64_t P, int64_t E,
                     int64_t Sl, bool random, const Uniform& uniform, int64_t* w) {
  using detail::max64;
  using detail::min64;
  const int64_t El = E / P, S = P * Sl, Q = E + P;
  int64_t* load = w;                     // [E]
  int64_t* spill = w + E;                // [E]
  int64_t* left = w + 2 * E;             // [E]
  int64_t* rank = w + 3 * E;             // [P]
  int64_t* spare = rank + P;             // [P]
  int64_t* taken = spare + P;            // [P]
  int64_t* order = taken + P;            // [E + P]
  int64_t* budget = order + (E + P);     // [S]
  int64_t* order2 = budget + S;          // [E + P]
  int64_t* queue = order2 + (E + P);     // [kBuckets, Q]
  int64_t* head = queue + kBuckets * Q;  // [kBuckets]
  int64_t* tail = head + kBuckets;       // [kBuckets]
  int64_t* xr = tail + kBuckets;         // [Q] water-filling transfers: rank, expert, amount
  int64_t* xe = xr + Q;
  int64_t* xa = xe + Q;
  // Step 1: loads, the average, spare capacity, spill-over.
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
  for (int64_t j = 0; j < S; ++j) slot_expert[j] = -1, budget[j] = 0;
  // Step 2: the clones and their budgets.
  if (random) {  // slot j: an expert of another rank, 20-40 % of its pairs not yet moved
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
  } else if (avg > 0 && Sl == 1) {  // approximate bin packing
    for (int64_t b = 0; b < kBuckets; ++b) head[b] = tail[b] = 0;
    auto bucket_of = [&](int64_t s) {
      return s >= avg ? int64_t{0} : min64(kBuckets - 1, 1 + (avg - s) * (kBuckets - 1) / avg);
    };
    for (int64_t e = 0; e < E; ++e) left[e] = spill[e];
    const int64_t ne = detail::sorted(order, spill, E, /*descending=*/true, /*all_of=*/false);
    for (int64_t i = 0; i < ne; ++i) {
      const int64_t b = bucket_of(left[order[i]]);
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
        const int64_t nb = bucket_of(left[e]);
        queue[nb * Q + tail[nb]++] = e;
      }
    }
  } else if (avg > 0) {  // water-filling, then each rank's Sl largest transfers
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
  // Loads before and after.
  for (int64_t r = 0; r < P; ++r) loads[r] = loads[P + r] = rank[r];
  for (int64_t j = 0; j < S; ++j) {
    if (slot_expert[j] < 0) continue;
    loads[P + slot_expert[j] / El] -= budget[j];
    loads[P + j / Sl] += budget[j];
  }
}

}  // namespace moecore::ops::echo_plan
