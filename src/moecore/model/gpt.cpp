// GPT decoder assembly: parameter table, initialisation, and the step's forward/backward sequence.
#include "moecore/model/gpt.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "moecore/core/rng.h"

namespace moecore::model {
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

GptModel::GptModel(const ModelConfig& cfg, int64_t micro_batch_size, uint64_t seed) : cfg_(cfg), B_(micro_batch_size) {
  cfg_.validate();
  if (B_ <= 0) MOECORE_FAIL("model: micro_batch_size (", B_, ") must be positive");
  const int64_t L = cfg_.num_layers, H = cfg_.hidden_size, V = cfg_.vocab_size, S = cfg_.seq_length;
  const int64_t N = B_ * S, D = cfg_.head_dim(), G = cfg_.query_groups(), R = cfg_.num_attention_heads / G;
  const DType c = cfg_.compute_dtype;
  dims_ = {N, H, cfg_.ffn(), {B_, S, G, R, D}, cfg_.norm_epsilon, cfg_.swiglu, c};

  const float std_w = cfg_.init_method_std;
  const float std_out = std_w / std::sqrt(2.0f * static_cast<float>(L));
  params_.reserve(static_cast<size_t>(3 + 6 * L));
  auto add = [&](std::string name, Shape shape, float std) {
    Param p;
    p.name = std::move(name);
    p.value = Tensor::empty(shape, DType::f32, MemCategory::parameters);
    p.grad = Tensor::zeros(shape, DType::f32, MemCategory::gradients);
    p.weight_decay = shape.ndim >= 2;
    if (std > 0) rng_fill_normal(p.value, seed, p.name, 0.0f, std);
    else p.value.fill_(1.0f);
    p.compute = (c == DType::f32 || !p.weight_decay) ? p.value : Tensor::empty(shape, c, MemCategory::parameters);
    params_.push_back(std::move(p));
    return &params_.back();
  };
  embedding_ = add("embedding.word_embeddings.weight", {V, H}, std_w);
  for (int64_t l = 0; l < L; ++l) {
    const std::string pre = "decoder.layers." + std::to_string(l) + ".";
    add(pre + "input_layernorm.weight", {H}, 0);
    add(pre + "self_attention.linear_qkv.weight", {dims_.qkv.width(), H}, std_w);
    add(pre + "self_attention.linear_proj.weight", {H, dims_.qkv.q_heads() * D}, std_out);
    add(pre + "pre_mlp_layernorm.weight", {H}, 0);
    add(pre + "mlp.linear_fc1.weight", {dims_.fc1_rows(), H}, std_w);
    add(pre + "mlp.linear_fc2.weight", {H, dims_.F}, std_out);
  }
  final_norm_ = add("decoder.final_layernorm.weight", {H}, 0);
  output_ = cfg_.untie_embeddings_and_output_weights ? add("output_layer.weight", {V, H}, std_w) : embedding_;

  for (int64_t l = 0; l < L; ++l) {
    Param* p = &params_[static_cast<size_t>(1 + 6 * l)];
    layer_w_.push_back({p[0].value, p[1].compute, p[2].compute, p[3].value, p[4].compute, p[5].compute});
    layer_g_.push_back({p[0].grad, p[1].grad, p[2].grad, p[3].grad, p[4].grad, p[5].grad});
    caches_.push_back(nn::dense_layer_cache_alloc(dims_));
  }
  for (int64_t l = 0; l <= L; ++l) residual_.push_back(Tensor::empty({N, H}, DType::f32, MemCategory::activations));
  final_rstd_ = Tensor::empty({N}, DType::f32, MemCategory::activations);
  final_h_ = Tensor::empty({N, H}, c, MemCategory::activations);
  rope_ = Tensor::empty({S, D}, DType::f32, MemCategory::workspace);
  ops::rope_table(rope_, cfg_.rotary_base, {});
  ws_ = nn::dense_layer_workspace_alloc(dims_);
  head_ws_ = nn::lm_head_workspace_alloc(N, V, c);
  dres_ = Tensor::empty({N, H}, DType::f32, MemCategory::workspace);
  dh_ = Tensor::empty({N, H}, DType::f32, MemCategory::workspace);
  ids_ = Tensor::empty({N}, DType::i32, MemCategory::workspace);
  labels_ = Tensor::empty({N}, DType::i32, MemCategory::workspace);
  refresh_compute_weights();
}

Param& GptModel::param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  MOECORE_FAIL("model: no parameter named '", name, "'");
}

int64_t GptModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.value.numel();
  return n;
}

void GptModel::zero_grad() {
  for (auto& p : params_) p.grad.zero_();
}

void GptModel::refresh_compute_weights() {
  for (auto& p : params_)
    if (p.compute.raw() != p.value.raw()) p.compute.copy_from(p.value);
}

void GptModel::forward_trunk(const Tensor& tokens) {
  const ops::Context ctx;
  const int64_t N = B_ * cfg_.seq_length;
  if (tokens.dtype() != DType::i32 || tokens.numel() != N)
    MOECORE_FAIL("model: tokens must be i32 [", B_, ", ", cfg_.seq_length, "], got ", tokens.str());
  ids_.copy_from(tokens.view({N}));
  ops::embedding_forward(residual_[0], ids_, embedding_->value, ctx);
  for (size_t l = 0; l < caches_.size(); ++l)
    nn::dense_layer_forward(residual_[l + 1], residual_[l], layer_w_[l], caches_[l], rope_, dims_, ctx);
  ops::rmsnorm_forward(final_h_, final_rstd_, residual_.back(), final_norm_->value, cfg_.norm_epsilon, ctx);
}

LossResult GptModel::forward_backward(const Tensor& tokens, const Tensor& labels, float grad_scale) {
  const ops::Context ctx;
  forward_trunk(tokens);
  const int64_t N = B_ * cfg_.seq_length;
  if (labels.dtype() != DType::i32 || labels.numel() != N)
    MOECORE_FAIL("model: labels must be i32 [", B_, ", ", cfg_.seq_length, "], got ", labels.str());
  labels_.copy_from(labels.view({N}));
  LossResult r;
  const int32_t* lp = labels_.data<int32_t>();
  for (int64_t i = 0; i < N; ++i) r.tokens += lp[i] >= 0;
  const float token_scale = r.tokens ? grad_scale / static_cast<float>(r.tokens) : 0.0f;
  r.loss_sum = nn::lm_head_loss(&dh_, &output_->grad, final_h_, output_->compute, labels_, token_scale, head_ws_, ctx);
  ops::rmsnorm_backward(dres_, final_norm_->grad, dh_, residual_.back(), final_norm_->value, final_rstd_, false, ctx);
  for (size_t l = caches_.size(); l-- > 0;)
    nn::dense_layer_backward(dres_, layer_g_[l], residual_[l], layer_w_[l], caches_[l], ws_, rope_, dims_, ctx);
  ops::embedding_backward(embedding_->grad, ids_, dres_, ctx);
  return r;
}

LossResult GptModel::evaluate(const Tensor& tokens, const Tensor& labels) {
  const ops::Context ctx;
  forward_trunk(tokens);
  const int64_t N = B_ * cfg_.seq_length;
  labels_.copy_from(labels.view({N}));
  LossResult r;
  const int32_t* lp = labels_.data<int32_t>();
  for (int64_t i = 0; i < N; ++i) r.tokens += lp[i] >= 0;
  r.loss_sum = nn::lm_head_loss(nullptr, nullptr, final_h_, output_->compute, labels_, 1.0f, head_ws_, ctx);
  return r;
}

void GptModel::forward_logits(Tensor& logits, const Tensor& tokens) {
  forward_trunk(tokens);
  ops::gemm(logits, final_h_, false, output_->compute, true, 1.0f, 0.0f, {});
}

MemoryPlan GptModel::memory_plan(int64_t optimizer_state_bytes_per_param) const {
  MemoryPlan plan;
  auto at = [&](MemCategory c) -> int64_t& { return plan.bytes[static_cast<int>(c)]; };
  for (const auto& p : params_) {
    at(MemCategory::parameters) += p.value.nbytes() + (p.compute.raw() != p.value.raw() ? p.compute.nbytes() : 0);
    at(MemCategory::gradients) += p.grad.nbytes();
  }
  at(MemCategory::optimizer_state) = optimizer_state_bytes_per_param * num_parameters();
  const int64_t N = dims_.N, H = dims_.H;
  at(MemCategory::activations) = cfg_.num_layers * nn::dense_layer_cache_bytes(dims_) +
                                 (cfg_.num_layers + 1) * N * H * 4 + N * 4 +
                                 N * H * static_cast<int64_t>(dtype_size(cfg_.compute_dtype));
  at(MemCategory::workspace) = nn::dense_layer_workspace_bytes(dims_) +
                               nn::lm_head_workspace_bytes(N, cfg_.vocab_size, cfg_.compute_dtype) + 2 * N * H * 4 +
                               2 * N * 4 + cfg_.seq_length * dims_.qkv.D * 4;
  return plan;
}

double GptModel::flops_per_step() const {
  const double T = static_cast<double>(B_ * cfg_.seq_length), h = static_cast<double>(cfg_.hidden_size);
  const double L = static_cast<double>(cfg_.num_layers), S = static_cast<double>(cfg_.seq_length);
  const double q = static_cast<double>(dims_.qkv.q_heads() * dims_.qkv.D);
  const double kv = static_cast<double>(dims_.qkv.G * dims_.qkv.D);
  const double ffn_mult = cfg_.swiglu ? 3.0 : 2.0;
  const double p_attn = h * (q + 2 * kv) + q * h;
  return T * (6 * h * ffn_mult * static_cast<double>(dims_.F) * L + L * 6 * p_attn +
              6 * h * static_cast<double>(cfg_.vocab_size)) +
         static_cast<double>(B_) * S * S * 6 * q * L;
}

}  // namespace moecore::model
