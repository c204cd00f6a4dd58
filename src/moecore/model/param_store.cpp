#include "moecore/model/param_store.h"

#include <algorithm>

#include "moecore/core/error.h"
#include "moecore/core/rng.h"

namespace moecore::model {

namespace {

// One parameter of the table on this rank: its shard, its initial values, its compute copy.
// Expert weights are [E/EP, ...] shards of the global [E, ...] tensor, and under TP the split weights are this rank's
// TensorShard; both are filled with the values the global tensor has at those positions.
void alloc_param(Param& p, const ParamSpec& s, const ModelConfig& cfg, const ModelParallel& par, uint64_t seed,
                 Device device) {
  p.name = s.name;
  Shape shape = s.shape;
  if (s.expert) shape[0] /= par.ep.size();
  // The tensor-parallel split: over tp, or for the routed experts' weights over etp (within this rank's experts).
  const ProcessGroup& split = s.expert ? par.etp : par.tp;
  if (split.size() > 1 && s.tp_dim >= 0) p.tp = {s.tp_dim, s.tp_parts, split.rank(), split.size()};
  const Shape block = shape;  // this rank's part before the split: [E/EP, ...] of experts, else the global shape
  shape = p.tp.local_shape(shape);
  // (Expert weights are summed over the expert-data-parallel group, which holds the TP ranks.)
  p.tp_grad_sum = par.tp.size() > 1 && !p.tp.sharded() && !s.expert &&
                  (s.tp_grad == ParamSpec::TpGrad::head_partial ||
                   (s.tp_grad == ParamSpec::TpGrad::sequence_partial && par.sequence_parallel));
  p.value = Tensor::empty(shape, DType::f32, MemCategory::parameters, device);
  p.grad = Tensor::zeros(shape, DType::f32, MemCategory::gradients, device);
  // Megatron decays weights only: norms and biases (of any rank, e.g. experts' [E, W]) are not decayed.
  p.weight_decay = shape.ndim >= 2 && !p.name.ends_with(".bias");
  p.expert_parallel = s.expert;
  const DType c = cfg.compute_dtype;
  p.compute = (c == DType::f32 || !p.weight_decay) ? p.value : Tensor::empty(shape, c, MemCategory::parameters, device);
  if (device == Device::meta) return;  // (a memory plan's model: no values)
  const uint64_t first = s.expert ? static_cast<uint64_t>(par.ep.rank() * block.numel()) : 0;
  if (s.init == ParamInit::normal && p.tp.sharded()) {  // run by run of the shard, then one upload
    Tensor host = Tensor::empty(shape, DType::f32, MemCategory::workspace);
    Tensor flat = host.view({host.numel()});
    p.tp.for_each_run(block, [&](int64_t lo, int64_t go, int64_t n) {
      Tensor run = flat.slice(0, lo, lo + n);
      rng_fill_normal(run, seed, p.name, 0.0f, s.std, first + static_cast<uint64_t>(go));
    });
    p.value.copy_from(host);
  } else if (s.init == ParamInit::normal) {
    rng_fill_normal(p.value, seed, p.name, 0.0f, s.std, first);
  } else {
    p.value.fill_(s.init == ParamInit::ones ? 1.0f : 0.0f);
  }
}

}  // namespace

ParamStore::ParamStore(const ModelConfig& cfg, const ModelParallel& par, uint64_t seed, Device device) {
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
