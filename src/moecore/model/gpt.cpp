// GPT decoder assembly from its specs: parameters, initialisation, per-layer modules, and the step's forward/backward
// sequence (decoder layers, then the multi-token-prediction depths).
#include "moecore/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "moecore/core/rng.h"
#include "moecore/kernels/common/fp8.h"
#include "moecore/model/model_dims.h"
#include "moecore/model/mtp_heads.h"
#include "moecore/model/param_specs.h"
#include "moecore/model/rope_table.h"
#include "moecore/nn/norm.h"

namespace moecore::model {

namespace {

// The MoE token dispatcher of the layout (--moe-token-dispatcher-type; the local one without EP and ETP).
std::unique_ptr<moe::Dispatcher> make_dispatcher(const ModelParallel& par) {
  const int64_t EP = par.ep.size(), ETP = par.etp.size();
  if (EP * ETP > 1 && par.dispatcher == moe::DispatcherKind::alltoall)
    return std::make_unique<moe::AllToAllDispatcher>(par.ep, par.etp);
  if (EP * ETP > 1) return std::make_unique<moe::AllGatherDispatcher>(ETP > 1 ? par.etp_ep : par.ep, ETP);
  return std::make_unique<moe::LocalDispatcher>();
}

}  // namespace

int64_t MemoryPlan::total() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

std::string MemoryPlan::format() const {
  std::string s = "memory plan:\n";
  for (int c = 0; c < kNumMemCategories; ++c) {
    if (!bytes[c]) continue;
    char line[96];
    std::snprintf(line, sizeof line, "  %-16s %12s\n", mem_category_name(static_cast<MemCategory>(c)),
                  memory_format_bytes(bytes[c]).c_str());
    s += line;
  }
  char line[96];
  std::snprintf(line, sizeof line, "  %-16s %12s\n", "total", memory_format_bytes(total()).c_str());
  return s + line;
}

// This rank's positions of every sequence of a host batch [B*S] (rows b * S/CP + s: position
// context_parallel_position(s)), written into out (host [B*S/CP]); the batch itself without CP.
Tensor GptModel::local_positions(const Tensor& batch_h, const Tensor& out) const {
  const int CP = par_.cp.size();
  if (CP == 1) return batch_h;
  const int64_t S = cfg_.seq_length, Sl = S / CP;
  const int32_t* src = batch_h.data<int32_t>();
  int32_t* dst = out.data<int32_t>();
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t s = 0; s < Sl; ++s)
      dst[b * Sl + s] = src[b * S + nn::context_parallel_position(s, S, par_.cp.rank(), CP)];
  return out;
}

GptModel::GptModel(const ModelConfig& cfg, int64_t micro_batch_size, uint64_t seed, const ModelParallel& parallel,
                   Device device)
    : cfg_(cfg), B_(micro_batch_size), device_(device), seed_(seed), par_(parallel) {
  cfg_.validate();
  if (cfg_.fp8.on) fp8_ = std::make_unique<nn::Fp8Training>(cfg_.fp8);
  if (B_ <= 0) MOECORE_FAIL("model: micro_batch_size (", B_, ") must be positive");
  stage_ = check_layout(cfg_, par_);
  slot_.assign(stage_.chunks.size(), 0);
  const ModelDims dims = model_dims(cfg_, par_, B_, seed_, device_);
  sh_.dims = dims.dense;
  sh_.mla_dims = dims.mla;
  sh_.moe_dims = dims.moe;
  point_shared_at_this();
  sh_.dispatcher = make_dispatcher(par_);
  store_ = ParamStore(cfg_, par_, seed_, device_);
  for (const LayerSpec& spec : layer_specs(cfg_)) layers_.emplace_back(spec);
  standard_attention_ = std::any_of(layers_.begin(), layers_.end(), [](const DecoderLayer& l) { return !l.mla(); });
  bind_parameters();
  if (holds_loss_heads()) mtp_ = MtpHeads(store_, cfg_, sh_.dims, B_, device_, fp8_.get());
  plan_ = RecomputePlan(cfg_, sh_, layers_, stage_);
  slots_.resize(stage_.chunks.size());
  for (size_t c = 0; c < stage_.chunks.size(); ++c) slots_[c].push_back(alloc_activations(static_cast<int64_t>(c)));
  alloc_tables();
  alloc_workspaces();
  refresh_compute_weights();
}

// The shared dims' pointers into this object (its configuration and groups), set again before each use that may follow
// a move of the model.
void GptModel::point_shared_at_this() {
  sh_.moe = &cfg_.moe;
  sh_.fp8 = fp8_.get();
  sh_.moe_dims.global_aux_group = &par_.dp;
  sh_.moe_dims.sequence_group = moe_sequence_group(par_);
  if (sh_.moe_dims.echo.group) sh_.moe_dims.echo.group = &par_.ep;
  sh_.dims.tp = &par_.tp;
  if (sh_.dims.cp) sh_.dims.cp = &par_.cp;
}

// The modules' views of their parameters (by role), the model's own parameters, the routers' states and the
// backward-order groups of parameters (set_grad_ready: each a contiguous run of the table).
void GptModel::bind_parameters() {
  using enum ParamRole;
  for (size_t i = 0; i < store_.size(); ++i)
    if (layer_role(store_.spec(i).role))
      layers_[static_cast<size_t>(store_.spec(i).layer)].bind(store_.spec(i), store_.params()[i]);
  for (size_t l = 0; l < layers_.size(); ++l)
    if (local_moe(l))  // its noise stream; under sequence parallelism each TP rank's tokens draw from their own
      layers_[l].init_router(cfg_.moe, device_,
                             l + (par_.sequence_parallel ? (uint64_t{1} << 32) * par_.tp.rank() : 0));
  embedding_ = store_.find(word_embeddings);
  position_embedding_ = store_.find(position_embeddings);
  final_norm_ = store_.find(final_norm);
  final_norm_bias_ = store_.find(final_norm_bias);
  output_ = cfg_.untie_embeddings_and_output_weights ? store_.find(output_layer) : embedding_;
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l)
    layer_params_.push_back(store_.range([l](const ParamSpec& s) { return s.layer == l; }));
  final_norm_params_ =
      store_.range([](const ParamSpec& s) { return s.role == final_norm || s.role == final_norm_bias; });
  output_params_ = store_.range([](const ParamSpec& s) { return s.role == output_layer; });
  embedding_params_ =
      store_.range([](const ParamSpec& s) { return s.role == word_embeddings || s.role == position_embeddings; });
}

// Constant tables, computed on the host and uploaded once: the RoPE rotations and the learned positions of this rank's
// rows. The global position of this rank's position s of a sequence: context parallelism's two chunks.
void GptModel::alloc_tables() {
  const int CP = par_.cp.size();
  const int64_t S = cfg_.seq_length / CP, T = sh_.dims.tokens(), N = sh_.dims.N;
  if (CP > 1)
    for (Tensor* t : {&cp_tokens_h_, &cp_labels_h_}) *t = Tensor::empty({T}, DType::i32, MemCategory::workspace);
  const auto position = [&](int64_t s) {
    return CP > 1 ? nn::context_parallel_position(s, cfg_.seq_length, par_.cp.rank(), CP) : s;
  };
  if (cfg_.rope()) {  // row s: the rotation of position(s)
    Tensor rope = Tensor::empty({cfg_.seq_length, cfg_.rotary_dim()}, DType::f32, MemCategory::workspace);
    fill_rope_table(rope, cfg_);
    Tensor local = Tensor::empty({S, cfg_.rotary_dim()}, DType::f32, MemCategory::workspace);
    for (int64_t s = 0; s < S; ++s) local.slice(0, s, s + 1).copy_from(rope.slice(0, position(s), position(s) + 1));
    sh_.rope = local.to_device(device_, MemCategory::workspace);
  }
  if (!position_embedding_) return;
  // token b*S + s sits at position(s) (positions restart with each sample)
  Tensor positions = Tensor::empty({T}, DType::i32, MemCategory::workspace);
  int32_t* pos = positions.data<int32_t>();
  for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(position(i % S));
  positions_ = positions.to_device(device_, MemCategory::workspace);
  if (par_.sequence_parallel) {  // this rank's rows b * S/P + s hold positions position(rank * S/P + s)
    Tensor local = Tensor::empty({N}, DType::i32, MemCategory::workspace);
    int32_t* lp = local.data<int32_t>();
    const int64_t Sl = S / par_.tp.size();
    for (int64_t i = 0; i < N; ++i) lp[i] = static_cast<int32_t>(position(par_.tp.rank() * Sl + i % Sl));
    positions_local_ = local.to_device(device_, MemCategory::workspace);
  }
}

// The workspaces every layer and the loss heads share (one set for every slot).
void GptModel::alloc_workspaces() {
  const int64_t H = cfg_.hidden_size, N = sh_.dims.N, T = sh_.dims.tokens(), P = par_.tp.size();
  const DType c = cfg_.compute_dtype;
  auto work = [&](Shape shape, DType t) { return Tensor::empty(shape, t, MemCategory::workspace, device_); };
  // The final norm's output is read by the loss heads within forward.
  final_h_ = work({N, H}, c);
  if (par_.sequence_parallel) final_full_ = work({T, H}, c);
  sh_.ws = nn::dense_layer_workspace_alloc(sh_.dims, /*with_attention=*/standard_attention_);
  if (cfg_.multi_latent_attention) sh_.mla_ws = nn::mla_workspace_alloc(sh_.mla_dims, c, device_);
  if (holds_loss_heads()) head_ws_ = nn::lm_head_workspace_alloc(T, cfg_.vocab_size / P, c, device_, P);
  sh_.dres = work({N, H}, DType::f32);
  if (cfg_.moe.enabled()) {
    sh_.moe_x = work({N, H}, c);
    sh_.moe_out = work({N, H}, DType::f32);
  }
  sh_.dh = work({T, H}, DType::f32);
  labels_ = work({T}, DType::i32);
}

// The MoE cache that owns the scratch every other MoE cache shares (dead between a layer's forward and its backward,
// so dead between micro-batches too): the first shared recompute set's, else the first slot's first MoE layer's.
const moe::MoeLayerCache* GptModel::moe_scratch_donor() const {
  if (const moe::MoeLayerCache* c = plan_.scratch_donor()) return c;
  for (const auto& chunk : slots_)
    for (const Activations& a : chunk)
      for (const LayerCache& c : a.layers)
        if (c.moe.probs.defined()) return &c.moe;
  return nullptr;
}

// One slot's buffers of a model chunk: every layer's cache of the chunk by its kind (a recomputed layer's: the shared
// set of its group position).
GptModel::Activations GptModel::alloc_activations(int64_t chunk) const {
  const int64_t N = sh_.dims.N, H = cfg_.hidden_size, T = B_ * (cfg_.seq_length / par_.cp.size());
  auto act = [&](Shape shape, DType t) { return Tensor::empty(shape, t, MemCategory::activations, device_); };
  const moe::MoeLayerCache* donor = moe_scratch_donor();
  Activations a;
  a.layers.resize(layers_.size());  // (sized once: the donor may point into it)
  for (size_t l = 0; l < layers_.size(); ++l)
    if (stage_.layer_chunk[l] == chunk) plan_.fill_cache(l, a.layers[l], sh_, donor);
  const auto [first, end] = chunk_layers(chunk);
  a.residual.resize(static_cast<size_t>(cfg_.num_layers + 1));  // [first, end] of the chunk
  for (int64_t l = first; l <= end; ++l) a.residual[static_cast<size_t>(l)] = act({N, H}, DType::f32);
  if (post_process(chunk)) {
    a.final_rstd = act({N}, DType::f32);
    if (sh_.dims.layernorm) a.final_mean = act({N}, DType::f32);
  }
  if (pre_process(chunk))
    a.ids = act({T}, DType::i32);
  else if (par_.pp.size() > 1)
    a.dinput = act({N, H}, DType::f32);
  a.dfinal = act({N, H}, DType::f32);
  return a;
}

void GptModel::set_micro_batch_slots(const std::vector<int64_t>& per_chunk) {
  point_shared_at_this();
  if (per_chunk.size() != stage_.chunks.size())
    MOECORE_FAIL("model: micro-batch slots given for ", per_chunk.size(), " model chunks, the stage has ",
                 stage_.chunks.size());
  for (size_t c = 0; c < stage_.chunks.size(); ++c) {
    const int64_t n = per_chunk[c];
    if (n < 1) MOECORE_FAIL("model: micro-batch slots (", n, ") must be at least 1");
    std::vector<Activations>& pool = slots_[c];
    pool.reserve(static_cast<size_t>(n));  // (the MoE scratch donor lives in the first slot of chunk 0: kept)
    while (static_cast<int64_t>(pool.size()) < n) pool.push_back(alloc_activations(static_cast<int64_t>(c)));
    if (static_cast<int64_t>(pool.size()) > n) pool.erase(pool.begin() + n, pool.end());
    slot_[c] = 0;
  }
}

bool GptModel::take_moe_overflow() {
  const bool o = moe_overflow_;
  moe_overflow_ = false;
  return o;
}

void GptModel::set_moe_synced_dropless(bool on) {
  if (!moe_static_capacity() || on == moe_synced_) return;
  point_shared_at_this();
  moe_synced_ = on;
  sh_.moe_dims.received_capacity = on ? 0.0f : cfg_.moe.received_token_capacity;
  std::vector<size_t> slots(stage_.chunks.size());
  for (size_t c = 0; c < stage_.chunks.size(); ++c) slots[c] = slots_[c].size();
  // Free the old buffers first (the scratch donor lives among them), then plan and allocate as at construction.
  slots_.assign(stage_.chunks.size(), {});
  plan_ = RecomputePlan();
  plan_ = RecomputePlan(cfg_, sh_, layers_, stage_);
  for (size_t c = 0; c < stage_.chunks.size(); ++c) {
    slots_[c].reserve(slots[c]);
    while (slots_[c].size() < slots[c]) slots_[c].push_back(alloc_activations(static_cast<int64_t>(c)));
    slot_[c] = 0;
  }
}

const char* GptModel::dispatcher_name() const {
  return sh_.moe_dims.dispatcher == moe::DispatcherKind::alltoall    ? "all-to-all"
         : sh_.moe_dims.dispatcher == moe::DispatcherKind::allgather ? "all-gather"
                                                                     : "local";
}

void GptModel::finish_step(bool update) {
  if (nn::Fp8Delayed* d = fp8_delayed()) d->new_step();
  for (size_t l = 0; l < layers_.size(); ++l)
    if (local_moe(l)) moe::router_finish_step(*layers_[l].router_state(), cfg_.moe, update, ops::Context{device_});
}

const moe::RouterStats* GptModel::moe_stats(int64_t layer) const {
  const auto l = static_cast<size_t>(layer);
  if (l >= layers_.size() || !local_moe(l)) return nullptr;
  const auto cs = static_cast<size_t>(stage_.layer_chunk[l]);
  return &slots_[cs][slot_[cs]].layers[l].moe.stats;
}

std::optional<moe::EchoStatsHost> GptModel::moe_echo_stats(int64_t layer) const {
  const auto l = static_cast<size_t>(layer);
  if (l >= layers_.size() || !local_moe(l) || !sh_.moe_dims.echo.enabled()) return std::nullopt;
  const auto cs = static_cast<size_t>(stage_.layer_chunk[l]);
  return moe::echo_stats_host(slots_[cs][slot_[cs]].layers[l].moe.echo, layers_[l].moe_weights().experts);
}

moe::RouterState* GptModel::router_state(int64_t layer) {
  const auto l = static_cast<size_t>(layer);
  return local_moe(l) ? layers_.at(l).router_state() : nullptr;
}

const moe::RouterState* GptModel::router_state(int64_t layer) const {
  const auto l = static_cast<size_t>(layer);
  return local_moe(l) ? layers_.at(l).router_state() : nullptr;
}

Param& GptModel::param(const std::string& name) {
  return store_.at(name);
}

int64_t GptModel::num_parameters() const {
  return store_.num_parameters();
}

void GptModel::zero_grad() {
  for (auto& p : store_.params())
    if (p.grad.resident()) p.grad.zero_();
}

std::vector<std::pair<size_t, size_t>> GptModel::fsdp_units() const {
  std::vector<std::pair<size_t, size_t>> units;
  for (const auto& r : layer_params_)
    if (r.first < r.second) units.push_back(r);
  std::sort(units.begin(), units.end());
  return units;
}

void GptModel::sum_tensor_parallel_grads(size_t first, size_t end) {
  if (!tensor_parallel()) return;
  for (size_t i = first; i < std::min(end, store_.params().size()); ++i)
    if (store_.params()[i].tp_grad_sum) all_reduce_sum(store_.params()[i].grad, par_.tp);
}

void GptModel::refresh_compute_weights(size_t first, size_t end) {
  for (size_t i = first; i < std::min(end, store_.params().size()); ++i)
    if (store_.params()[i].value.resident() && !store_.params()[i].compute.same_data(store_.params()[i].value))
      store_.params()[i].compute.copy_from(store_.params()[i].value);
}

// Keys are named "dropout/it<i>/mb<m>/layer<l>/<site>" (formatted on the stack: the step allocates nothing).
void GptModel::set_dropout_keys(bool training) {
  // Under TP a mask over data that differs between the group's ranks (attention probabilities of their heads; with
  // sequence parallelism the hidden dropout of their rows) gets a key of its own per rank, as Megatron's
  // model-parallel RNG tracker; masks over replicated data stay equal on every rank. Under CP every mask gets a key
  // per CP rank.
  const int tp_rank = par_.tp.rank();
  Activations& a = act();
  auto key = [&](float p, int64_t layer, const char* site, bool per_rank) {
    ops::Dropout d;
    if (!training || p <= 0.0f) return d;
    char name[112];
    int n = std::snprintf(name, sizeof name, "dropout/it%lld/mb%lld/layer%lld/%s",
                          static_cast<long long>(dropout_iteration_), static_cast<long long>(dropout_micro_batch_),
                          static_cast<long long>(layer), site);
    if (per_rank && tensor_parallel())
      n += std::snprintf(name + n, sizeof name - static_cast<size_t>(n), "/tp%d", tp_rank);
    if (par_.cp.size() > 1)  // every mask covers this rank's positions alone
      n += std::snprintf(name + n, sizeof name - static_cast<size_t>(n), "/cp%d", par_.cp.rank());
    d.p = p;
    d.key = philox_key(seed_, std::string_view(name, static_cast<size_t>(n)));
    return d;
  };
  const bool sp = par_.sequence_parallel;
  a.embedding_drop = key(cfg_.hidden_dropout, -1, "embedding", sp);
  for (size_t j = 0; j < mtp_.size(); ++j)
    mtp_.depth(j).drop = key(cfg_.hidden_dropout, cfg_.num_layers + static_cast<int64_t>(j), "mtp_embedding", sp);
  for (size_t l = 0; l < a.layers.size(); ++l) {  // the chunk's layers (and the MTP depths' in the last)
    if (stage_.layer_chunk[l] != static_cast<int64_t>(chunk_)) continue;
    const auto i = static_cast<int64_t>(l);
    a.layers[l].drops = {key(cfg_.attention_dropout, i, "attention", true), key(cfg_.hidden_dropout, i, "attn_out", sp),
                         key(cfg_.hidden_dropout, i, "mlp_out", sp)};
  }
}

void GptModel::forward_trunk(const Tensor& tokens, bool training) {
  const ops::Context ctx{device_};
  Activations& a = act();
  const int64_t T = B_ * (cfg_.seq_length / par_.cp.size());
  if (tokens.dtype() != DType::i32 || tokens.numel() != T)
    MOECORE_FAIL("model: tokens must be i32 [", B_, ", ", T / B_, "], got ", tokens.str());
  point_shared_at_this();
  set_dropout_keys(training);
  const auto chunk = static_cast<int64_t>(chunk_);
  // (on the last pipeline stage: the word embeddings' copy)
  if (pre_process(chunk) || post_process(chunk)) params_needed(embedding_params_);
  if (pre_process(chunk)) {  // else the previous virtual stage's output is in stage_input
    a.ids.copy_from(tokens.view({T}));
    Tensor& x0 = a.residual[0];
    embed(x0, a.ids, ctx);
    if (position_embedding_) {
      ops::embedding_forward(sh_.dres, par_.sequence_parallel ? positions_local_ : positions_,
                             position_embedding_->value, ctx);
      ops::add(x0, x0, sh_.dres, ctx);
    }
    if (a.embedding_drop.active()) ops::dropout_forward(x0, x0, a.embedding_drop, ctx);
  }
  for (size_t l = first_layer(); l < end_layer(); ++l) {
    params_needed(layer_params_[l]);
    layer_forward(l, a.residual[l], a.residual[l + 1], training, ctx);
    params_released(layer_params_[l]);
  }
  if (!post_process(chunk)) return;
  params_needed(final_norm_params_);
  params_needed(output_params_);  // (read by every loss head after the trunk; empty when tied)
  nn::norm_forward(final_h_, a.final_mean, a.final_rstd, a.residual.back(), final_norm_->value,
                   final_norm_bias_ ? final_norm_bias_->value : Tensor(), cfg_.norm_epsilon, ctx);
  if (par_.sequence_parallel) all_gather_into(by_sequence(final_full_), by_sequence(final_h_), 1, par_.tp);
}

// out [N, H] f32 (this rank's rows) = the word embeddings of ids [T]. Under TP vocabulary-parallel: each rank's rows,
// summed over the group (reduce-scattered along the sequence under SP).
void GptModel::embed(Tensor& out, const Tensor& ids, const ops::Context& ctx) {
  if (!tensor_parallel()) {
    ops::embedding_forward(out, ids, embedding_->value, ctx);
    return;
  }
  Tensor& part = par_.sequence_parallel ? sh_.ws.dh : out;
  ops::embedding_forward_shard(part, ids, embedding_->value, vocab_start(), cfg_.vocab_size, ctx);
  if (par_.sequence_parallel)
    reduce_scatter_from(by_sequence(out), by_sequence(part), 1, par_.tp);
  else
    all_reduce_sum(out, par_.tp);
}

// Its backward: dtable += the gradient dx [N, H] of this rank's rows (all-gathered into sh_.dh under SP) for ids [T].
void GptModel::embed_backward(const Tensor& dx, const Tensor& ids, const ops::Context& ctx) {
  Tensor dfull = dx;
  if (par_.sequence_parallel) {
    dfull = sh_.dh;
    all_gather_into(by_sequence(dfull), by_sequence(dx), 1, par_.tp);
  }
  if (tensor_parallel())
    ops::embedding_backward_shard(embedding_->grad, ids, dfull, vocab_start(), ctx);
  else
    ops::embedding_backward(embedding_->grad, ids, dfull, ctx);
}

int64_t GptModel::vocab_start() const {
  return tensor_parallel() ? par_.tp.rank() * (cfg_.vocab_size / par_.tp.size()) : 0;
}

Tensor GptModel::by_sequence(const Tensor& t) const {
  return nn::by_sequence(t, B_);
}

// Transformer layer l (a decoder layer, or for l >= num_layers an MTP depth's): y from x, both [N, H] f32.
void GptModel::layer_forward(size_t l, const Tensor& x, Tensor& y, bool training, const ops::Context& ctx,
                             bool recompute) {
  LayerCache& c = act().layers[l];
  layers_[l].forward(x, y, c, sh_, training, ctx, recompute);
  if (layers_[l].moe()) moe_overflow_ = moe_overflow_ || moe::moe_layer_overflowed(c.moe);
}

// sh_.dres: dL/dy on entry, dL/dx on return. Selective recompute refills each half's dropped outputs first (Refill).
void GptModel::layer_backward(size_t l, const Tensor& x, float grad_scale, const ops::Context& ctx) {
  // (per-token loss: the auxiliary losses times the micro-batch's tokens, which the step's division by the global count
  // cancels, Megatron's router rule)
  const float aux_scale = per_token_loss_ ? grad_scale * static_cast<float>(B_ * cfg_.seq_length) : grad_scale;
  layers_[l].backward(x, act().layers[l], sh_, plan_.refill(l), aux_scale, ctx);
}

// The MTP depths in turn (mtp_heads.h), each through the shared embedding and its transformer layer.
void GptModel::mtp_forward(const Tensor& tokens, const Tensor& labels, bool training, const ops::Context& ctx) {
  for (size_t j = 0; j < mtp_.size(); ++j) {
    MtpDepth& d = mtp_.depth(j);
    params_needed(layer_params_[static_cast<size_t>(cfg_.num_layers) + j]);
    mtp_.roll(j, tokens, labels, training);
    d.ids.copy_from(local_positions(d.ids_h, cp_tokens_h_));
    if (training) d.labels.copy_from(local_positions(d.labels_h, cp_labels_h_));
    embed(d.e, d.ids, ctx);
    mtp_.input_forward(j, j ? mtp_.depth(j - 1).h : final_h_, ctx);
    layer_forward(static_cast<size_t>(cfg_.num_layers) + j, d.x, d.y, training, ctx);
    mtp_.output_forward(j, ctx);
    params_released(layer_params_[static_cast<size_t>(cfg_.num_layers) + j]);
  }
}

// The MTP losses and their gradients, deepest depth first: each depth's cross-entropy over its rolled labels is
// weighted mtp_loss_scaling_factor / mtp_num_layers (mean over that depth's counted tokens). Leaves in mtp_.carry()
// the gradient reaching h_0 (the decoder's normed output) through the first depth's hnorm.
void GptModel::mtp_backward(LossResult& r, float grad_scale, const ops::Context& ctx) {
  const int64_t N = B_ * cfg_.seq_length;
  const float weight = cfg_.mtp_loss_scaling_factor / static_cast<float>(mtp_.size());
  r.mtp_loss_sum.assign(mtp_.size(), 0.0);
  r.mtp_tokens.assign(mtp_.size(), 0);
  for (size_t j = mtp_.size(); j-- > 0;) {
    MtpDepth& d = mtp_.depth(j);
    const std::pair<size_t, size_t> unit = layer_params_[static_cast<size_t>(cfg_.num_layers) + j];
    params_needed(unit);
    grads_needed(unit);
    const int32_t* lp = d.labels_h.data<int32_t>();
    for (int64_t i = 0; i < N; ++i) r.mtp_tokens[j] += lp[i] >= 0;
    // (per-token loss: the depth's sum times the main head's count over its own, as Megatron's MTP)
    const float per = per_token_loss_ ? static_cast<float>(r.tokens) : 1.0f;
    const float scale = r.mtp_tokens[j] ? grad_scale * weight * per / static_cast<float>(r.mtp_tokens[j]) : 0.0f;
    if (!par_.sequence_parallel) {
      nn::lm_head_loss(&mtp_.dh(), &output_->grad, d.h, output_->compute, d.labels, scale, head_ws_, ctx, head_group(),
                       /*reduce_dh=*/true, output_linear());
    } else {  // every token's h into the vocabulary-parallel head; its partial gradient reduce-scattered back
      all_gather_into(by_sequence(mtp_.h_full()), by_sequence(d.h), 1, par_.tp);
      nn::lm_head_loss(&sh_.dh, &output_->grad, mtp_.h_full(), output_->compute, d.labels, scale, head_ws_, ctx,
                       head_group(), /*reduce_dh=*/false, output_linear());
      reduce_scatter_from(by_sequence(mtp_.dh()), by_sequence(sh_.dh), 1, par_.tp);
    }
    r.mtp_loss_sum[j] = read_loss_sum();
    if (par_.cp.size() > 1) all_reduce_sum(std::span<double>(&r.mtp_loss_sum[j], 1), par_.cp);
    mtp_.output_backward(j, sh_.dres, ctx);
    layer_backward(static_cast<size_t>(cfg_.num_layers) + j, d.x, grad_scale, ctx);
    mtp_.input_backward(j, sh_.dres, ctx);
    embed_backward(sh_.dres, d.ids, ctx);
    mtp_.hnorm_backward(j, ctx);
    grad_ready(unit);
    params_released(unit);
  }
}

namespace {
// The batch on the host (an explicit transfer when the caller's is on a device), checked: i32 [B*S].
Tensor host_batch(const Tensor& t, const char* what, int64_t B, int64_t S) {
  if (t.dtype() != DType::i32 || t.numel() != B * S)
    MOECORE_FAIL("model: ", what, " must be i32 [", B, ", ", S, "], got ", t.str());
  return t.to_device(Device::cpu).view({B * S});
}
int64_t counted_labels(const Tensor& labels_h) {
  const int32_t* lp = labels_h.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < labels_h.numel(); ++i) n += lp[i] >= 0;
  return n;
}
}  // namespace

double GptModel::read_loss_sum() const {
  double totals[2];
  head_ws_.totals.copy_to_host(totals, 2);
  return totals[0];
}

GptModel::Activations& GptModel::slot_at(Slot s) {
  if (s.chunk < 0 || s.chunk >= num_chunks())
    MOECORE_FAIL("model: model chunk ", s.chunk, " out of range: the stage has ", num_chunks());
  if (s.index < 0 || s.index >= micro_batch_slots(s.chunk))
    MOECORE_FAIL("model: micro-batch slot ", s.index, " out of range: chunk ", s.chunk, " has ",
                 micro_batch_slots(s.chunk), " (set_micro_batch_slots)");
  return slots_[static_cast<size_t>(s.chunk)][static_cast<size_t>(s.index)];
}

void GptModel::use_slot(Slot s) {
  slot_at(s);
  chunk_ = static_cast<size_t>(s.chunk);
  slot_[chunk_] = static_cast<size_t>(s.index);
}

LossResult GptModel::forward(Slot slot, const Tensor& tokens, const Tensor& labels, float grad_scale) {
  use_slot(slot);
  Activations& a = act();
  const ops::Context ctx{device_};
  const int64_t S = cfg_.seq_length;
  const Tensor tokens_h = host_batch(tokens, "tokens", B_, S), labels_h = host_batch(labels, "labels", B_, S);
  fp8_begin(nn::Fp8Delayed::Pass::forward, slot.index);
  forward_trunk(local_positions(tokens_h, cp_tokens_h_), true);
  if (!post_process(slot.chunk)) {  // (before the last virtual stage: its output is in stage_output)
    fp8_update(true);
    return {};
  }
  labels_.copy_from(local_positions(labels_h, cp_labels_h_));
  LossResult r;
  r.tokens = counted_labels(labels_h);  // the whole batch's (every CP rank holds it)
  const float token_scale = per_token_loss_ ? grad_scale : r.tokens ? grad_scale / static_cast<float>(r.tokens) : 0.0f;
  if (!mtp_.empty()) {
    mtp_forward(tokens_h, labels_h, true, ctx);
    mtp_backward(r, grad_scale, ctx);
  }
  const bool sp = par_.sequence_parallel;
  // (under SP the head's partial input gradients of every token, reduce-scattered to this rank's rows)
  nn::lm_head_loss(sp ? &sh_.dh : &a.dfinal, &output_->grad, head_input(), output_->compute, labels_, token_scale,
                   head_ws_, ctx, head_group(), /*reduce_dh=*/!sp, output_linear());
  r.loss_sum = read_loss_sum();
  if (par_.cp.size() > 1) all_reduce_sum(std::span<double>(&r.loss_sum, 1), par_.cp);
  if (output_ != embedding_) grad_ready(output_params_);
  if (sp) reduce_scatter_from(by_sequence(a.dfinal), by_sequence(sh_.dh), 1, par_.tp);
  if (!mtp_.empty()) ops::add(a.dfinal, a.dfinal, mtp_.carry(), ctx);  // h_0 also fed the first MTP depth
  fp8_update(true);
  return r;
}

void GptModel::backward(Slot slot, float grad_scale) {
  use_slot(slot);
  fp8_begin(nn::Fp8Delayed::Pass::backward, slot.index);
  Activations& a = act();
  const ops::Context ctx{device_};
  Tensor no_grad;
  if (post_process(slot.chunk)) {
    nn::norm_backward(sh_.dres, final_norm_->grad, final_norm_bias_ ? final_norm_bias_->grad : no_grad, a.dfinal,
                      a.residual[end_layer()], final_norm_->value,
                      final_norm_bias_ ? final_norm_bias_->value : Tensor(), a.final_mean, a.final_rstd, false, ctx);
    grad_ready(final_norm_params_);
  } else {  // the next virtual stage's gradient of this chunk's output
    sh_.dres.copy_from(a.dfinal);
  }
  for (size_t l = end_layer(); l-- > first_layer();) {
    const int64_t group = plan_.group(l);
    if (group >= 0 && (l + 1 == end_layer() || plan_.group(l + 1) != group))
      for (auto k = static_cast<size_t>(group); k <= l; ++k) {  // the group's forward again, from its kept input
        params_needed(layer_params_[k]);
        layer_forward(k, a.residual[k], a.residual[k + 1], /*training=*/true, ctx, /*recompute=*/true);
        params_released(layer_params_[k]);
      }
    params_needed(layer_params_[l]);
    grads_needed(layer_params_[l]);
    layer_backward(l, a.residual[l], grad_scale, ctx);
    grad_ready(layer_params_[l]);
    params_released(layer_params_[l]);
  }
  if (pre_process(slot.chunk)) {
    if (a.embedding_drop.active()) ops::dropout_backward(sh_.dres, sh_.dres, a.embedding_drop, ctx);
    embed_backward(sh_.dres, a.ids, ctx);
    // (under SP embed_backward left every token's gradient in sh_.dh: the positions' table is whole on every rank)
    if (position_embedding_)
      ops::embedding_backward(position_embedding_->grad, positions_, par_.sequence_parallel ? sh_.dh : sh_.dres, ctx);
  } else if (a.dinput.defined()) {  // the gradient of the chunk's input, for the previous virtual stage
    a.dinput.copy_from(sh_.dres);
  }
  // (the output layer too when tied: it is the embedding, or on the last stage its copy)
  if (pre_process(slot.chunk) || post_process(slot.chunk)) grad_ready(embedding_params_);
  fp8_update(false);
}

bool GptModel::holds_linear(std::string_view name) const {
  if (holds_loss_heads() && name.starts_with("mtp.")) return true;  // (the MTP depths' eh_proj and layers)
  for (size_t l = 0; l < layers_.size(); ++l)
    if (local_layer(l) && name.starts_with(layers_[l].spec().prefix)) return true;
  return false;
}

void GptModel::fp8_begin(nn::Fp8Delayed::Pass pass, int64_t slot) {
  if (nn::Fp8Delayed* d = fp8_delayed()) d->begin(pass, slot);
}

// Megatron's amax reduction group, TP x DP x CP (every rank of the stage), as three MAX-reductions in turn: each an
// all-gather and an fmaxf over the ranks (NaN skipped), the same bits on every rank.
void GptModel::fp8_update(bool forward) {
  nn::Fp8Delayed* d = fp8_delayed();
  if (!d) return;
  std::vector<float> v = d->amaxes(forward);
  for (const ProcessGroup* g : {&par_.tp, &par_.dp, &par_.cp}) {
    if (g->size() <= 1 || v.empty()) continue;
    std::vector<float> all(v.size() * static_cast<size_t>(g->size()));
    all_gather(std::span<float>(all), std::span<const float>(v), *g);
    for (size_t r = 1; r < static_cast<size_t>(g->size()); ++r)
      for (size_t i = 0; i < v.size(); ++i) all[i] = ops::fp8::fmax_skip_nan(all[i], all[r * v.size() + i]);
    std::copy_n(all.begin(), v.size(), v.begin());
  }
  d->update(forward, v);
}

// Through every virtual stage in turn, without gradients (slot 0 of each chunk): a chain, so plain sends and receives
// cannot deadlock. tokens: this rank's positions.
void GptModel::forward_stages(const Tensor& tokens) {
  fp8_begin(nn::Fp8Delayed::Pass::eval);
  const int p = par_.pp.size(), up = (par_.pp.rank() + 1) % p, down = (par_.pp.rank() + p - 1) % p;
  for (int64_t c = 0; c < num_chunks(); ++c) {
    use_slot({0, c});
    if (!pre_process(c)) recv(stage_input({0, c}), down, par_.pp);
    forward_trunk(tokens, false);
    if (!post_process(c)) send(stage_output({0, c}), up, par_.pp);
  }
}

LossResult GptModel::evaluate(const Tensor& tokens, const Tensor& labels) {
  const ops::Context ctx{device_};
  const int64_t S = cfg_.seq_length;
  const Tensor tokens_h = host_batch(tokens, "tokens", B_, S), labels_h = host_batch(labels, "labels", B_, S);
  forward_stages(local_positions(tokens_h, cp_tokens_h_));
  if (!holds_loss_heads()) return {};  // (the last stage's loss)
  labels_.copy_from(local_positions(labels_h, cp_labels_h_));
  LossResult r;
  r.tokens = counted_labels(labels_h);
  nn::lm_head_loss(nullptr, nullptr, head_input(), output_->compute, labels_, 1.0f, head_ws_, ctx, head_group(),
                   /*reduce_dh=*/true, output_linear());
  r.loss_sum = read_loss_sum();
  if (par_.cp.size() > 1) all_reduce_sum(std::span<double>(&r.loss_sum, 1), par_.cp);
  return r;
}

void GptModel::forward_logits(Tensor& logits, const Tensor& tokens) {
  const ops::Context ctx{device_};
  const int CP = par_.cp.size();
  const int64_t S = cfg_.seq_length;
  forward_stages(CP == 1 ? tokens : local_positions(host_batch(tokens, "tokens", B_, S), cp_tokens_h_));
  if (!holds_loss_heads()) return;  // (the last stage's logits)
  Tensor h;                         // every position's hidden state, [B*S, H]
  if (CP == 1) {
    h = head_input();
  } else {  // this rank's positions, then the group's all-gathered and put in position order
    const Tensor& mine = head_input();
    const Shape all{B_ * S, mine.size(1)};
    Tensor gathered = Tensor::empty(all, mine.dtype(), MemCategory::workspace, device_);
    h = Tensor::empty(all, mine.dtype(), MemCategory::workspace, device_);
    all_gather(gathered, mine, par_.cp);
    nn::context_parallel_to_positions(h, gathered, B_, S, CP);
  }
  if (!tensor_parallel()) {
    nn::linear_fprop(logits, h, output_->compute, 1.0f, 0.0f, output_linear(), ctx);
    return;
  }
  // Each rank's vocabulary columns, gathered along the vocabulary (generation and tests: not the step loop).
  Tensor part = Tensor::empty({logits.size(0), output_->compute.size(0)}, DType::f32, MemCategory::workspace, device_);
  nn::linear_fprop(part, h, output_->compute, 1.0f, 0.0f, output_linear(), ctx);
  all_gather_into(logits, part, 1, par_.tp);
}

nn::Linear GptModel::output_linear() const {
  return {cfg_.fp8.output_proj ? fp8_.get() : nullptr, "", "output_layer"};
}

MemoryPlan GptModel::memory_plan(const StateBytesPerElement& optimizer_state) const {
  MemoryPlan plan;
  auto at = [&](MemCategory c) -> int64_t& { return plan.bytes[static_cast<int>(c)]; };
  for (const auto& p : store_.params()) {
    at(MemCategory::parameters) += p.value.nbytes() + (p.compute.same_data(p.value) ? 0 : p.compute.nbytes());
    at(MemCategory::gradients) += p.grad.nbytes();
    at(MemCategory::optimizer_state) += optimizer_state(p) * p.value.numel();
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!local_moe(l)) continue;
    const moe::RouterState& state = *layers_[l].router_state();
    if (state.expert_bias.defined()) at(MemCategory::parameters) += state.expert_bias.nbytes();
    at(MemCategory::other) += moe::router_state_bytes(state);  // the router's device-resident counters
  }
  auto count = [&](MemCategory c, std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t->defined()) at(c) += t->nbytes();
  };
  // Every slot's activations (set_micro_batch_slots). The MoE caches' backward scratch, which they all share (allocated
  // by one cache, moe_scratch_donor), is counted once; the plan counts it as activations.
  if (const moe::MoeLayerCache* donor = moe_scratch_donor())
    at(MemCategory::activations) += moe::moe_layer_scratch_bytes(*donor);
  for (size_t chunk = 0; chunk < slots_.size(); ++chunk)
    for (const Activations& a : slots_[chunk]) {
      for (size_t l = 0; l < layers_.size(); ++l)
        if (stage_.layer_chunk[l] == static_cast<int64_t>(chunk))
          at(MemCategory::activations) += plan_.cache_bytes(l, a.layers[l], sh_);
      for (const Tensor& r : a.residual) count(MemCategory::activations, {&r});
      count(MemCategory::activations, {&a.final_mean, &a.final_rstd, &a.ids, &a.dfinal, &a.dinput});
    }
  at(MemCategory::workspace) =
      nn::dense_layer_workspace_bytes(sh_.dims, standard_attention_) +
      (sh_.mla_ws.q.defined() ? nn::mla_workspace_bytes(sh_.mla_dims, cfg_.compute_dtype) : 0) +
      (holds_loss_heads() ? nn::lm_head_workspace_bytes(sh_.dims.tokens(), cfg_.vocab_size / par_.tp.size(),
                                                        cfg_.compute_dtype, par_.tp.size())
                          : 0);
  at(MemCategory::activations) += plan_.shared_bytes(sh_);  // recompute's shared buffers, once
  // The model's own buffers, by the tensors themselves (each is allocated in one place, the constructor).
  at(MemCategory::activations) += mtp_.bytes(MemCategory::activations);
  at(MemCategory::workspace) += mtp_.bytes(MemCategory::workspace);
  count(MemCategory::workspace, {&sh_.rope, &positions_, &positions_local_, &sh_.dres, &sh_.dh, &labels_, &final_h_,
                                 &final_full_, &sh_.moe_x, &sh_.moe_out, &cp_tokens_h_, &cp_labels_h_});
  return plan;
}

MemoryPlan GptModel::plan_memory(const ModelConfig& cfg, int64_t micro_batch_size, const ModelParallel& parallel,
                                 const std::vector<int64_t>& slots, const StateBytesPerElement& optimizer_state) {
  GptModel m(cfg, micro_batch_size, /*seed=*/0, parallel, Device::meta);
  if (!slots.empty()) m.set_micro_batch_slots(slots);
  return m.memory_plan(optimizer_state);
}

double GptModel::flops_per_step() const {
  return model_flops_per_step(cfg_, B_);
}

}  // namespace moecore::model
