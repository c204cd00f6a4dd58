#include "moecore/model/decoder_layer.h"

#include "moecore/core/error.h"

namespace moecore::model {
namespace {
// A parameter bound as its compute copy and its gradient.
void bind_views(const Param& p, Tensor& weight, Tensor& grad) {
  weight = p.compute;
  grad = p.grad;
}
}  // namespace

void DecoderLayer::bind(const ParamSpec& spec, Param& p) {
  const auto to = [&](Tensor& weight, Tensor& grad) { bind_views(p, weight, grad); };
  using enum ParamRole;
  switch (spec.role) {
    case input_norm:
      return to(w_.input_norm, g_.input_norm);
    case input_norm_bias:
      return to(w_.input_norm_bias, g_.input_norm_bias);
    case mlp_norm:
      return to(w_.mlp_norm, g_.mlp_norm);
    case mlp_norm_bias:
      return to(w_.mlp_norm_bias, g_.mlp_norm_bias);
    case qkv:
      return to(w_.qkv, g_.qkv);
    case qkv_bias:
      return to(w_.qkv_bias, g_.qkv_bias);
    case proj:
      return to(w_.proj, g_.proj);
    case proj_bias:
      return to(w_.proj_bias, g_.proj_bias);
    case softmax_offset:
      return to(w_.softmax_offset, g_.softmax_offset);
    case q_norm:
      return mla() ? to(mla_w_.q_norm, mla_g_.q_norm) : to(w_.q_norm, g_.q_norm);
    case q_norm_bias:
      return mla() ? to(mla_w_.q_norm_bias, mla_g_.q_norm_bias) : to(w_.q_norm_bias, g_.q_norm_bias);
    case k_norm:
      return to(w_.k_norm, g_.k_norm);
    case k_norm_bias:
      return to(w_.k_norm_bias, g_.k_norm_bias);
    case q_proj:
      return to(mla_w_.q, mla_g_.q);
    case q_down_proj:
      return to(mla_w_.q_down, mla_g_.q_down);
    case q_up_proj:
      return to(mla_w_.q_up, mla_g_.q_up);
    case kv_down_proj:
      return to(mla_w_.kv_down, mla_g_.kv_down);
    case kv_up_proj:
      return to(mla_w_.kv_up, mla_g_.kv_up);
    case kv_norm:
      return to(mla_w_.kv_norm, mla_g_.kv_norm);
    case kv_norm_bias:
      return to(mla_w_.kv_norm_bias, mla_g_.kv_norm_bias);
    case fc1:
      return to(w_.fc1, g_.fc1);
    case fc1_bias:
      return to(w_.fc1_bias, g_.fc1_bias);
    case fc2:
      return to(w_.fc2, g_.fc2);
    case fc2_bias:
      return to(w_.fc2_bias, g_.fc2_bias);
    default:
      return bind_moe(spec, p);
  }
}

// The MoE block's parameters (router state and experts' weights are views of the store's).
void DecoderLayer::bind_moe(const ParamSpec& spec, Param& p) {
  const auto to = [&](Tensor& weight, Tensor& grad) { bind_views(p, weight, grad); };
  using enum ParamRole;
  switch (spec.role) {
    case router:
      moe_w_.router.weight = p.value;
      moe_w_.router.weight_compute = p.compute;
      moe_g_.router = p.grad;
      return;
    case router_bias:
      return to(moe_w_.router.bias, moe_g_.router_bias);
    case experts_fc1:
      return to(moe_w_.experts.fc1, moe_g_.experts.fc1);
    case experts_fc1_bias:
      return to(moe_w_.experts.fc1_bias, moe_g_.experts.fc1_bias);
    case experts_fc2:
      return to(moe_w_.experts.fc2, moe_g_.experts.fc2);
    case experts_fc2_bias:
      return to(moe_w_.experts.fc2_bias, moe_g_.experts.fc2_bias);
    case shared_fc1:
      return to(moe_w_.shared.fc1, moe_g_.shared.fc1);
    case shared_fc2:
      return to(moe_w_.shared.fc2, moe_g_.shared.fc2);
    case shared_gate:  // read in f32, its master
      moe_w_.shared.gate = p.value;
      moe_g_.shared.gate = p.grad;
      return;
    default:
      MOECORE_FAIL("model: ", spec.name, " is not a transformer layer's parameter");
  }
}

void DecoderLayer::init_router(const moe::MoeConfig& cfg, Device device, uint64_t stream) {
  router_ = moe::router_state_init(cfg, device);
  router_.stream = stream;
}

void DecoderLayer::forward(const Tensor& x, Tensor& y, LayerCache& c, LayerShared& sh, bool training,
                           const ops::Context& ctx, bool recompute) {
  const nn::DenseLayerDims d = dims(sh);
  if (mla())
    nn::mla_block_forward(x, w_, mla_w_, c.dense, c.mla, sh.ws, sh.mla_ws, sh.rope, d, sh.mla_dims, c.drops, ctx);
  else
    nn::attention_block_forward(x, w_, c.dense, sh.ws, sh.rope, d, c.drops, ctx);
  if (moe())
    moe_forward(y, c, sh, training, ctx, recompute);
  else
    nn::mlp_block_forward(y, w_, c.dense, sh.ws, d, c.drops, ctx);
}

void DecoderLayer::backward(const Tensor& x, LayerCache& c, LayerShared& sh, const Refill& refill, float aux_scale,
                            const ops::Context& ctx) {
  const nn::DenseLayerDims d = dims(sh);
  if (refill.norms || refill.mlp) nn::mlp_norm_refill(w_, c.dense, sh.ws, d, /*dense_mlp=*/!moe(), ctx);
  if (refill.mlp) nn::mlp_refill(w_, c.dense, d, ctx);
  if (moe())
    moe_backward(c, sh, refill, aux_scale, ctx);
  else
    nn::mlp_block_backward(sh.dres, g_, w_, c.dense, sh.ws, d, c.drops, ctx);
  // sh.dres is dL/dx_mid here.
  if (refill.norms) nn::attention_norm_refill(x, w_, c.dense, sh.ws, d, ctx);
  if (refill.attention) nn::core_attention_refill(w_, c.dense, sh.ws, d, c.drops, ctx);
  if (refill.mla_up) nn::mla_up_refill(c.dense.h1, mla_w_, c.mla, sh.mla_ws, sh.rope, d, sh.mla_dims, ctx);
  if (mla())
    nn::mla_block_backward(sh.dres, g_, mla_g_, x, w_, mla_w_, c.dense, c.mla, sh.ws, sh.mla_ws, sh.rope, d,
                           sh.mla_dims, c.drops, ctx);
  else
    nn::attention_block_backward(sh.dres, g_, x, w_, c.dense, sh.ws, sh.rope, d, c.drops, ctx);
}

// The MoE half: y = x_mid + dropout(moe(norm2(x_mid))). The MoE layer takes Megatron's sequence-major token order
// (token s*B + b): it decides which tokens the "position" drop policy keeps and which tokens form a sequence for
// seq_aux_loss.
void DecoderLayer::moe_forward(Tensor& y, LayerCache& c, LayerShared& sh, bool training, const ops::Context& ctx,
                               bool recompute) {
  const int64_t N = sh.dims.N, B = sh.dims.qkv.B, S = N / B, H = sh.dims.H;  // S: this rank's positions per sequence
  nn::mlp_norm_forward(w_, c.dense, sh.dims, ctx);
  Tensor x_sb = sh.moe_x.view({S, B, H}), out_sb = sh.moe_out.view({S, B, H});
  Tensor out_bs = sh.ws.dh.slice(0, 0, N).view({B, S, H});
  ops::transpose_01(x_sb, c.dense.h2.view({B, S, H}), ctx);
  moe::moe_layer_forward(sh.moe_out, sh.moe_x, Tensor(), moe_w_, router_, c.moe, *sh.dispatcher, moe_dims(sh), *sh.moe,
                         training, ctx, /*route=*/!recompute);
  ops::transpose_01(out_bs, out_sb, ctx);
  ops::bias_dropout_add(y, c.dense.x_mid, sh.ws.dh.slice(0, 0, N), Tensor(), c.drops.mlp_out, ctx);
}

// sh.dres is dL/d(layer output) on entry, dL/dx_mid on return. The MoE output's gradient goes through the dropout and
// into sequence-major order; the input gradient comes back batch-major in sh.ws.dh.
void DecoderLayer::moe_backward(LayerCache& c, LayerShared& sh, const Refill& refill, float aux_scale,
                                const ops::Context& ctx) {
  const int64_t N = sh.dims.N, B = sh.dims.qkv.B, S = N / B, H = sh.dims.H;
  Tensor dx = sh.dh.slice(0, 0, N), dh2_flat = sh.ws.dh.slice(0, 0, N);
  Tensor dout_sb = sh.moe_out.view({S, B, H}), dx_sb = dx.view({S, B, H}), dh2 = dh2_flat.view({B, S, H});
  Tensor x_sb = sh.moe_x.view({S, B, H}), no_bias;
  ops::transpose_01(x_sb, c.dense.h2.view({B, S, H}), ctx);
  const moe::MoeLayerDims md = moe_dims(sh);
  if (refill.moe)  // the layer again from its routing (its output, in moe_out, is not needed)
    moe::moe_layer_forward(sh.moe_out, sh.moe_x, Tensor(), moe_w_, router_, c.moe, *sh.dispatcher, md, *sh.moe,
                           /*training=*/true, ctx, /*route=*/false);
  if (refill.shared_expert)
    moe::shared_expert_refill(sh.moe_x, moe_w_.shared, c.moe.shared, moe::shared_expert_dims(md, *sh.moe), ctx);
  ops::bias_dropout_add_backward(dh2_flat, no_bias, sh.dres, c.drops.mlp_out, ctx);
  ops::transpose_01(dout_sb, dh2, ctx);
  moe::moe_layer_backward(dx, moe_g_, sh.moe_out, sh.moe_x, moe_w_, c.moe, *sh.dispatcher, md, *sh.moe, aux_scale, ctx);
  ops::transpose_01(dh2, dx_sb, ctx);
  nn::mlp_norm_backward(sh.dres, g_, dh2_flat, w_, c.dense, sh.dims, ctx);
}

}  // namespace moecore::model
