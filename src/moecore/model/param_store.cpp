#include "moecore/model/param_store.h"

#include <algorithm>

#include "moecore/core/error.h"
#include "moecore/core/rng.h"

namespace moecore::model {

namespace {

// This rank's part of a parameter before the tensor-parallel split: [E/EP, ...] of the routed experts, else the global
// shape; and the global index of its first element (this rank's first expert's).
Shape block_of(const ParamSpec& s, int ep_size) {
  Shape shape = s.shape;
  if (s.expert) shape[0] /= ep_size;
  return shape;
}
uint64_t first_of(const ParamSpec& s, int ep_rank, int ep_size) {
  return s.expert ? static_cast<uint64_t>(ep_rank * block_of(s, ep_size).numel()) : 0;
}

// Megatron-FSDP's units (a decoder layer's or an MTP depth's parameters), whose storage the FSDP optimizer manages.
bool fsdp_unit(const ParamSpec& s) {
  return s.layer >= 0;
}

// The initial values of elements [lo, lo + dst.numel()) of a parameter's local (flattened) tensor: N(0, std^2) by
// (seed, name, global element index) -- run by run of a tensor-parallel shard (into a host buffer, then one upload) --,
// or ones, or zeros.
void fill_initial(Tensor& dst, const Param& p, const ParamSpec& s, const Shape& block, uint64_t first, uint64_t seed,
                  int64_t lo) {
  if (s.init != ParamInit::normal) {
    dst.fill_(s.init == ParamInit::ones ? 1.0f : 0.0f);
    return;
  }
  if (!p.tp.sharded()) {
    rng_fill_normal(dst, seed, p.name, 0.0f, s.std, first + static_cast<uint64_t>(lo));
    return;
  }
  const int64_t hi = lo + dst.numel();
  Tensor host = Tensor::empty({dst.numel()}, DType::f32, MemCategory::workspace);
  p.tp.for_each_run(block, [&](int64_t l, int64_t go, int64_t n) {
    const int64_t a = std::max(lo, l), b = std::min(hi, l + n);
    if (a >= b) return;
    Tensor run = host.slice(0, a - lo, b - lo);
    rng_fill_normal(run, seed, p.name, 0.0f, s.std, first + static_cast<uint64_t>(go + (a - l)));
  });
  dst.copy_from(host);
}

// One parameter of the table on this rank: its shard, its initial values, its compute copy.
// Expert weights are [E/EP, ...] shards of the global [E, ...] tensor, and under TP the split weights are this rank's
// TensorShard; both are filled with the values the global tensor has at those positions. Megatron-FSDP's units are
// born without memory where ModelParallel says so: their gradients (fsdp_grads), and their values and compute copies,
// whose initial values the optimizer's shards draw (fsdp_params).
void alloc_param(Param& p, const ParamSpec& s, const ModelConfig& cfg, const ModelParallel& par, uint64_t seed,
                 Device device) {
  p.name = s.name;
  Shape shape = block_of(s, par.ep.size());
  // The tensor-parallel split: over tp, or for the routed experts' weights over etp (within this rank's experts).
  const ProcessGroup& split = s.expert ? par.etp : par.tp;
  if (split.size() > 1 && s.tp_dim >= 0) p.tp = {s.tp_dim, s.tp_parts, split.rank(), split.size()};
  const Shape block = shape;  // this rank's part before the split: [E/EP, ...] of experts, else the global shape
  shape = p.tp.local_shape(shape);
  // (Expert weights are summed over the expert-data-parallel group, which holds the TP ranks.)
  p.tp_grad_sum = par.tp.size() > 1 && !p.tp.sharded() && !s.expert &&
                  (s.tp_grad == ParamSpec::TpGrad::head_partial ||
                   (s.tp_grad == ParamSpec::TpGrad::sequence_partial && par.sequence_parallel));
  const bool released_grad = fsdp_unit(s) && (par.fsdp_grads || par.fsdp_params);
  const bool released_value = fsdp_unit(s) && par.fsdp_params;
  const auto make = [&](bool released, DType dtype, MemCategory category) {
    return released ? Tensor::released(shape, dtype, category, device) : Tensor::empty(shape, dtype, category, device);
  };
  p.value = make(released_value, DType::f32, MemCategory::parameters);
  p.grad = make(released_grad, DType::f32, MemCategory::gradients);
  if (!released_grad) p.grad.zero_();
  // Megatron decays weights only: norms and biases (of any rank, e.g. experts' [E, W]) are not decayed.
  p.weight_decay = shape.ndim >= 2 && !p.name.ends_with(".bias");
  p.expert_parallel = s.expert;
  const DType c = cfg.compute_dtype;
  p.compute = (c == DType::f32 || !p.weight_decay) ? p.value : make(released_value, c, MemCategory::parameters);
  if (released_value) return;
  if (device == Device::meta) return;  // (a memory plan's model: no values)
  Tensor all = p.value.view({p.value.numel()});
  fill_initial(all, p, s, block, first_of(s, par.ep.rank(), par.ep.size()), seed, 0);
}

}  // namespace

void ParamStore::initial_values(size_t i, int64_t lo, Tensor& dst) const {
  MOECORE_CHECK(i < params_.size() && lo >= 0 && lo + dst.numel() <= params_[i].value.numel(),
                "model: initial values of elements [", lo, ", ", lo + dst.numel(), ") of parameter ", i);
  fill_initial(dst, params_[i], specs_[i], block_of(specs_[i], ep_size_), first_of(specs_[i], ep_rank_, ep_size_),
               seed_, lo);
}

ParamStore::ParamStore(const ModelConfig& cfg, const ModelParallel& par, uint64_t seed, Device device)
    : seed_(seed), ep_rank_(par.ep.rank()), ep_size_(par.ep.size()) {
  for (const ParamSpec& s : parameter_specs(cfg))
    if (pipeline_stage_holds(s.name, cfg, par)) specs_.push_back(s);
  params_.resize(specs_.size());
  const bool embedding_copy = pipeline_word_embeddings_copy(cfg, par.pp);
  for (size_t i = 0; i < specs_.size(); ++i) {
    const bool words = specs_[i].role == ParamRole::word_embeddings;
    params_[i].pipeline_copy = embedding_copy && words;
    alloc_param(params_[i], specs_[i], cfg, par, seed, device);
    if (words && par.pp.size() > 1 && (!cfg.untie_embeddings_and_output_weights || cfg.mtp_num_layers > 0))
      pipeline_shared_ = static_cast<int64_t>(i);
  }
}

Param* ParamStore::find(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

Param* ParamStore::find(ParamRole role, int64_t layer) {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].role == role && specs_[i].layer == layer) return &params_[i];
  return nullptr;
}

Param& ParamStore::at(const std::string& name) {
  if (Param* p = find(name)) return *p;
  MOECORE_FAIL("model: no parameter named '", name, "'");
}

int64_t ParamStore::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.value.numel();
  return n;
}

std::pair<size_t, size_t> ParamStore::range(const std::function<bool(const ParamSpec&)>& in) const {
  size_t first = specs_.size(), end = 0, n = 0;
  for (size_t i = 0; i < specs_.size(); ++i)
    if (in(specs_[i])) {
      first = std::min(first, i);
      end = i + 1;
      ++n;
    }
  MOECORE_CHECK(n == 0 || n == end - first, "model: a backward-order group of parameters is not contiguous (",
                specs_[first].name, " ...)");
  return n ? std::make_pair(first, end) : std::make_pair(size_t{0}, size_t{0});
}

}  // namespace moecore::model
