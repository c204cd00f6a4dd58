#include "moecore/model/recompute_plan.h"

namespace moecore::model {

RecomputePlan::RecomputePlan(const ModelConfig& cfg, const LayerShared& sh, const std::vector<DecoderLayer>& layers,
                             const StageLayout& stage) {
  for (size_t l = 0; l < layers.size(); ++l) {
    Kind& k = kinds_.emplace_back();
    k.decoder = static_cast<int64_t>(l) < cfg.num_layers;
    k.local = stage.layer_chunk[l] >= 0;
    k.mla = layers[l].mla();
    k.moe = layers[l].moe();
  }
  group_.assign(layers.size(), -1);
  plan_selective(cfg.recompute, sh);
  if (cfg.recompute.full()) plan_full(cfg.recompute, sh, stage);
}

// One buffer of each dropped output for all of this stage's decoder layers (taken from a cache allocated for its
// shapes).
void RecomputePlan::plan_selective(const RecomputeConfig& rc, const LayerShared& sh) {
  bool dense = false, moe = false, standard = false, mla = false;
  for (const Kind& k : kinds_)
    if (k.decoder && k.local) {
      (k.moe ? moe : dense) = true;
      (k.mla ? mla : standard) = true;
    }
  const nn::DenseLayerDims& d = sh.dims;
  if (rc.selects("layernorm") && (dense || moe)) {
    const nn::DenseLayerCache c = nn::dense_layer_cache_alloc(d, true, false);
    h1_ = c.h1;
    if (dense) h2_dense_ = c.h2;
    if (moe) h2_moe_ = nn::dense_layer_cache_alloc(d, false, false).h2;
  }
  // (moe refills whole MoE layers: their experts' activations and shared expert with them)
  if (rc.selects("moe") && moe) moe_ = moe::moe_layer_cache_alloc(sh.moe_dims, *sh.moe);
  if (rc.selects("moe_act") && moe && !rc.selects("moe"))
    expert_act_ = moe::moe_layer_cache_alloc(sh.moe_dims, *sh.moe).experts.act;
  if (rc.selects("shared_experts") && moe && !rc.selects("moe") && sh.moe_dims.Fs > 0) {
    const moe::MoeLayerCache c = moe::moe_layer_cache_alloc(sh.moe_dims, *sh.moe);
    shared_h_ = c.shared.h;
    shared_act_ = c.shared.act;
  }
  if (rc.selects("mla_up_proj") && mla)
    mla_qkv_ = nn::mla_cache_alloc(sh.mla_dims, d.compute, d.layernorm, d.device).qkv;
  if (rc.selects("core_attn") && standard) {
    const nn::DenseLayerCache c = nn::dense_layer_cache_alloc(d, false, true);
    attn_ = c.attn;
    lse_ = c.lse;
  }
  if (rc.selects("mlp") && dense) {
    const nn::DenseLayerCache c = nn::dense_layer_cache_alloc(d, true, false);
    fc1_ = c.fc1;
    mlp_act_ = c.act;
    if (!h2_dense_.defined()) h2_dense_ = c.h2;
  }
}

void RecomputePlan::plan_full(const RecomputeConfig& rc, const LayerShared& sh, const StageLayout& stage) {
  for (const auto& [first, end] : stage.chunks)
    for (int64_t l = first; l < end; ++l) {
      const int64_t i = l - first;
      if (rc.method == "uniform")
        group_[static_cast<size_t>(l)] = first + i / rc.num_layers * rc.num_layers;
      else if (i < rc.num_layers)  // block: the chunk's first layers, each alone
        group_[static_cast<size_t>(l)] = l;
    }
  const nn::DenseLayerDims& d = sh.dims;
  for (size_t l = 0; l < kinds_.size(); ++l) {
    if (group_[l] < 0 || sets_.count(key(l))) continue;
    const Kind& k = kinds_[l];
    SharedSet& s = sets_[key(l)];
    s.dense = nn::dense_layer_cache_alloc(d, /*with_mlp=*/!k.moe, /*with_attention=*/!k.mla);
    if (k.mla) s.mla = nn::mla_cache_alloc(sh.mla_dims, d.compute, d.layernorm, d.device);
    if (k.moe) s.moe = moe::moe_layer_cache_alloc(sh.moe_dims, *sh.moe, scratch_donor());
  }
}

Refill RecomputePlan::refill(size_t l) const {
  const Kind& k = kinds_[l];
  Refill r;
  if (!k.decoder) return r;
  r.norms = h1_.defined();
  r.attention = attn_.defined() && !k.mla;
  r.mlp = fc1_.defined() && !k.moe;
  r.mla_up = mla_qkv_.defined() && k.mla;
  r.moe = moe_.probs.defined() && k.moe;
  r.shared_expert = shared_h_.defined() && k.moe && !r.moe;
  return r;
}

const moe::MoeLayerCache* RecomputePlan::scratch_donor() const {
  if (moe_.probs.defined()) return &moe_;
  for (const auto& [key, s] : sets_)
    if (s.moe.probs.defined()) return &s.moe;
  return nullptr;
}

void RecomputePlan::fill_cache(size_t l, LayerCache& c, const LayerShared& sh, const moe::MoeLayerCache*& donor) const {
  const Kind& k = kinds_[l];
  const nn::DenseLayerDims& d = sh.dims;
  if (k.moe) c.moe = moe::moe_layer_cache_alloc(sh.moe_dims, *sh.moe, donor);
  if (k.moe && !donor) donor = &c.moe;
  if (group_[l] >= 0) {  // the shared set
    const SharedSet& s = sets_.at(key(l));
    c.dense = s.dense;
    c.mla = s.mla;
    if (k.moe) moe::moe_layer_cache_share_refilled(c.moe, s.moe);
    return;
  }
  c.dense = nn::dense_layer_cache_alloc(d, /*with_mlp=*/!k.moe, /*with_attention=*/!k.mla);
  if (k.mla) c.mla = nn::mla_cache_alloc(sh.mla_dims, d.compute, d.layernorm, d.device);
  if (k.moe && expert_act_.defined()) {  // selective moe_act: the shared buffer
    c.moe.experts.act = expert_act_;
    c.moe.owns_expert_act = false;
  }
  const Refill r = refill(l);  // selective recompute: the shared buffers (the layer's own are freed again)
  if (r.norms) c.dense.h1 = h1_;
  if (r.norms || r.mlp) c.dense.h2 = k.moe ? h2_moe_ : h2_dense_;
  if (r.attention) {
    c.dense.attn = attn_;
    c.dense.lse = lse_;
  }
  if (r.mlp) {
    c.dense.fc1 = fc1_;
    c.dense.act = mlp_act_;
  }
  if (r.mla_up) c.mla.qkv = mla_qkv_;
  if (r.moe) moe::moe_layer_cache_share_refilled(c.moe, moe_);
  if (r.shared_expert) {
    c.moe.shared.h = shared_h_;
    c.moe.shared.act = shared_act_;
    c.moe.owns_shared_act = false;
  }
}

std::vector<const Tensor*> RecomputePlan::dropped(const nn::DenseLayerCache& c, size_t l) const {
  const Refill r = refill(l);
  std::vector<const Tensor*> d;  // (push_back each: GCC 12's -Wstringop-overflow misfires on insert of a list here)
  if (r.norms) d.push_back(&c.h1);
  if (r.norms || r.mlp) d.push_back(&c.h2);
  for (const Tensor* t : {&c.attn, &c.lse})
    if (r.attention) d.push_back(t);
  for (const Tensor* t : {&c.fc1, &c.act})
    if (r.mlp) d.push_back(t);
  return d;
}

int64_t RecomputePlan::cache_bytes(size_t l, const LayerCache& c, const LayerShared& sh) const {
  const Kind& k = kinds_[l];
  const nn::DenseLayerDims& d = sh.dims;
  const int64_t routing = k.moe ? moe::moe_layer_cache_bytes(c.moe) : 0;
  if (group_[l] >= 0) return routing;  // the rest is the shared set's
  int64_t n = nn::dense_layer_cache_bytes(d, !k.moe, !k.mla) + routing;
  for (const Tensor* t : dropped(c.dense, l)) n -= t->nbytes();
  if (k.mla)
    n += nn::mla_cache_bytes(sh.mla_dims, d.compute, d.layernorm) - (refill(l).mla_up ? c.mla.qkv.nbytes() : 0);
  return n;
}

int64_t RecomputePlan::shared_bytes(const LayerShared& sh) const {
  const nn::DenseLayerDims& d = sh.dims;
  int64_t n = 0;
  for (const auto& [key, s] : sets_) {
    const bool is_moe = key % 4 & 1, is_mla = key % 4 & 2;
    n += nn::dense_layer_cache_bytes(d, !is_moe, !is_mla);
    if (is_mla) n += nn::mla_cache_bytes(sh.mla_dims, d.compute, d.layernorm);
    if (is_moe) n += moe::moe_layer_cache_bytes(s.moe);
  }
  if (moe_.probs.defined()) n += moe::moe_layer_cache_bytes(moe_);
  for (const Tensor* t :
       {&h1_, &h2_dense_, &h2_moe_, &expert_act_, &attn_, &lse_, &fc1_, &mlp_act_, &shared_h_, &shared_act_, &mla_qkv_})
    if (t->defined()) n += t->nbytes();
  return n;
}

}  // namespace moecore::model
