// One transformer layer of the decoder (or the transformer layer of an MTP depth), built from its LayerSpec: the
// attention half (standard GQA/MHA, nn/dense_layer.h, or MLA, nn/mla.h) then the MLP half (dense, nn/dense_layer.h,
// or MoE, moe/moe_layer.h, with the router's state and the layout change the MoE layer needs: Megatron's
// sequence-major token order in, batch-major out). Its weights and gradients are views of the model's parameters,
// bound by role (bind). What every layer shares -- dims, workspaces, the RoPE table, the token dispatcher, the residual
// gradient -- the model owns (LayerShared), and each micro-batch's activations too (LayerCache); a layer owns its
// views and, for MoE, its router state. Not here: which layers run where (parallel_layout.h), what recompute drops
// (the model's plan: it says what to refill, Refill), the dropout keys (the model's).
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <memory>

#include "moecore/core/param.h"
#include "moecore/model/param_specs.h"
#include "moecore/moe/dispatcher.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/nn/dense_layer.h"
#include "moecore/nn/mla.h"

namespace moecore::model {

// One micro-batch's activations of one layer, kept from its forward to its backward.
struct LayerCache {
  nn::DenseLayerCache dense;  // the norms, the standard attention and (dense layers) the MLP; with MLA its norms
  nn::MlaCache mla;           // MLA only
  moe::MoeLayerCache moe;     // MoE only
  nn::LayerDropout drops;     // this forward's masks
};

// The dims and buffers every layer of a model reads (owned by the model; one set for all its layers).
//   N rows of the residual stream on this rank (B*S/CP, divided by TP under sequence parallelism), H hidden size.
struct LayerShared {
  nn::DenseLayerDims dims;
  nn::MlaDims mla_dims;  // (MLA layers only)
  moe::MoeLayerDims moe_dims;
  const moe::MoeConfig* moe = nullptr;
  nn::Fp8Training* fp8 = nullptr;  // FP8 training's recipe (the layers whose spec says fp8 run their linears in it)
  nn::DenseLayerWorkspace ws;
  nn::MlaWorkspace mla_ws;
  Tensor rope;  // [S, Dr] f32 (RoPE only): row s the rotation of this rank's position s
  std::unique_ptr<moe::Dispatcher> dispatcher;
  Tensor moe_x;    // [N, H] compute: an MoE layer's input in Megatron's sequence-major order (token s*B + b)
  Tensor moe_out;  // [N, H] f32: its output (sequence-major); in backward its gradient
  Tensor dres;     // [N, H] f32: dL/d(layer output) into a layer's backward, dL/d(layer input) out of it
  Tensor dh;       // [T, H] f32: scratch of the MoE backward (and of the model's heads)
};

// What a layer's backward refills before it runs (selective recompute: the outputs its forward's cache shares with
// every other layer, so that another layer overwrote them): the norm outputs (norms), the standard attention's output
// and log-sum-exp (attention), a dense MLP's norm output, fc1 output and activation (mlp), MLA's kernel input (mla_up),
// the whole MoE layer from its routing (moe), the shared expert's fc1 output and activation (shared_expert).
struct Refill {
  bool norms = false, attention = false, mlp = false, mla_up = false, moe = false, shared_expert = false;
};

class DecoderLayer {
 public:
  explicit DecoderLayer(LayerSpec spec) : spec_(std::move(spec)) {}
  const LayerSpec& spec() const { return spec_; }
  // The shared dims with this layer's own settings: its sliding window, whether its linears run FP8, its name.
  nn::DenseLayerDims dims(const LayerShared& sh) const {
    nn::DenseLayerDims d = sh.dims;
    d.attention_window = spec_.window;
    d.fp8 = spec_.fp8 ? sh.fp8 : nullptr;
    d.layer = spec_.prefix;
    return d;
  }
  moe::MoeLayerDims moe_dims(const LayerShared& sh) const {
    moe::MoeLayerDims d = sh.moe_dims;
    d.fp8 = spec_.fp8 ? sh.fp8 : nullptr;
    d.layer = spec_.prefix;
    return d;
  }
  bool moe() const { return spec_.mlp == MlpKind::moe; }
  bool mla() const { return spec_.attention == AttentionKind::mla; }
  // Points the module slot of the parameter's role at it: the weight in the compute dtype (p.compute, which is the f32
  // master itself for norms and biases), the router and the shared expert's gate also as f32 masters.
  void bind(const ParamSpec& spec, Param& p);
  // An MoE layer's router state (moe/router.h) on `device`; stream: its noise stream (jitter, forced balancing).
  void init_router(const moe::MoeConfig& cfg, Device device, uint64_t stream);
  moe::RouterState* router_state() { return moe() ? &router_ : nullptr; }
  const moe::RouterState* router_state() const { return moe() ? &router_ : nullptr; }
  const moe::MoeLayerWeights& moe_weights() const { return moe_w_; }

  // y = x + attention(norm1(x)), then + mlp(norm2(.)), both [N, H] f32; the cache keeps what backward reads. recompute:
  // a backward's refill of the cache (an MoE layer keeps its routing).
  void forward(const Tensor& x, Tensor& y, LayerCache& c, LayerShared& sh, bool training, const ops::Context& ctx,
               bool recompute = false);
  // sh.dres: dL/dy on entry, dL/dx on return; gradients added to the bound parameters'. aux_scale: the MoE auxiliary
  // losses' gradient scale.
  void backward(const Tensor& x, LayerCache& c, LayerShared& sh, const Refill& refill, float aux_scale,
                const ops::Context& ctx);

 private:
  void bind_moe(const ParamSpec& spec, Param& p);  // bind's MoE-block roles
  void moe_forward(Tensor& y, LayerCache& c, LayerShared& sh, bool training, const ops::Context& ctx, bool recompute);
  void moe_backward(LayerCache& c, LayerShared& sh, const Refill& refill, float aux_scale, const ops::Context& ctx);

  LayerSpec spec_;
  nn::DenseLayerWeights w_;  // the norms, the standard attention (or MLA's output projection) and the dense MLP
  nn::DenseLayerGrads g_;
  nn::MlaWeights mla_w_;  // MLA only
  nn::MlaGrads mla_g_;
  moe::MoeLayerWeights moe_w_;  // MoE only
  moe::MoeLayerGrads moe_g_;
  moe::RouterState router_;
};

}  // namespace moecore::model
