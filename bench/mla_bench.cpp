#include "bench/mla_bench.h"

#include <algorithm>

#include "bench/bench_util.h"
#include "moecore/core/rng.h"
#include "moecore/model/param_specs.h"
#include "moecore/nn/mla.h"

namespace moecore::bench {

std::vector<std::string> bench_mla_lines(const MlaBenchShape& s, DType dtype, int iters) {
  nn::MlaDims md{s.B, s.S, s.H, s.heads, s.q_lora, s.kv_lora, s.dn, s.dr, s.dv, true, 1.0f};
  const int64_t N = md.N(), H = s.H;
  nn::DenseLayerDims d;
  d.N = N;
  d.H = H;
  d.F = 1;
  d.qkv = md.qkv();
  d.compute = dtype;
  auto weight = [&](Shape shape, const char* name, float std) {
    Tensor t = Tensor::empty(shape, DType::f32, MemCategory::parameters);
    rng_fill_normal(t, 3, name, 0.0f, std);
    return t.to(dtype, MemCategory::parameters);
  };
  auto ones = [&](int64_t n) {
    Tensor t = Tensor::empty({n}, DType::f32, MemCategory::parameters);
    t.fill_(1.0f);
    return t;
  };
  nn::DenseLayerWeights w;
  w.input_norm = ones(H);
  w.proj = weight({H, s.heads * s.dv}, "proj", 0.02f);
  nn::MlaWeights m;
  if (s.q_lora) {
    m.q_down = weight({s.q_lora, H}, "q_down", 0.02f);
    m.q_up = weight({md.q_width(), s.q_lora}, "q_up", 0.05f);
    m.q_norm = ones(s.q_lora);
  } else {
    m.q = weight({md.q_width(), H}, "q", 0.02f);
  }
  m.kv_down = weight({s.kv_lora + s.dr, H}, "kv_down", 0.02f);
  m.kv_up = weight({md.kv_width(), s.kv_lora}, "kv_up", 0.05f);
  m.kv_norm = ones(s.kv_lora);
  auto grad_like = [](const Tensor& t) {
    return t.defined() ? Tensor::zeros(t.shape(), DType::f32, MemCategory::gradients) : Tensor();
  };
  nn::DenseLayerGrads g;
  g.input_norm = grad_like(w.input_norm);
  g.proj = grad_like(w.proj);
  nn::MlaGrads mg{grad_like(m.q),
                  grad_like(m.q_down),
                  grad_like(m.q_up),
                  grad_like(m.q_norm),
                  grad_like(m.kv_down),
                  grad_like(m.kv_norm),
                  grad_like(m.kv_up),
                  Tensor(),
                  Tensor()};
  nn::DenseLayerCache k = nn::dense_layer_cache_alloc(d, /*with_mlp=*/false, /*with_attention=*/false);
  nn::DenseLayerWorkspace ws = nn::dense_layer_workspace_alloc(d, /*with_attention=*/false);
  nn::MlaCache mc = nn::mla_cache_alloc(md, dtype, false);
  nn::MlaWorkspace mw = nn::mla_workspace_alloc(md, dtype);
  Tensor x = Tensor::empty({N, H}, DType::f32, MemCategory::activations);
  rng_fill_normal(x, 3, "x", 0.0f, 1.0f);
  Tensor dres = Tensor::empty({N, H}, DType::f32, MemCategory::workspace);
  Tensor rope = Tensor::empty({s.S, s.dr}, DType::f32, MemCategory::workspace);
  ops::rope_table(rope, 10000.0f, {});
  const nn::LayerDropout drop;
  const double peak = gemm_peak_gflops(dtype);
  double fwd = 1e30, both = 1e30;
  for (int it = 0; it <= std::max(iters, 1); ++it) {  // iteration 0 warms up
    rng_fill_normal(dres, 4, "dy", 0.0f, 1.0f);
    const double t0 = now_seconds();
    nn::mla_block_forward(x, w, m, k, mc, ws, mw, rope, d, md, drop, {});
    const double t1 = now_seconds();
    nn::mla_block_backward(dres, g, mg, x, w, m, k, mc, ws, mw, rope, d, md, drop, {});
    const double t2 = now_seconds();
    if (it == 0) continue;
    fwd = std::min(fwd, t1 - t0);
    both = std::min(both, t2 - t0);
  }
  model::ModelConfig cfg;  // the shape as a model config, for the model's own FLOPs formula
  cfg.hidden_size = H;
  cfg.num_attention_heads = s.heads;
  cfg.seq_length = s.S;
  cfg.multi_latent_attention = true;
  cfg.q_lora_rank = s.q_lora;
  cfg.kv_lora_rank = s.kv_lora;
  cfg.qk_head_dim = s.dn;
  cfg.qk_pos_emb_head_dim = s.dr;
  cfg.v_head_dim = s.dv;
  const model::AttentionCost a = model::attention_cost(cfg, model::AttentionKind::mla);
  const double flops_fwd =
      2 * static_cast<double>(N) * a.p_attn + 2 * static_cast<double>(s.B * s.S) * static_cast<double>(s.S) * a.a_core;
  std::vector<std::string> lines;
  for (const auto& [name, flops, secs] :
       {std::tuple{"mla_fwd", flops_fwd, fwd}, std::tuple{"mla_fwd_bwd", 3 * flops_fwd, both}}) {
    const double gflops = flops / secs / 1e9;
    lines.push_back(JsonLine()
                        .add("name", name)
                        .add("dtype", std::string(dtype_name(dtype)))
                        .add("B", s.B)
                        .add("S", s.S)
                        .add("H", s.H)
                        .add("heads", s.heads)
                        .add("q_lora", s.q_lora)
                        .add("kv_lora", s.kv_lora)
                        .add("qk_head_dim", s.dn)
                        .add("qk_pos_emb_head_dim", s.dr)
                        .add("v_head_dim", s.dv)
                        .add("gflops", gflops)
                        .add("peak_gflops", peak)
                        .add("ratio", gflops / peak)
                        .add("seconds", secs)
                        .str());
  }
  return lines;
}

}  // namespace moecore::bench
