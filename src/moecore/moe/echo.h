// MoE ECHO, the layer's part (docs/echo-folding-perf.md §A): per layer and micro-batch, the clone plan from
// the all-gathered per-(source rank, expert) counts, the rerouting of this rank's tokens to clone columns, the expert
// (weight) dispatcher that brings each cloned expert's weights to its slot, and the gradient reduction that sums every
// clone's weight gradient back into its home expert. The token dispatcher then sees E' = EP (El + Sl) experts, each
// rank's block [home experts..., clone slots...] (ops.h "MoE ECHO" for the layout and the planner).
// Not here: the planner's arithmetic (kernels), the token dispatch (dispatcher.h), the static received-token capacity.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/moe/config.h"
#include "moecore/moe/experts.h"
#include "moecore/parallel/comm.h"

namespace moecore::moe {

// --moe-echo-expert-dispatcher-type: how cloned weights travel. alltoall: the clone map is read on the host and each
// clone's weights go point to point from its home rank to its slot (the reference's all-to-all path: host-sized, not
// sync-free). hybridep is Megatron's device-side dispatcher (a GPU backend): refused, as is anything else (Error).
void echo_check_dispatcher_type(const std::string& s);

enum class DispatcherKind : uint8_t;
// The layout ECHO (slots > 0 global clone slots) and a static received-token capacity (received_capacity > 0) need:
// EP > 1, the alltoall token dispatcher, ETP 1, slots a multiple of EP, and for ECHO dropless routing without padding
// (cfg). Error naming the flags and values; nothing when both are off. Checked at start-up on every rank before any
// collective (from the config) and again by moe_layer_cache_alloc (from its dims).
void echo_check_layout(int64_t slots, float received_capacity, int64_t ep, int64_t etp, DispatcherKind dispatcher,
                       const MoeConfig& cfg);
// The same from the configuration's flags.
void echo_check_layout(const MoeConfig& cfg, int64_t ep, int64_t etp, DispatcherKind dispatcher);

struct EchoDims {
  int64_t slots = 0;                    // --moe-num-echo-experts: global clone slots (0: ECHO off), a multiple of ep
  bool recompute_dispatch = false;      // --moe-echo-recompute-expert-dispatch: clones are fetched again in backward,
                                        // so one set of clone buffers serves every layer
  bool random = false;                  // --moe-echo-enable-random-offloading: the planner's debug mode (random clones)
  uint64_t seed = 1234;                 // the debug mode's stream
  bool biases = false;                  // the experts have linear biases (add_bias_linear): clones carry them
  const ProcessGroup* group = nullptr;  // the EP group
  bool enabled() const { return slots > 0; }
};

// Everything ECHO keeps per layer. The plan and the rerouted routing are the layer's routing (kept by a recompute);
// clones are refilled by every forward (scratch with recompute_dispatch); the rest is backward scratch.
struct EchoCache {
  int64_t ep = 1, rank = 0, El = 0, Sl = 0;
  Tensor counts;            // [EP, E] i64: routed pairs per (source rank, expert), all-gathered
  Tensor slot_expert;       // [S] i64: the home expert each slot runs (-1: empty)
  Tensor slot_tokens;       // [EP, S] i64: pairs of each source rank each slot runs
  Tensor loads;             // [2, EP] i64: pairs each EP rank receives before and after the plan
  Tensor map, probs;        // [T, E'] bool / f32: this rank's rerouted routing
  Tensor dprobs;            // [T, E'] f32 (backward scratch)
  ExpertWeights clones;     // [Sl, ...] compute (biases f32): the weights of the experts this rank's slots clone
  ExpertGrads clone_grads;  // [Sl, ...] f32 (backward scratch)
  ExpertGrads grad_in;      // [1, ...] f32: one clone's gradient arriving home (backward scratch)
  std::vector<int64_t> slot_expert_host;  // [S] the clone map on the host (the alltoall dispatcher's sizes)
  uint64_t plans = 0;                     // forwards planned (the debug mode's counter)
  // the clone transfers in flight (echo_fetch_clones_start), then the clone gradients' (echo_reduce_clone_grads)
  std::shared_ptr<std::vector<CommHandle>> fetches;
  bool recompute_dispatch = false;  // clones are scratch, fetched again by backward (EchoDims)
};
// E: routed experts; T: this rank's tokens; d.group: the EP group.
EchoCache echo_cache_alloc(const EchoDims& d, int64_t T, int64_t E, const ExpertDims& home);
// The tensors shared by the layers of a model: backward scratch, and the clones with recompute_dispatch.
std::vector<Tensor*> echo_scratch_tensors(EchoCache& c);
std::vector<const Tensor*> echo_scratch_tensors(const EchoCache& c);
// The plan and the rerouted routing (kept by a recompute), and the clones when they are not scratch (refilled).
std::vector<const Tensor*> echo_routing_tensors(const EchoCache& c);
std::vector<const Tensor*> echo_refilled_tensors(const EchoCache& c);

// The plan and the rerouting: counts [E] i64 (this rank's routed pairs per expert) are all-gathered over the EP group,
// the plan made, map/probs [T, E] rerouted into c.map/c.probs [T, E'].
void echo_plan(EchoCache& c, const Tensor& counts, const Tensor& map, const Tensor& probs, const EchoDims& d,
               const ops::Context& ctx);
// The expert dispatcher: every slot's clone weights from the home rank of its expert into c.clones (home: this rank's
// [El, ...] experts). Collective over the EP group (point to point between the ranks the plan pairs). Posted
// nonblocking, so the token dispatch and the home experts run while the weights travel: c.clones may be read, and
// `home` written, only after echo_fetch_clones_wait.
void echo_fetch_clones_start(EchoCache& c, const ExpertWeights& home, const EchoDims& d);
void echo_fetch_clones_wait(EchoCache& c);
// The gradient reduction: c.clone_grads go back to their home ranks, where they are added (+=, slots ascending) into
// the home experts' gradients `home`. Collective over the EP group, like the fetch.
void echo_reduce_clone_grads(ExpertGrads& home, EchoCache& c, const EchoDims& d, const ops::Context& ctx);

// The rows of the home experts among the rows this rank received (alltoall dispatcher: its host copy of the counts).
struct DispatchBuffers;
int64_t echo_home_rows(const DispatchBuffers& b, const EchoCache& c);

// A host snapshot of one layer's plan, for logging.
struct EchoStatsHost {
  std::vector<int64_t> before, after;  // [EP] pairs received per rank
  int64_t clones = 0;                  // slots in use
  int64_t weight_bytes = 0;            // bytes of cloned weights moved (over the group)
  double max_over_mean_before() const;
  double max_over_mean_after() const;
};
EchoStatsHost echo_stats_host(const EchoCache& c, const ExpertWeights& home);

}  // namespace moecore::moe
