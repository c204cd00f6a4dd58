#include "moecore/model/mtp_heads.h"

#include "moecore/nn/norm.h"

namespace moecore::model {

namespace {
Tensor value_of(const Param* p) {
  return p ? p->value : Tensor();
}
// Megatron's roll_tensor along each sequence: out[b, s] = in[b, s + 1], the last position `fill` (host tensors).
void roll_left(Tensor& out, const Tensor& in, int32_t fill, int64_t B, int64_t S) {
  const int32_t* src = in.data<int32_t>();
  int32_t* dst = out.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) dst[b * S + s] = s + 1 < S ? src[b * S + s + 1] : fill;
}
}  // namespace

MtpHeads::MtpHeads(ParamStore& store, const ModelConfig& cfg, const nn::DenseLayerDims& dims, int64_t B, Device device,
                   nn::Fp8Training* fp8)
    : B_(B), S_(cfg.seq_length), H_(cfg.hidden_size), eps_(cfg.norm_epsilon), fp8_(fp8) {
  const int64_t H = H_, N = dims.N, T = dims.tokens();
  const DType c = cfg.compute_dtype;
  auto act = [&](Shape shape, DType t) { return Tensor::empty(shape, t, MemCategory::activations, device); };
  using enum ParamRole;
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k) {
    const int64_t l = cfg.num_layers + k;
    MtpDepth& d = depths_.emplace_back();
    d.prefix = "mtp.layers." + std::to_string(k) + ".";
    d.enorm = store.find(mtp_enorm, l);
    d.enorm_b = store.find(mtp_enorm_bias, l);
    d.hnorm = store.find(mtp_hnorm, l);
    d.hnorm_b = store.find(mtp_hnorm_bias, l);
    d.eh = store.find(mtp_eh_proj, l);
    d.fnorm = store.find(mtp_final_norm, l);
    d.fnorm_b = store.find(mtp_final_norm_bias, l);
    d.ids = act({T}, DType::i32);  // every token (the vocabulary-parallel embedding and loss need them all)
    d.labels = act({T}, DType::i32);
    // (rolled over the whole batch: under CP the rolled token of a chunk's last position is another rank's)
    d.ids_h = Tensor::empty({B * S_}, DType::i32, MemCategory::workspace);
    d.labels_h = Tensor::empty({B * S_}, DType::i32, MemCategory::workspace);
    for (Tensor* t : {&d.e, &d.hin, &d.x, &d.y}) *t = act({N, H}, DType::f32);
    d.eh_in = act({N, 2 * H}, c);
    d.h = act({N, H}, c);
    for (Tensor* t : {&d.e_rstd, &d.h_rstd, &d.f_rstd}) *t = act({N}, DType::f32);
    if (dims.layernorm)
      for (Tensor* t : {&d.e_mean, &d.h_mean, &d.f_mean}) *t = act({N}, DType::f32);
  }
  if (depths_.empty()) return;
  if (dims.sequence_parallel) h_full_ = Tensor::empty({T, H}, c, MemCategory::workspace, device);
  dx_c_ = Tensor::empty({N, H}, c, MemCategory::workspace, device);
  norm_out_ = Tensor::empty({N, H}, c, MemCategory::workspace, device);
  deh_in_ = Tensor::empty({N, 2 * H}, DType::f32, MemCategory::workspace, device);
  for (Tensor* t : {&carry_, &dn_, &dfn_}) *t = Tensor::empty({N, H}, DType::f32, MemCategory::workspace, device);
}

void MtpHeads::roll(size_t j, const Tensor& tokens_h, const Tensor& labels_h, bool training) {
  MtpDepth& d = depths_[j];
  roll_left(d.ids_h, j ? depths_[j - 1].ids_h : tokens_h, 0, B_, S_);
  if (training) roll_left(d.labels_h, j ? depths_[j - 1].labels_h : labels_h, -1, B_, S_);
}

void MtpHeads::input_forward(size_t j, const Tensor& h_prev, const ops::Context& ctx) {
  MtpDepth& d = depths_[j];
  if (d.drop.active()) ops::dropout_forward(d.e, d.e, d.drop, ctx);
  nn::norm_forward(norm_out_, d.e_mean, d.e_rstd, d.e, d.enorm->value, value_of(d.enorm_b), eps_, ctx);
  d.eh_in.slice(1, 0, H_).copy_from(norm_out_);
  d.hin.copy_from(h_prev);
  nn::norm_forward(norm_out_, d.h_mean, d.h_rstd, d.hin, d.hnorm->value, value_of(d.hnorm_b), eps_, ctx);
  d.eh_in.slice(1, H_, 2 * H_).copy_from(norm_out_);
  nn::linear_fprop(d.x, d.eh_in, d.eh->compute, 1.0f, 0.0f, eh_proj(d), ctx);
}

nn::Linear MtpHeads::eh_proj(const MtpDepth& d) const {
  return {fp8_, d.prefix, "eh_proj"};
}

void MtpHeads::output_forward(size_t j, const ops::Context& ctx) {
  MtpDepth& d = depths_[j];
  nn::norm_forward(d.h, d.f_mean, d.f_rstd, d.y, d.fnorm->value, value_of(d.fnorm_b), eps_, ctx);
}

void MtpHeads::output_backward(size_t j, Tensor& dy, const ops::Context& ctx) {
  MtpDepth& d = depths_[j];
  Tensor no_grad;
  if (j + 1 < depths_.size()) ops::add(dfn_, dfn_, carry_, ctx);  // depth j + 2 read h_{j+1} too
  nn::norm_backward(dy, d.fnorm->grad, d.fnorm_b ? d.fnorm_b->grad : no_grad, dfn_, d.y, d.fnorm->value,
                    value_of(d.fnorm_b), d.f_mean, d.f_rstd, false, ctx);
}

void MtpHeads::input_backward(size_t j, Tensor& dx, const ops::Context& ctx) {
  MtpDepth& d = depths_[j];
  Tensor no_grad;
  dx_c_.copy_from(dx);
  nn::linear_wgrad(d.eh->grad, dx_c_, d.eh_in, 1.0f, 1.0f, eh_proj(d), ctx);
  nn::linear_dgrad(deh_in_, dx_c_, d.eh->compute, 1.0f, 0.0f, eh_proj(d), ctx);
  dn_.copy_from(deh_in_.slice(1, 0, H_));
  nn::norm_backward(dx, d.enorm->grad, d.enorm_b ? d.enorm_b->grad : no_grad, dn_, d.e, d.enorm->value,
                    value_of(d.enorm_b), d.e_mean, d.e_rstd, false, ctx);
  if (d.drop.active()) ops::dropout_backward(dx, dx, d.drop, ctx);
}

void MtpHeads::hnorm_backward(size_t j, const ops::Context& ctx) {
  MtpDepth& d = depths_[j];
  Tensor no_grad;
  dn_.copy_from(deh_in_.slice(1, H_, 2 * H_));
  nn::norm_backward(carry_, d.hnorm->grad, d.hnorm_b ? d.hnorm_b->grad : no_grad, dn_, d.hin, d.hnorm->value,
                    value_of(d.hnorm_b), d.h_mean, d.h_rstd, false, ctx);
}

int64_t MtpHeads::bytes(MemCategory c) const {
  int64_t n = 0;
  auto count = [&](std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t->defined()) n += t->nbytes();
  };
  if (c == MemCategory::activations)
    for (const MtpDepth& d : depths_)
      count({&d.ids, &d.labels, &d.e, &d.hin, &d.x, &d.y, &d.eh_in, &d.h, &d.e_mean, &d.e_rstd, &d.h_mean, &d.h_rstd,
             &d.f_mean, &d.f_rstd});
  if (c != MemCategory::workspace) return n;
  for (const MtpDepth& d : depths_) count({&d.ids_h, &d.labels_h});  // host: the rolled batch before its upload
  count({&dx_c_, &norm_out_, &deh_in_, &carry_, &dn_, &dfn_, &h_full_});
  return n;
}

}  // namespace moecore::model
