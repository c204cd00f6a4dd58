// The GPT decoder as a composition of its parts, each in its own file:
//   parallel_layout.h  which ranks hold what (ModelParallel, the pipeline split, this stage's chunks, layout checks)
//   param_specs.h      the parameter table (name, shape, shard, init, role) from the configuration alone
//   param_store.h      this rank's parameters, allocated and initialised from the table
//   model_dims.h       the dims every layer reads
//   decoder_layer.h    one transformer layer from its spec (attention: standard or MLA; MLP: dense or MoE), bound to
//                      its parameters by role
//   mtp_heads.h        the multi-token-prediction depths
//   recompute_plan.h   what full or selective recompute drops, shares and refills
// GptModel holds them, the embeddings and loss heads, the activation slots for one micro-batch shape (a slot per
// micro-batch in flight) and runs explicit forward/backward over the whole model or one pipeline stage of it. Shapes
// are fixed at construction (micro_batch_size x seq_length): every buffer is allocated then, and the step loop
// allocates nothing. Not here: the optimizer (optim/) and the training loop (train/).
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/param.h"
#include "moecore/model/config.h"
#include "moecore/model/decoder_layer.h"
#include "moecore/model/mtp_heads.h"
#include "moecore/model/parallel_layout.h"
#include "moecore/model/param_specs.h"
#include "moecore/model/param_store.h"
#include "moecore/model/recompute_plan.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/nn/dense_layer.h"
#include "moecore/nn/fp8_delayed.h"
#include "moecore/nn/lm_head.h"
#include "moecore/nn/mla.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"

namespace moecore::model {

struct LossResult {
  double loss_sum = 0;  // summed cross-entropy over counted tokens
  int64_t tokens = 0;   // labels >= 0
  double mean() const { return tokens ? loss_sum / static_cast<double>(tokens) : 0.0; }
  // Per MTP depth (forward_backward only): the cross-entropy over its rolled labels, as Megatron's "mtp_k loss".
  std::vector<double> mtp_loss_sum;
  std::vector<int64_t> mtp_tokens;
  double mtp_mean(size_t depth) const {
    return mtp_tokens[depth] ? mtp_loss_sum[depth] / static_cast<double>(mtp_tokens[depth]) : 0.0;
  }
};

// Bytes by memory category: parameters and the model's own buffers by their tensors; the layers' caches and the
// shared workspaces by the buffer plans that allocate them (core/buffer_plan.h: each buffer listed once).
struct MemoryPlan {
  int64_t bytes[kNumMemCategories] = {};
  int64_t total() const;
  std::string format() const;  // a printable table
};

// A micro-batch's activation slot in one model chunk (GptModel::set_micro_batch_slots).
struct Slot {
  Slot(int64_t i = 0, int64_t c = 0) : index(i), chunk(c) {}  // NOLINT: a bare index is slot i of chunk 0
  int64_t index, chunk;
};

class GptModel {
 public:
  // Initialises every parameter from (seed, name): N(0, std^2) for weights, with Megatron's scaled init
  // std / sqrt(2 * num_layers) for the output projections of each block; norm weights 1, norm biases 0.
  // device: where every parameter, gradient and activation lives (the ops' context device). Initial values
  // do not depend on it.
  GptModel(const ModelConfig& cfg, int64_t micro_batch_size, uint64_t seed, const ModelParallel& parallel = {},
           Device device = Device::cpu);
  Device device() const { return device_; }
  int64_t ep_size() const { return par_.ep.size(); }
  int64_t ep_rank() const { return par_.ep.rank(); }
  int64_t etp_size() const { return par_.etp.size(); }
  int64_t tp_size() const { return par_.tp.size(); }
  int64_t cp_size() const { return par_.cp.size(); }
  const ModelParallel& parallel() const { return par_; }
  // This pipeline stage's model chunks (ModelParallel::virtual_stages; one at PP 1 and without interleaving): chunk c
  // holds the decoder layers [chunk_layers(c).first, chunk_layers(c).second); chunk 0 of the first stage holds the
  // embeddings (pre_process), the last chunk of the last stage the loss heads (post_process).
  int64_t num_chunks() const { return static_cast<int64_t>(stage_.chunks.size()); }
  std::pair<int64_t, int64_t> chunk_layers(int64_t chunk) const { return stage_.chunks.at(static_cast<size_t>(chunk)); }
  bool pre_process(int64_t chunk) const { return holds_embeddings() && chunk == 0; }
  bool post_process(int64_t chunk) const { return holds_loss_heads() && chunk + 1 == num_chunks(); }
  // A chunk's exchanges with the neighbouring virtual stages, [N, H] f32 each: a chunk after the first virtual stage
  // takes its input activation in stage_input(slot) before forward(slot); one before the last leaves its output in
  // stage_output(slot) after it and takes dL/d(output) in stage_output_grad(slot) before backward(slot); after backward
  // one after the first leaves dL/d(input) in stage_input_grad(slot) (until the slot's next backward).
  Tensor stage_input(Slot s) { return slot_at(s).residual[static_cast<size_t>(chunk_layers(s.chunk).first)]; }
  Tensor stage_output(Slot s) { return slot_at(s).residual[static_cast<size_t>(chunk_layers(s.chunk).second)]; }
  Tensor stage_output_grad(Slot s) { return slot_at(s).dfinal; }
  Tensor stage_input_grad(Slot s) { return slot_at(s).dinput; }
  // The parameter the first and the last stage both hold (the word embeddings, when the last holds a copy): its
  // gradient is the sum of both stages' (the training step exchanges them). Its index in params(), or -1 (PP 1, or a
  // stage that holds no such parameter, or a model without the copy).
  int64_t pipeline_shared_param() const { return store_.pipeline_shared(); }

  const ModelConfig& config() const { return cfg_; }
  int64_t micro_batch_size() const { return B_; }
  std::vector<Param>& params() { return store_.params(); }
  const std::vector<Param>& params() const { return store_.params(); }
  Param& param(const std::string& name);  // throws Error when absent
  int64_t num_parameters() const;
  // The initial values of elements [lo, lo + dst.numel()) of params()[i] (flattened), as the constructor draws them:
  // Megatron-FSDP's shards of the parameters born without memory (ModelParallel::fsdp_params).
  void initial_values(size_t i, int64_t lo, Tensor& dst) const { store_.initial_values(i, lo, dst); }

  void zero_grad();  // (released gradients, set_grads_needed, are zeroed when taken again)
  // Sums the gradients of the Param::tp_grad_sum parameters among params()[first, end) (default: all) over the
  // tensor-parallel group (Megatron's finalize_model_grads): once per step after the last micro-batch, before the
  // data-parallel reduction. Collective over the TP group; nothing without TP.
  void sum_tensor_parallel_grads(size_t first = 0, size_t end = SIZE_MAX);

  // Backward's progress, for overlapping the gradient reduction with it (--overlap-grad-reduce): while set,
  // forward_backward calls fn(first, end) each time it has finished adding to the gradients of params()[first, end)
  // -- each MTP depth, the output layer, the final norm, each layer from the last, then the embeddings -- so that
  // every parameter is named exactly once per call. An empty function: no calls.
  using ParamRangeFn = std::function<void(size_t first, size_t end)>;
  void set_grad_ready(ParamRangeFn fn) { grad_ready_ = std::move(fn); }
  // Forward's progress, for overlapping the distributed optimizer's parameter all-gather with it
  // (--overlap-param-gather) and for Megatron-FSDP's gathers: while set, every forward (forward_backward, evaluate,
  // forward_logits) calls fn(first, end) before it first reads params()[first, end) -- the embeddings, each decoder
  // layer, the final norm, each MTP depth, the output layer -- and backward before it reads a decoder layer or MTP
  // depth again (its recompute, then its backward), so fn can make their values (and compute copies) current just in
  // time.
  void set_params_needed(ParamRangeFn fn) { params_needed_ = std::move(fn); }
  // Megatron-FSDP's units, a decoder layer or an MTP depth each (fsdp_units): while set, fn(first, end) after a
  // forward, a recompute or a backward of the unit has read its parameters for the last time in that pass (they may be
  // released until the next params_needed of the range).
  void set_params_released(ParamRangeFn fn) { params_released_ = std::move(fn); }
  // While set, fn(first, end) before a backward first adds to the gradients of a unit (they may be released between
  // its grad_ready and this call; fn makes them resident and zero). The gradients outside the units stay resident.
  void set_grads_needed(ParamRangeFn fn) { grads_needed_ = std::move(fn); }
  // The params() ranges [first, end) of this stage's units, in params() order: each local decoder layer, then each
  // MTP depth (with its own norms and eh_proj). The rest (embeddings, final norm, output layer) belongs to none.
  std::vector<std::pair<size_t, size_t>> fsdp_units() const;
  // Once per optimizer step, after the update: expert-bias updates and MoE counter resets. A skipped step
  // (non-finite gradients) passes update=false: counters reset, expert biases untouched.
  void finish_step(bool update = true);
  // Router statistics of layer l of the last forward through its chunk; nullptr for dense layers and other stages'.
  const moe::RouterStats* moe_stats(int64_t layer) const;
  // MoE ECHO's plan of layer l in the last forward through its chunk, as a host snapshot; nullopt without ECHO, for
  // dense layers and other stages'.
  std::optional<moe::EchoStatsHost> moe_echo_stats(int64_t layer) const;
  // The static received-token capacity (--moe-received-token-capacity): whether an MoE layer's forward on this rank
  // overflowed it since the last call (the flag then resets). Always false without the capacity.
  bool take_moe_overflow();
  bool moe_static_capacity() const { return cfg_.moe.enabled() && cfg_.moe.received_token_capacity > 0; }
  // The MoE layers' buffers for every received row (on: the synced dropless path a retry runs on) or at the static
  // capacity (off). Reallocates every activation slot (the slot counts kept); no-op when already so.
  void set_moe_synced_dropless(bool on);
  bool moe_synced_dropless() const { return moe_synced_; }
  bool is_moe_layer(int64_t layer) const { return local_moe(static_cast<size_t>(layer)); }  // (this stage's)
  int64_t chunk_of_layer(int64_t layer) const {
    return stage_.layer_chunk.at(static_cast<size_t>(layer));
  }  // -1: not here
  // Delayed scaling's state of the FP8 quantizers (nn/fp8_delayed.h; checkpoints); null unless --fp8-recipe delayed.
  nn::Fp8Delayed* fp8_delayed() { return fp8_ ? fp8_->delayed() : nullptr; }
  const nn::Fp8Delayed* fp8_delayed() const { return fp8_ ? fp8_->delayed() : nullptr; }
  // Whether the linear named `name` (its layer's parameter prefix + module name) is on this pipeline stage.
  bool holds_linear(std::string_view name) const;
  moe::RouterState* router_state(int64_t layer);  // nullptr for dense layers
  const moe::RouterState* router_state(int64_t layer) const;
  // After the masters change (optimizer step, loading): the compute copies of params()[first, end) (default: all);
  // a parameter whose value is released (set_params_released) is refreshed when it is gathered again.
  void refresh_compute_weights(size_t first = 0, size_t end = SIZE_MAX);
  // Seconds the MoE token dispatcher spent in collectives since the last reset (0 without EP).
  double dispatcher_comm_seconds() const { return sh_.dispatcher->comm_seconds(); }
  void reset_dispatcher_comm_seconds() { sh_.dispatcher->reset_comm_seconds(); }
  // "all-to-all", "all-gather" or "local" (for log lines).
  const char* dispatcher_name() const;

  // Keys the dropout masks of the next forward_backward (counter-based: a mask depends only on the seed, the
  // optimizer step, the micro-batch's global index within the step, the layer and the site). The trainer sets
  // it before every micro-batch, so resumed and multi-rank runs draw the same masks as one uninterrupted rank.
  void set_dropout_step(int64_t iteration, int64_t micro_batch) {
    dropout_iteration_ = iteration;
    dropout_micro_batch_ = micro_batch;
  }

  // Megatron's --calculate-per-token-loss (see forward): the loss heads' gradients are of their sums over the counted
  // tokens, the normalisation by the global batch's count is the step's.
  void set_calculate_per_token_loss(bool on) { per_token_loss_ = on; }
  bool calculate_per_token_loss() const { return per_token_loss_; }

  // Micro-batches in flight (pipeline schedules): each slot of a model chunk holds one micro-batch's activations of
  // that chunk from its forward to its backward -- the chunk's layers' caches, its residual stream, the final norm's
  // statistics, the dropout masks' keys, the token ids and the gradients at its ends. The model is built with one slot
  // per chunk; set_micro_batch_slots sizes each chunk's pool for a schedule (one count per chunk; memory_plan counts
  // every slot). The shared workspaces (scratch of one forward or backward at a time) stay single.
  void set_micro_batch_slots(const std::vector<int64_t>& per_chunk);
  int64_t micro_batch_slots(int64_t chunk = 0) const {
    return static_cast<int64_t>(slots_.at(static_cast<size_t>(chunk)).size());
  }

  // tokens, labels [B, seq_length] i32 (label < 0: not counted), the batch as the data loader hands it over (host
  // memory; a device batch is copied to the host first): the counted tokens and the MTP depths' rolled ids and labels
  // are prepared there, then uploaded. forward(slot) runs the slot's chunk of the decoder into it and, in the last
  // chunk, the loss heads (the output layer and every MTP depth) with their backward down to the decoder's output: the
  // heads' gradient is taken at once, so no slot keeps logits. backward(slot) runs the rest: the final norm, the
  // chunk's decoder layers and, in the first chunk, the embeddings. Together they add grad_scale * d(mean
  // loss)/d(param) to every gradient (the MoE auxiliary losses' times grad_scale); forward returns the loss (the loss
  // totals are read back once per loss head: the step's host synchronisation for logging). The mean is over this
  // micro-batch's counted tokens. With per-token loss (set_calculate_per_token_loss) the loss heads' sums take the
  // place of their means (an MTP depth's reweighted by the main head's counted tokens over its own, Megatron's rule)
  // and the auxiliary losses are taken times grad_scale x B x S: the step then divides every gradient by the global
  // batch's counted tokens (train/step.h). Under context parallelism every rank of the group passes the whole batch and
  // takes its positions; the loss and its token count are the group's (summed over it), and this rank's gradients are
  // its share of the group's (the data-parallel reduction sums them over DP x CP). Slots are independent: forwards of
  // several slots may precede their backwards in any order.
  LossResult forward(Slot slot, const Tensor& tokens, const Tensor& labels, float grad_scale);
  void backward(Slot slot, float grad_scale);
  // One micro-batch in slot 0: forward, then backward.
  LossResult forward_backward(const Tensor& tokens, const Tensor& labels, float grad_scale) {
    LossResult r = forward(0, tokens, labels, grad_scale);
    backward(0, grad_scale);
    return r;
  }
  // The loss without gradients (slot 0 of each chunk). On a pipeline the batch goes through every stage (collective
  // over pp) and only the last stage returns the loss (the others an empty result).
  LossResult evaluate(const Tensor& tokens, const Tensor& labels);
  // logits [B*S, V] f32 for the given tokens (generation, tests); under CP collective over the group. On a pipeline
  // the batch goes through every stage (collective over pp) and only the last stage's logits are written.
  void forward_logits(Tensor& logits, const Tensor& tokens);

  // The bytes of optimizer state per element of a parameter (AdamW's two moments; Muon's momentum for its matrices).
  using StateBytesPerElement = std::function<int64_t(const Param&)>;
  static int64_t no_optimizer_state(const Param&) { return 0; }  // (the plan of the model's own buffers alone)
  // The plan for this model's own buffers plus the optimizer's state of every parameter.
  MemoryPlan memory_plan(const StateBytesPerElement& optimizer_state) const;
  // The same plan for GptModel(cfg, micro_batch_size, any seed, parallel, any device) with `slots` micro-batch slots
  // per chunk (set_micro_batch_slots; empty: one each), before anything is allocated: that model built on
  // Device::meta (shapes without memory) and counted. (No buffer's shape depends on the device.)
  static MemoryPlan plan_memory(const ModelConfig& cfg, int64_t micro_batch_size, const ModelParallel& parallel,
                                const std::vector<int64_t>& slots, const StateBytesPerElement& optimizer_state);
  // Model FLOPs of one forward+backward over B*S tokens (Megatron's formula: 3x forward GEMMs and
  // causal attention counted at full S^2 as Megatron does), whatever the layout: the TP ranks share one micro-batch's.
  double flops_per_step() const;

 private:
  // [B * seq_length] host -> this CP rank's [B*S] (S = seq_length / CP) in out (the batch itself at CP 1)
  Tensor local_positions(const Tensor& batch_h, const Tensor& out) const;
  bool tensor_parallel() const { return par_.tp.size() > 1; }
  int64_t vocab_start() const;  // the first vocabulary id of this rank's embedding / output rows
  void embed(Tensor& out, const Tensor& ids, const ops::Context& ctx);
  void embed_backward(const Tensor& dx, const Tensor& ids, const ops::Context& ctx);
  const Tensor& head_input() const { return par_.sequence_parallel ? final_full_ : final_h_; }
  const ProcessGroup* head_group() const { return tensor_parallel() ? &par_.tp : nullptr; }  // vocab-parallel head
  nn::Linear output_linear() const;           // the output layer's GEMMs: FP8 (MXFP8) with --fp8-output-proj
  Tensor by_sequence(const Tensor& t) const;  // [rows, H] as [B, rows / B, H]
  void forward_trunk(const Tensor& tokens, bool training);
  void forward_stages(const Tensor& tokens);  // forward_trunk of every chunk in pipeline order, without gradients
  void set_dropout_keys(bool training);
  // recompute: a backward's refill of the layer's caches (MoE layers keep their routing)
  void layer_forward(size_t layer, const Tensor& x, Tensor& y, bool training, const ops::Context& ctx,
                     bool recompute = false);
  void layer_backward(size_t layer, const Tensor& x, float grad_scale, const ops::Context& ctx);
  // Delayed scaling: the pass that runs (slot: its activation slot), and after a training pass the amax reduction over
  // TP x DP x CP and the update of its slots.
  void fp8_begin(nn::Fp8Delayed::Pass pass, int64_t slot = 0);
  void fp8_update(bool forward);
  void point_shared_at_this();
  void bind_parameters();  // every module's views of its parameters, by role
  void alloc_tables();     // the RoPE table and positions of this rank's rows
  void alloc_workspaces();
  void mtp_forward(const Tensor& tokens, const Tensor& labels, bool training, const ops::Context& ctx);
  double read_loss_sum() const;  // the last lm_head_loss's sum, read back from the device
  void mtp_backward(LossResult& r, float grad_scale, const ops::Context& ctx);

  ModelConfig cfg_;
  std::unique_ptr<nn::Fp8Training> fp8_;  // FP8 training (null: off), what the FP8 linears point at
  int64_t B_;
  Device device_ = Device::cpu;
  LayerShared sh_;                    // what every layer reads: dims, workspaces, the dispatcher
  std::vector<DecoderLayer> layers_;  // decoder layers, then one per MTP depth (another stage's: bound to nothing)
  bool standard_attention_ = true;    // some layer has standard attention (the shared workspace holds its buffers)
  ParamStore store_;
  uint64_t seed_;
  int64_t dropout_iteration_ = 0, dropout_micro_batch_ = 0;
  bool per_token_loss_ = false;
  Param* embedding_ = nullptr;
  Param* position_embedding_ = nullptr;  // learned absolute positions only
  Param* final_norm_ = nullptr;
  Param* final_norm_bias_ = nullptr;  // LayerNorm only
  Param* output_ = nullptr;           // the embedding when tied
  // One micro-batch's activations, kept from its forward to its backward (set_micro_batch_slots).
  struct Activations {
    std::vector<LayerCache> layers;  // per layer (decoder, then MTP); another chunk's: empty (MoE scratch: shared)
    ops::Dropout embedding_drop;
    std::vector<Tensor> residual;   // L+1 tensors [N, H] f32: embedding output, then each layer's output
    Tensor final_mean, final_rstd;  // [N] f32 (mean: LayerNorm only)
    Tensor ids;                     // [T] i32: the token ids (the embeddings' backward reads them)
    Tensor dfinal;  // [N, H] f32: dL/d(final norm output) from the loss heads, or of the chunk's output (received)
    Tensor dinput;  // [N, H] f32: dL/d(the chunk's input), sent to the previous virtual stage (not the first's)
  };
  Activations alloc_activations(int64_t chunk) const;
  const moe::MoeLayerCache* moe_scratch_donor() const;  // the MoE cache whose scratch the others share (or null)
  RecomputePlan plan_;                                  // what recompute drops, shares and refills
  bool holds_embeddings() const { return stage_.first_stage; }
  bool holds_loss_heads() const { return stage_.last_stage; }
  StageLayout stage_;  // this rank's model chunks and where each layer is
  bool local_layer(size_t l) const { return stage_.layer_chunk[l] >= 0; }
  bool local_moe(size_t l) const { return local_layer(l) && layers_[l].moe(); }
  size_t chunk_ = 0;  // the chunk the running (or last) forward or backward works on
  size_t first_layer() const { return static_cast<size_t>(stage_.chunks[chunk_].first); }  // of chunk_
  size_t end_layer() const { return static_cast<size_t>(stage_.chunks[chunk_].second); }
  void use_slot(Slot s);         // checked; sets chunk_ and the chunk's current slot
  Activations& slot_at(Slot s);  // checked
  Activations& act() { return slots_[chunk_][slot_[chunk_]]; }
  std::vector<std::vector<Activations>> slots_;  // per chunk, per slot
  std::vector<size_t> slot_;                     // per chunk: the slot its running (or last) pass works on
  bool moe_overflow_ = false;                    // an MoE forward overflowed the received-token capacity
  bool moe_synced_ = false;                      // set_moe_synced_dropless(true) is in force
  MtpHeads mtp_;  // the last stage's MTP depths (their transformer layers are layers_[num_layers + depth])
  ModelParallel par_;
  ParamRangeFn grad_ready_, params_needed_, params_released_, grads_needed_;
  // params() index ranges [first, end) for the backward-order notifications: per layer (decoder layers, then each MTP
  // depth with its own norms and eh_proj), the final norm, the output layer (empty when tied), and the embeddings.
  std::vector<std::pair<size_t, size_t>> layer_params_;
  std::pair<size_t, size_t> final_norm_params_{0, 0}, output_params_{0, 0}, embedding_params_{0, 0};
  void grad_ready(std::pair<size_t, size_t> r) const {
    if (grad_ready_ && r.first < r.second) grad_ready_(r.first, r.second);
  }
  void params_needed(std::pair<size_t, size_t> r) const {
    if (params_needed_ && r.first < r.second) params_needed_(r.first, r.second);
  }
  void params_released(std::pair<size_t, size_t> r) const {
    if (params_released_ && r.first < r.second) params_released_(r.first, r.second);
  }
  void grads_needed(std::pair<size_t, size_t> r) const {
    if (grads_needed_ && r.first < r.second) grads_needed_(r.first, r.second);
  }
  Tensor final_h_;          // [N, H] compute: the final norm's output (N: this rank's rows under sequence parallelism)
  Tensor final_full_;       // [T, H] compute: final_h_ all-gathered (sequence parallelism only)
  Tensor positions_;        // [T] i32: position of each token (learned absolute positions only)
  Tensor positions_local_;  // [N] i32: those of this rank's rows (sequence parallelism only)
  nn::LmHeadWorkspace head_ws_;
  Tensor labels_;                     // [T] i32 flat copy
  Tensor cp_tokens_h_, cp_labels_h_;  // [T] i32 host: this CP rank's positions of the batch (CP > 1 only)
};

}  // namespace moecore::model
