#include "moecore/model/upcycling.h"

#include <cmath>
#include <cstring>

namespace moecore::model {
namespace {

const Param* find(const GptModel& m, const std::string& name) {
  for (const auto& p : m.params())
    if (p.name == name) return &p;
  return nullptr;
}

// dst[rows] = scale * src[src_rows] for a [rows, cols] f32 slice.
void copy_rows(float* dst, const float* src, int64_t rows, int64_t cols, float scale) {
  for (int64_t i = 0; i < rows * cols; ++i) dst[i] = scale * src[i];
}

}  // namespace

void upcycle_dense_to_moe(const GptModel& dense, GptModel& moe) {
  const ModelConfig& dc = dense.config();
  const ModelConfig& mc = moe.config();
  const moe::MoeConfig& m = mc.moe;
  if (!m.enabled() || dc.moe.enabled()) MOECORE_FAIL("upcycling: needs a dense source model and an MoE target model");
  const int64_t Fd = dc.ffn(), F = mc.moe_ffn(), E = m.num_experts, H = mc.hidden_size, K = m.router_topk;
  if (Fd % F != 0)
    MOECORE_FAIL("upcycling: the dense ffn_hidden_size (", Fd, ") must be a multiple of moe_ffn_hidden_size (", F, ")");
  const int64_t g = Fd / F;
  if (E % g != 0)
    MOECORE_FAIL("upcycling: --num-experts (", E, ") must be divisible by the upcycling granularity (", g, ")");
  if (dc.add_bias_linear || mc.add_bias_linear)
    MOECORE_FAIL("upcycling: models with linear-layer biases are not supported yet; pass --disable-bias-linear");
  if (dc.mtp_num_layers || mc.mtp_num_layers || dc.multi_latent_attention || mc.multi_latent_attention)
    MOECORE_FAIL("upcycling: models with --mtp-num-layers or --multi-latent-attention are not supported yet");
  if (dc.swiglu != mc.swiglu || dc.hidden_size != H || dc.num_layers != mc.num_layers)
    MOECORE_FAIL("upcycling: dense and MoE models differ in activation, hidden size or layer count");
  const double a = m.pre_softmax ? static_cast<double>(E * g) / static_cast<double>(K) : static_cast<double>(g);
  const float wscale = static_cast<float>(mc.swiglu ? std::cbrt(a) : std::sqrt(a));

  for (auto& p : moe.params()) {
    const Param* src = find(dense, p.name);
    if (src && src->value.shape() == p.value.shape()) p.value.copy_from(src->value);
  }
  for (int64_t l = 0; l < mc.num_layers; ++l) {
    if (!moe.is_moe_layer(l)) continue;
    const std::string pre = "decoder.layers." + std::to_string(l) + ".mlp.";
    const Param* dfc1 = find(dense, pre + "linear_fc1.weight");
    const Param* dfc2 = find(dense, pre + "linear_fc2.weight");
    if (!dfc1 || !dfc2) MOECORE_FAIL("upcycling: the dense model has no MLP in layer ", l);
    // Router: rows tied in blocks of g (each block of g experts forms one full copy of the dense MLP).
    // A one-time conversion on host copies of the weights (the tensors themselves on the CPU), written back below.
    Tensor& router_p = moe.param(pre + "router.weight").value;
    Tensor& fc1_p = moe.param(pre + "experts.linear_fc1.weight").value;
    Tensor& fc2_p = moe.param(pre + "experts.linear_fc2.weight").value;
    Tensor router = router_p.to_device(Device::cpu), fc1_h = fc1_p.to_device(Device::cpu);
    Tensor fc2_h = fc2_p.to_device(Device::cpu);
    const Tensor d1_h = dfc1->value.to_device(Device::cpu), d2_h = dfc2->value.to_device(Device::cpu);
    float* r = router.data<float>();
    for (int64_t e = E - 1; e >= 0; --e) std::memmove(r + e * H, r + (e / g) * H, static_cast<size_t>(H) * 4);
    // Experts: slice e mod g of the scaled dense weights.
    float* fc1 = fc1_h.data<float>();
    float* fc2 = fc2_h.data<float>();
    const float* d1 = d1_h.data<float>();
    const float* d2 = d2_h.data<float>();
    const int64_t fc1_rows = mc.swiglu ? 2 * F : F;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t s = e % g;
      float* e1 = fc1 + e * fc1_rows * H;
      copy_rows(e1, d1 + s * F * H, F, H, wscale);                                // gate (or the whole fc1 without GLU)
      if (mc.swiglu) copy_rows(e1 + F * H, d1 + (Fd + s * F) * H, F, H, wscale);  // up
      float* e2 = fc2 + e * H * F;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t f = 0; f < F; ++f) e2[h * F + f] = wscale * d2[h * Fd + s * F + f];
    }
    for (auto [dst, src] : {std::pair<Tensor*, const Tensor*>{&router_p, &router}, {&fc1_p, &fc1_h}, {&fc2_p, &fc2_h}})
      if (!dst->same_data(*src)) dst->copy_from(*src);
  }
  moe.refresh_compute_weights();
}

}  // namespace moecore::model
