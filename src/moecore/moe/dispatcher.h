// Token dispatch: the permutation of token copies into expert-major order and its inverse, behind the stage
// interface every dispatcher implements (docs/STYLE.md). Forward, in Megatron's order:
//   dispatch_prepare (local) -> exchange_counts (communication) -> dispatch (communication, then the local
//   permutation of what arrived) -> [experts] -> combine_prepare (local) -> combine (communication) -> combine_finish
//   (local)
// Backward has two stages, each with its communication: combine_backward, then dispatch_backward.
// LocalDispatcher serves one process; the all-to-all and all-gather dispatchers implement the same interface over
// process groups (the EP group). Each dispatcher has its own state type (LocalState, AllToAllState, AllGatherState),
// allocated by the dispatcher class from DispatchDims and held in the layer's DispatchBuffers.
//
// Permutation contract (docs/megatron-moe-spec.md §5.1): rows are grouped by expert (ascending), and within an expert
// by ascending source token. For routed pair (t, e): row = token_rows[t, e]; row_token[row] = t.
//   permuted_x[row] = x[row_token[row]]            permuted_probs[row] = probs[t, e]
//   y[t] = sum over e ascending with token_rows[t, e] >= 0 of expert_out[token_rows[t, e]]   (f32 sum, one rounding)
// Probabilities are not applied by the combine: experts multiply them after the activation.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <string>
#include <variant>
#include <vector>

#include "moecore/kernels/ops.h"
#include "moecore/parallel/comm.h"

namespace moecore::moe {

// Counts, offsets and indices live on the device of the layer (ops.h's MoE permutation ops read them); the
// host knows only row_bound, an upper bound on this step's rows that needs no device read.
struct DispatchPlan {
  int64_t T = 0, E = 0;
  Tensor tokens_per_expert;  // [E] i64: rows per expert
  Tensor expert_offset;      // [E + 1] i64: first row of each expert (prefix sums)
  Tensor row_token;          // [max_rows] i32: source token of each row (-1 past the routed rows)
  Tensor token_rows;         // [T, E] i32: row of (t, e), -1 when not routed
  // Rows the experts process this step: the buffers' rows (local and all-gather: a static worst case, exact
  // for dropless and pad-to-capacity routing), or the rows received (all-to-all: the host has those counts).
  int64_t row_bound = 0;
};
// The sizes of one layer's dispatch buffers. EP ranks own contiguous expert blocks: rank r of the EP group holds
// experts [r*El, (r+1)*El), El = E / ep.
struct DispatchDims {
  int64_t T = 0;         // this rank's tokens
  int64_t H = 0;         // hidden size
  int64_t E = 0;         // all experts (the map's columns)
  int64_t ep = 1;        // EP group size
  int64_t etp = 1;       // ETP group size
  int64_t max_send = 0;  // rows this rank's tokens produce: dispatch_max_rows of the T tokens over E experts
  int64_t max_rows = 0;  // rows the local experts can receive: dispatch_max_rows_ep
  DType x_dtype = DType::f32;
  Device device = Device::cpu;
};

// The local dispatcher keeps nothing beyond the common buffers.
struct LocalState {};

// Expert tensor parallelism (ETP > 1, Megatron's --expert-tensor-parallel-size) splits every expert's fc1 (columns)
// and fc2 (rows) over the ETP ranks of the same EP rank, so each of them runs every row that reaches its EP rank and
// produces a partial sum of the output: the alltoall dispatcher all-gathers the rows it received over ETP after the
// all-to-all and reduce-scatters the partial outputs (f32, rank order) before the all-to-all back (Megatron's
// MoEAlltoAllTokenDispatcher with tp_size > 1); the allgather dispatcher gathers over the whole ETP x EP group, whose
// reduce-scatter sums the partials with the other experts' rows.

// The all-to-all dispatcher's staging rows: dead between a layer's forward and its backward, so one set serves every
// layer of a model (moe_layer_cache_alloc shares it).
struct AllToAllScratch {
  Tensor send_x, send_f, send_p;     // [max_send, H] x dtype / [max_send, H] f32 / [max_send] f32 (send layout)
  Tensor stage_x, stage_f, stage_p;  // [max_rows, H] x dtype / f32, [max_rows] f32 (receive layout)
  Tensor own_x, own_f, own_p;        // ETP > 1: this rank's all-to-all rows, [max_own, H] / [max_own]
};
// The all-to-all dispatcher's state of one layer, kept from forward to backward.
struct AllToAllState {
  int64_t ep = 1, etp = 1, local_experts = 0;  // EP, ETP, El
  DispatchPlan send_plan;                      // this rank's T tokens over all E experts (rows grouped by EP rank)
  // [ETP * EP * El] i64 (device): rows of chunk (k, s, le) -- from source EP rank s for local expert le, received by
  // ETP rank k -- at (k * EP + s) * El + le (Megatron's [tp][ep] source order)
  Tensor chunk_counts;
  Tensor ep_counts;                           // [EP * El] i64 (ETP > 1): this rank's part, before the ETP all-gather
  std::vector<int64_t> send_counts_host;      // [E] host copy of send_plan.tokens_per_expert
  std::vector<int64_t> chunk_counts_host;     // [ETP * EP * El] host copy of chunk_counts
  std::vector<int64_t> send_rows, recv_rows;  // [EP] rows to / from each rank of the EP group (from the host copies)
  std::vector<int64_t> etp_rows;              // [ETP] rows each ETP rank received by its all-to-all
  std::vector<int64_t> el_blocks;             // [EP] all El: the count exchange's block sizes
  // Static received-token capacity: the layer's saved expert-side buffers (permuted rows, the experts' caches) hold
  // fewer rows than the staging scratch. When this rank receives more rows than they hold, exchange_counts sets
  // `overflow` and the layer drops every row it received (zero expert output and input gradient), the exchanges
  // keeping their sizes; the step is then run again with buffers for every row (the trainer's retry).
  bool overflow = false;
  AllToAllScratch scratch;
};

// The all-gather dispatcher's gathered rows: scratch like AllToAllScratch.
struct AllGatherScratch {
  Tensor gx, gprobs, gy, gdprobs;  // [EP*T, H] x dtype, [EP*T, E] f32, [EP*T, H] f32, [EP*T, E] f32
  Tensor ty;                       // [T, H] f32: the reduce-scattered input gradient
};
// The all-gather dispatcher's state of one layer, kept from forward to backward (EP*T: ETP x EP x T tokens).
struct AllGatherState {
  int64_t ep = 1, etp = 1, local_experts = 0;  // EP, ETP, El
  Tensor gmap;                                 // [EP*T, E] bool: the gathered routing map
  Tensor lmap, lprobs;                         // [EP*T, El] bool / f32: its local expert columns
  Tensor in_x, in_probs, in_map;               // handles to the forward inputs, from dispatch_prepare to dispatch
  AllGatherScratch scratch;
};

using DispatcherState = std::variant<LocalState, AllToAllState, AllGatherState>;

// Buffers of one layer's dispatch, sized once for the largest row count the config allows: the expert-side rows every
// dispatcher fills and reads, and the state of the dispatcher they were allocated for.
struct DispatchBuffers {
  DispatchPlan plan;       // the expert side: rows per local expert (and, for local/allgather, the token map)
  Tensor permuted_x;       // [max_rows, H] dtype of x
  Tensor permuted_probs;   // [max_rows] f32
  Tensor expert_out;       // [max_rows, H] dtype of x: written by the experts (scratch)
  Tensor dpermuted;        // [max_rows, H] dtype of x: backward (dy gathered to rows; scratch)
  Tensor dexpert_in;       // [max_rows, H] f32: backward (experts' input gradient; scratch)
  Tensor dpermuted_probs;  // [max_rows] f32: backward (scratch)
  DispatcherState state;
};
// max_rows: T*K dropless; E*capacity with pad-to-capacity; plus E*(alignment-1) with router padding.
int64_t dispatch_max_rows(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity, int64_t alignment);
// The local dispatcher's buffers.
DispatchBuffers dispatch_buffers_alloc(int64_t T, int64_t H, int64_t E, int64_t max_rows, DType x_dtype,
                                       Device device = Device::cpu);

enum class DispatcherKind : uint8_t { local, alltoall, allgather };
DispatcherKind parse_dispatcher_kind(const std::string& s);  // "alltoall" | "allgather" (Error otherwise)
const char* dispatcher_kind_name(DispatcherKind k);

// Expert-side rows bound under EP: each of the EP x ETP source ranks sends at most T*min(K, El) rows to one EP rank
// (a token meets an expert once), fewer with a capacity. With ep == etp == 1 it equals dispatch_max_rows.
int64_t dispatch_max_rows_ep(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity, int64_t alignment,
                             int64_t ep, int64_t etp = 1);
// The buffers of a dispatcher of `kind`, its state allocated by that dispatcher class (local, or ep == etp == 1: as
// dispatch_buffers_alloc).
DispatchBuffers dispatch_buffers_alloc_ep(DispatcherKind kind, const DispatchDims& d);
// The scratch tensors of the buffers (the common ones, then the state's): for sharing them between layers and for
// memory accounting. Both lists have the same order for buffers of the same kind.
std::vector<Tensor*> dispatch_scratch_tensors(DispatchBuffers& b);
std::vector<const Tensor*> dispatch_scratch_tensors(const DispatchBuffers& b);
// The saved tensors a forward fills from the routing (the plans and counts, the expert-side rows): what a recompute
// refills, and what the layer keeps from forward to backward.
std::vector<const Tensor*> dispatch_refilled_tensors(const DispatchBuffers& b);
// Whether the last forward dropped every received row (AllToAllState::overflow; false for the other dispatchers).
bool dispatch_overflowed(const DispatchBuffers& b);

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  // Forward. x [T, H], probs [T, E] f32, map [T, E] bool; buf allocated for this dispatcher (dispatch_buffers_alloc_ep
  // with its kind and layout: Error otherwise). After dispatch, buf.permuted_* hold this rank's expert inputs,
  // buf.plan.tokens_per_expert the rows per (local) expert and buf.plan.row_bound a host bound on their sum.
  virtual void dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                                const ops::Context& ctx) = 0;
  // The rows each rank will receive, exchanged and brought to the host where the dispatcher needs them to size its
  // exchange (the all-to-all dispatcher's one host synchronisation); nothing for the others.
  virtual void exchange_counts(DispatchBuffers& buf, const ops::Context& ctx) = 0;
  virtual void dispatch(DispatchBuffers& buf, const ops::Context& ctx) = 0;
  // After the experts wrote buf.expert_out. y [T, H] f32 is written with the per-token sum, by combine (all-gather:
  // the reduce-scatter) or by combine_finish (local, all-to-all: the unpermute of the rows that came back).
  virtual void combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) = 0;
  virtual void combine(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) = 0;
  virtual void combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) = 0;

  // Backward of the combine: dy [T, H] f32 gathered into buf.dpermuted (the dtype of x).
  virtual void combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) = 0;
  // Backward of the dispatch: dx [T, H] f32 += the sum of buf.dexpert_in over each token's rows;
  // dprobs [T, E] f32 is written (buf.dpermuted_probs scattered back, 0 where not routed).
  virtual void dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) = 0;

  // Wall seconds spent inside this dispatcher's collectives (all-to-all, all-gather, reduce-scatter,
  // including the wait for slower peers) since the last reset: the step-time share the trainer logs.
  double comm_seconds() const { return comm_seconds_; }
  void reset_comm_seconds() { comm_seconds_ = 0; }

 protected:
  double comm_seconds_ = 0;
};

// One process: communication stages are no-ops; permute and unpermute are single fused passes.
class LocalDispatcher final : public Dispatcher {
 public:
  static LocalState alloc_state(const DispatchDims&) { return {}; }
  void dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                        const ops::Context& ctx) override;
  void exchange_counts(DispatchBuffers&, const ops::Context&) override {}
  void dispatch(DispatchBuffers&, const ops::Context&) override {}
  void combine_prepare(DispatchBuffers&, const ops::Context&) override {}
  void combine(DispatchBuffers&, Tensor&, const ops::Context&) override {}
  void combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) override;
  void combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) override;
  void dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) override;
};

// Expert parallelism by all-to-all (Megatron's MoEAlltoAllTokenDispatcher, spec §6.2) over the EP group:
// permute this rank's tokens expert-major over all E experts (so grouped by destination rank), exchange the
// per-expert counts (a device collective), copy them to the host to size the all-to-all-v (the one host
// synchronisation of the layer, as in Megatron's dropless all-to-all dispatcher; a static per-rank capacity
// removes it), all-to-all-v the rows and their probabilities, sort the received chunks from
// [source rank][local expert] to [local expert][source rank], run the experts, and the reverse. Within one
// local expert rows are ordered by source rank, then ascending source token. Every stage is deterministic.
// With ETP > 1 (etp: the group of the ranks holding the other slices of the same experts) the counts and the rows
// received are all-gathered over etp, the sources being (ETP rank, EP rank) in that order, and the experts' partial
// outputs and input gradients are reduce-scattered over it (AllToAllState).
class AllToAllDispatcher final : public Dispatcher {
 public:
  explicit AllToAllDispatcher(ProcessGroup ep, ProcessGroup etp = comm_single("etp"))
      : ep_(std::move(ep)), etp_(std::move(etp)) {}
  // The state of one layer: its plan and counts with the expert side over El = E / ep local experts.
  static AllToAllState alloc_state(const DispatchDims& d);
  const ProcessGroup& group() const { return ep_; }
  void dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                        const ops::Context& ctx) override;
  void exchange_counts(DispatchBuffers& buf, const ops::Context& ctx) override;
  void dispatch(DispatchBuffers& buf, const ops::Context& ctx) override;
  void combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) override;
  void combine(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) override;
  void combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) override;
  void combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) override;
  void dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) override;

 private:
  AllToAllState& state_of(DispatchBuffers& buf) const;
  // All-to-all of rows from the send side to this rank's block (then, with ETP > 1, all-gathered into stage), and the
  // way back (with ETP > 1 the partial sums reduce-scattered first; f32 rows).
  void rows_in(AllToAllState& s, const Tensor& stage, const Tensor& own, const Tensor& send);
  void rows_out(AllToAllState& s, const Tensor& send, const Tensor& own, const Tensor& stage);
  ProcessGroup ep_, etp_;
};

// Expert parallelism by all-gather (Megatron's MoEAllGatherTokenDispatcher, spec §6.1): every rank gathers
// all EP*T tokens with their probabilities and routing map, keeps the columns of its local experts, permutes
// and runs them; combine_prepare unpermutes into [EP*T, H] f32 and combine reduce-scatters it into y (deterministic
// rank order). The group is Megatron's tp_ep group: ETP x EP ranks, ETP varying fastest (EP rank = group rank / etp),
// so with ETP > 1 the reduce-scatter also sums the expert slices' partial outputs.
class AllGatherDispatcher final : public Dispatcher {
 public:
  explicit AllGatherDispatcher(ProcessGroup etp_ep, int64_t etp = 1) : ep_(std::move(etp_ep)), etp_(etp) {}
  // The state of one layer: the gathered map of ETP x EP x T tokens and its El = E / ep local columns.
  static AllGatherState alloc_state(const DispatchDims& d);
  const ProcessGroup& group() const { return ep_; }
  void dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                        const ops::Context& ctx) override;
  void exchange_counts(DispatchBuffers&, const ops::Context&) override {}  // static sizes: nothing to exchange
  void dispatch(DispatchBuffers& buf, const ops::Context& ctx) override;
  void combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) override;
  void combine(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) override;
  void combine_finish(DispatchBuffers&, Tensor&, const ops::Context&) override {}
  void combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) override;
  void dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) override;

 private:
  AllGatherState& state_of(DispatchBuffers& buf) const;
  int64_t first_local_expert(const AllGatherState& s) const { return ep_.rank() / etp_ * s.local_experts; }
  ProcessGroup ep_;
  int64_t etp_ = 1;
};

// The building blocks, also used by other dispatchers and by tests (thin wrappers over ops.h's MoE ops on the
// plan's tensors). A plan for a [T, E] map with room for max_rows rows, its tensors on `device`:
DispatchPlan dispatch_plan_alloc(int64_t T, int64_t E, int64_t max_rows, Device device = Device::cpu);
void dispatch_plan_build(DispatchPlan& plan, const Tensor& map, const ops::Context& ctx);
// permuted_x [R, H] = x rows; permuted_probs [R] = probs entries, per the plan (one fused pass).
void permute_tokens(Tensor& permuted_x, Tensor& permuted_probs, const Tensor& x, const Tensor& probs,
                    const DispatchPlan& plan, const ops::Context& ctx);
// y [T, H] f32 = per-token sum of rows (accumulate=false) or y += (accumulate=true); rows any float dtype.
void unpermute_tokens(Tensor& y, const Tensor& rows, const DispatchPlan& plan, bool accumulate,
                      const ops::Context& ctx);
// The local dispatch backward: dx [T, H] f32 += per-token sum of drows; dprobs [T, E] f32 written,
// dprobs[t, e] = dprob_rows[token_rows[t, e]] (0 where not routed).
void unpermute_backward(Tensor& dx, Tensor& dprobs, const Tensor& drows, const Tensor& dprob_rows,
                        const DispatchPlan& plan, const ops::Context& ctx);
// rows [>= R, H] (f32, bf16 or f16) = src [T, H] f32 rows per the plan: rows[r] = src[row_token[r]].
void gather_token_rows(Tensor& rows, const Tensor& src, const DispatchPlan& plan, const ops::Context& ctx);

}  // namespace moecore::moe
