// Activation recompute (ModelConfig::recompute: Megatron's --recompute-granularity, --recompute-method,
// --recompute-num-layers, --recompute-modules) as a plan over this stage's layers, decided once and read by the model
// when it allocates a micro-batch slot's caches (fill_cache), in backward (group, refill) and by its memory plan:
//   selective: buffers that every decoder layer's dropped outputs share, refilled by its backward (Refill) --
//     layernorm: the norm outputs h1 and h2 (of a dense and of an MoE layer); mlp: a dense layer's h2, fc1 output and
//     activation; core_attn: the standard attention's output and log-sum-exp; mla_up_proj: the MLA kernel's input;
//     moe_act: the routed experts' activations; moe: the whole MoE layer but its routing; shared_experts: the shared
//     expert's fc1 output and activation. Decoder layers only: the MTP depths keep their own.
//   full: each model chunk's decoder layers in groups (uniform: num_layers at a time; block: the chunk's first
//     num_layers layers, each alone; Megatron applies the count per virtual pipeline stage) whose forward runs again
//     in backward from the group's kept input; the recomputed layers share one cache set per position in a group and
//     layer kind, for every slot and chunk (an MoE layer keeps its own routing).
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "moecore/model/decoder_layer.h"
#include "moecore/model/parallel_layout.h"

namespace moecore::model {

class RecomputePlan {
 public:
  RecomputePlan() = default;
  // layers: the model's (decoder, then MTP); the buffers are allocated here, for sh's dims.
  RecomputePlan(const ModelConfig& cfg, const LayerShared& sh, const std::vector<DecoderLayer>& layers,
                const StageLayout& stage);
  // The first layer of l's recomputed group (full recompute), or -1: l's caches are kept.
  int64_t group(size_t l) const { return group_[l]; }
  Refill refill(size_t l) const;  // what l's backward refills first (selective)
  // Allocates layer l's cache of one micro-batch slot in c: its own tensors, the plan's where it shares them. donor:
  // the MoE cache whose scratch every MoE cache shares (null: c's becomes it).
  void fill_cache(size_t l, LayerCache& c, const LayerShared& sh, const moe::MoeLayerCache*& donor) const;
  // The bytes of such a cache that are its slot's own (without the MoE scratch and the plan's shared buffers).
  int64_t cache_bytes(size_t l, const LayerCache& c, const LayerShared& sh) const;
  int64_t shared_bytes(const LayerShared& sh) const;  // the plan's shared buffers and cache sets, each once
  const moe::MoeLayerCache* scratch_donor() const;    // a shared MoE cache of the plan (it owns the scratch), or null

 private:
  struct Kind {
    bool decoder = false, local = false, mla = false, moe = false;
  };
  struct SharedSet {  // full recompute: one position's caches in a group of one layer kind
    nn::DenseLayerCache dense;
    nn::MlaCache mla;
    moe::MoeLayerCache moe;  // its refilled tensors serve the layers; each keeps its own routing
  };
  void plan_selective(const RecomputeConfig& rc, const LayerShared& sh);
  void plan_full(const RecomputeConfig& rc, const LayerShared& sh, const StageLayout& stage);
  int64_t key(size_t l) const {  // group position * 4 + kind (1: MoE, 2: MLA)
    return (static_cast<int64_t>(l) - group_[l]) * 4 + (kinds_[l].moe ? 1 : 0) + (kinds_[l].mla ? 2 : 0);
  }
  std::vector<const Tensor*> dropped(const nn::DenseLayerCache& c, size_t l) const;  // what the shared buffers replace

  std::vector<Kind> kinds_;     // per layer
  std::vector<int64_t> group_;  // per layer
  std::map<int64_t, SharedSet> sets_;
  Tensor h1_, h2_dense_, h2_moe_, expert_act_, attn_, lse_, fc1_, mlp_act_, shared_h_, shared_act_, mla_qkv_;
  moe::MoeLayerCache moe_;  // moe: the refilled part every MoE layer shares
};

}  // namespace moecore::model
