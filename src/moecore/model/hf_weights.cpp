#include "moecore/model/hf_weights.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "moecore/core/error.h"
#include "moecore/core/shard.h"
#include "moecore/model/param_specs.h"

namespace moecore::model {

HfFamily hf_family_parse(const std::string& model_type) {
  for (HfFamily f : {HfFamily::mixtral, HfFamily::qwen2_moe, HfFamily::qwen3_moe, HfFamily::deepseek_v3})
    if (model_type == hf_family_name(f)) return f;
  MOECORE_FAIL("Hugging Face model_type '", model_type,
               "' is not supported (supported: mixtral, qwen2_moe, qwen3_moe, deepseek_v3)");
}

const char* hf_family_name(HfFamily family) {
  switch (family) {
    case HfFamily::mixtral:
      return "mixtral";
    case HfFamily::qwen2_moe:
      return "qwen2_moe";
    case HfFamily::qwen3_moe:
      return "qwen3_moe";
    case HfFamily::deepseek_v3:
      return "deepseek_v3";
  }
  return "?";
}

HfFamily hf_family_of(const ModelConfig& cfg) {
  if (cfg.multi_latent_attention) return HfFamily::deepseek_v3;
  if (cfg.qk_layernorm) return HfFamily::qwen3_moe;
  if (cfg.add_qkv_bias || cfg.moe.shared_expert_intermediate_size > 0) return HfFamily::qwen2_moe;
  return HfFamily::mixtral;
}

namespace {

void require(bool ok, HfFamily f, const char* what) {
  if (!ok) MOECORE_FAIL("Hugging Face ", hf_family_name(f), " models cannot hold this model: ", what);
}

void check_family(const ModelConfig& c, HfFamily f) {
  const bool qwen2 = f == HfFamily::qwen2_moe, qwen3 = f == HfFamily::qwen3_moe, deepseek = f == HfFamily::deepseek_v3;
  require(c.normalization == Normalization::rmsnorm, f, "--normalization LayerNorm (it uses RMSNorm)");
  require(c.rope() && c.rotary_percent == 1.0f, f, "positions other than RoPE over whole heads");
  require(c.swiglu, f, "a GeLU MLP (it uses SwiGLU: pass --swiglu)");
  require(!c.add_bias_linear, f, "linear-layer biases (pass --disable-bias-linear)");
  require(qwen2 == c.add_qkv_bias, f,
          qwen2 ? "no QKV bias (Qwen2-MoE's q/k/v projections always have one: --add-qkv-bias)"
                : "--add-qkv-bias (only qwen2_moe has q/k/v biases)");
  require(deepseek == c.multi_latent_attention, f,
          deepseek ? "standard attention (DeepSeek-V3 uses --multi-latent-attention)"
                   : "--multi-latent-attention (only deepseek_v3 has MLA)");
  require((qwen3 || deepseek) == c.qk_layernorm, f,
          qwen3      ? "no QK-norm (Qwen3-MoE always normalises q and k: --qk-layernorm)"
          : deepseek ? "no latent norms (DeepSeek-V3 always normalises its q and kv latents: --qk-layernorm)"
                     : "--qk-layernorm (only qwen3_moe has q_norm / k_norm)");
  require(c.moe.enabled(), f, "no routed experts (--num-experts)");
  const int64_t Fs = c.moe.shared_expert_intermediate_size;
  require(deepseek || c.mtp_num_layers == 0, f, "--mtp-num-layers (only deepseek_v3 has MTP layers)");
  if (deepseek) {
    require(!c.moe.shared_expert_gate, f, "--moe-shared-expert-gate (DeepSeek-V3's shared experts are ungated)");
    require(c.moe.enable_expert_bias, f,
            "no expert bias (DeepSeek-V3's router has e_score_correction_bias: --moe-router-enable-expert-bias)");
  } else {
    require(Fs == 0 || (qwen2 && c.moe.shared_expert_gate), f,
            qwen2 ? "a shared expert without --moe-shared-expert-gate (Qwen2-MoE gates it)"
                  : "a shared expert (only qwen2_moe and deepseek_v3 have one)");
    require(!c.moe.enable_expert_bias, f,
            "--moe-router-enable-expert-bias (no expert-bias tensor in this family; DeepSeek-V3 has one)");
  }
  if (f == HfFamily::mixtral) {
    const std::vector<bool> moe = c.moe_layers();
    require(std::all_of(moe.begin(), moe.end(), [](bool m) { return m; }), f,
            "dense layers (every Mixtral layer is MoE: --moe-layer-freq 1)");
    require(c.moe_ffn() == c.ffn(), f,
            "--moe-ffn-hidden-size different from --ffn-hidden-size (Mixtral's experts use intermediate_size)");
  }
}

// DeepSeek's interleaved RoPE channel of our (rotate-half) channel j of dr: pairs (2i, 2i + 1) become (i, i + dr/2).
int64_t deinterleave(int64_t j, int64_t dr, bool interleaved) {
  if (!interleaved) return j;
  return j < dr / 2 ? 2 * j : 2 * (j - dr / 2) + 1;
}

}  // namespace

HfWeightMap hf_weight_map(const ModelConfig& cfg, HfFamily family, bool rope_interleave) {
  cfg.validate();
  check_family(cfg, family);
  HfWeightMap m;
  m.family = family;
  const int64_t H = cfg.hidden_size, D = cfg.head_dim(), G = cfg.query_groups(), R = cfg.num_attention_heads / G;
  const int64_t E = cfg.moe.num_experts, Fm = cfg.moe_ffn(), Fs = cfg.moe.shared_expert_intermediate_size;
  const bool mixtral = family == HfFamily::mixtral, deepseek = family == HfFamily::deepseek_v3;
  const int64_t nh = cfg.num_attention_heads, qr = cfg.q_lora_rank, kvr = cfg.kv_lora_rank;
  const int64_t dn = cfg.qk_head_dim, dr = cfg.qk_pos_emb_head_dim, dv = cfg.v_head_dim;
  std::map<std::string, size_t> tensor_index;
  auto tensor = [&](const std::string& name, Shape shape) {
    tensor_index[name] = m.tensors.size();
    HfTensorSpec& t = m.tensors.emplace_back();
    t.name = name;
    t.shape = shape;
  };
  // HF tensors in transformers' module order, with their shapes.
  tensor("model.embed_tokens.weight", {cfg.vocab_size, H});
  const std::vector<bool> moe_layers = cfg.moe_layers();
  // One DeepSeek-V3 decoder layer's tensors under `pre` (layer: its index in moecore's per-layer arrays).
  auto deepseek_layer = [&](const std::string& pre, bool is_moe, int64_t layer) {
    if (qr) {
      tensor(pre + "self_attn.q_a_proj.weight", {qr, H});
      tensor(pre + "self_attn.q_a_layernorm.weight", {qr});
      tensor(pre + "self_attn.q_b_proj.weight", {nh * (dn + dr), qr});
    } else {
      tensor(pre + "self_attn.q_proj.weight", {nh * (dn + dr), H});
    }
    tensor(pre + "self_attn.kv_a_proj_with_mqa.weight", {kvr + dr, H});
    tensor(pre + "self_attn.kv_a_layernorm.weight", {kvr});
    tensor(pre + "self_attn.kv_b_proj.weight", {nh * (dn + dv), kvr});
    tensor(pre + "self_attn.o_proj.weight", {H, nh * dv});
    if (is_moe) {
      tensor(pre + "mlp.gate.weight", {E, H});
      tensor(pre + "mlp.gate.e_score_correction_bias", {E});
      m.tensors.back().expert_bias_layer = layer;
      for (int64_t e = 0; e < E; ++e) {
        const std::string ex = pre + "mlp.experts." + std::to_string(e) + ".";
        tensor(ex + "gate_proj.weight", {Fm, H});
        tensor(ex + "up_proj.weight", {Fm, H});
        tensor(ex + "down_proj.weight", {H, Fm});
      }
      if (Fs > 0) {
        tensor(pre + "mlp.shared_experts.gate_proj.weight", {Fs, H});
        tensor(pre + "mlp.shared_experts.up_proj.weight", {Fs, H});
        tensor(pre + "mlp.shared_experts.down_proj.weight", {H, Fs});
      }
    } else {
      tensor(pre + "mlp.gate_proj.weight", {cfg.ffn(), H});
      tensor(pre + "mlp.up_proj.weight", {cfg.ffn(), H});
      tensor(pre + "mlp.down_proj.weight", {H, cfg.ffn()});
    }
    tensor(pre + "input_layernorm.weight", {H});
    tensor(pre + "post_attention_layernorm.weight", {H});
  };
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    if (deepseek) {
      deepseek_layer(pre, moe_layers[static_cast<size_t>(l)], l);
      continue;
    }
    tensor(pre + "self_attn.q_proj.weight", {G * R * D, H});
    tensor(pre + "self_attn.k_proj.weight", {G * D, H});
    tensor(pre + "self_attn.v_proj.weight", {G * D, H});
    if (cfg.add_qkv_bias) {
      tensor(pre + "self_attn.q_proj.bias", {G * R * D});
      tensor(pre + "self_attn.k_proj.bias", {G * D});
      tensor(pre + "self_attn.v_proj.bias", {G * D});
    }
    tensor(pre + "self_attn.o_proj.weight", {H, G * R * D});
    if (cfg.qk_layernorm) {
      tensor(pre + "self_attn.q_norm.weight", {D});
      tensor(pre + "self_attn.k_norm.weight", {D});
    }
    const std::string moe = pre + (mixtral ? "block_sparse_moe." : "mlp.");
    if (moe_layers[static_cast<size_t>(l)]) {
      tensor(moe + "gate.weight", {E, H});
      for (int64_t e = 0; e < E; ++e) {
        const std::string ex = moe + "experts." + std::to_string(e) + ".";
        tensor(ex + (mixtral ? "w1.weight" : "gate_proj.weight"), {Fm, H});
        tensor(ex + (mixtral ? "w2.weight" : "down_proj.weight"), {H, Fm});
        tensor(ex + (mixtral ? "w3.weight" : "up_proj.weight"), {Fm, H});
      }
      if (Fs > 0) {
        tensor(moe + "shared_expert.gate_proj.weight", {Fs, H});
        tensor(moe + "shared_expert.up_proj.weight", {Fs, H});
        tensor(moe + "shared_expert.down_proj.weight", {H, Fs});
        tensor(moe + "shared_expert_gate.weight", {1, H});
      }
    } else {
      tensor(pre + "mlp.gate_proj.weight", {cfg.ffn(), H});
      tensor(pre + "mlp.up_proj.weight", {cfg.ffn(), H});
      tensor(pre + "mlp.down_proj.weight", {H, cfg.ffn()});
    }
    tensor(pre + "input_layernorm.weight", {H});
    tensor(pre + "post_attention_layernorm.weight", {H});
  }
  // DeepSeek-V3's MTP depths are layers num_layers + k of the checkpoint, with copies of the shared embedding and
  // output head (one parameter each in moecore, as in Megatron).
  const std::string head = cfg.untie_embeddings_and_output_weights ? "lm_head.weight" : "model.embed_tokens.weight";
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k) {
    const int64_t l = cfg.num_layers + k;
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    tensor(pre + "embed_tokens.weight", {cfg.vocab_size, H});
    m.tensors.back().copy_of = "model.embed_tokens.weight";
    tensor(pre + "enorm.weight", {H});
    tensor(pre + "hnorm.weight", {H});
    tensor(pre + "eh_proj.weight", {H, 2 * H});
    deepseek_layer(pre, moe_layers.back(), l);
    tensor(pre + "shared_head.norm.weight", {H});
    tensor(pre + "shared_head.head.weight", {cfg.vocab_size, H});
    m.tensors.back().copy_of = head;
  }
  tensor("model.norm.weight", {H});
  if (cfg.untie_embeddings_and_output_weights) tensor("lm_head.weight", {cfg.vocab_size, H});

  // Each parameter's runs.
  for (const ParamSpec& s : parameter_specs(cfg)) {
    HfParamMap p;
    p.param = s.name;
    p.shape = s.shape;
    p.width = io::hf_row_width(s.shape);
    p.expert = s.expert;
    int64_t row = 0;
    auto run = [&](const std::string& hf, int64_t hf_row, int64_t rows) {
      p.runs.push_back({hf, hf_row, row, rows});
      row += rows;
    };
    auto whole = [&](const std::string& hf) {
      const Shape& t = m.tensors.at(tensor_index.at(hf)).shape;
      run(hf, 0, t.numel() / io::hf_row_width(t));
    };
    // DeepSeek's dr RoPE rows starting at HF row `first`, in moecore's rotate-half channel order.
    auto rope_rows = [&](const std::string& hf, int64_t first) {
      for (int64_t j = 0; j < dr; ++j) run(hf, first + deinterleave(j, dr, rope_interleave), 1);
    };
    const std::string& n = s.name;
    auto ends = [&](const char* suffix) { return n.ends_with(suffix); };
    std::string layer, hpre, moe;
    if (n.starts_with("decoder.layers.")) {
      layer = n.substr(15, n.find('.', 15) - 15);
    } else if (n.starts_with("mtp.layers.")) {  // MTP depth k: checkpoint layer num_layers + k
      layer = std::to_string(cfg.num_layers + std::stoll(n.substr(11, n.find('.', 11) - 11)));
    }
    if (!layer.empty()) {
      hpre = "model.layers." + layer + ".";
      moe = hpre + (mixtral ? "block_sparse_moe." : "mlp.");
    }
    const bool mtp_own = n.starts_with("mtp.layers.") && n.find(".transformer_layer.") == std::string::npos;
    if (mtp_own && ends(".enorm.weight")) {
      whole(hpre + "enorm.weight");
    } else if (mtp_own && ends(".hnorm.weight")) {
      whole(hpre + "hnorm.weight");
    } else if (mtp_own && ends(".eh_proj.weight")) {
      whole(hpre + "eh_proj.weight");
    } else if (mtp_own && ends(".final_layernorm.weight")) {
      whole(hpre + "shared_head.norm.weight");
    } else if (n == "embedding.word_embeddings.weight") {
      whole("model.embed_tokens.weight");
    } else if (n == "decoder.final_layernorm.weight") {
      whole("model.norm.weight");
    } else if (n == "output_layer.weight") {
      whole("lm_head.weight");
    } else if (ends(".input_layernorm.weight")) {
      whole(hpre + "input_layernorm.weight");
    } else if (ends(".pre_mlp_layernorm.weight")) {
      whole(hpre + "post_attention_layernorm.weight");
    } else if (ends(".self_attention.linear_qkv.weight") || ends(".self_attention.linear_qkv.bias")) {
      const std::string kind = ends(".weight") ? ".weight" : ".bias";
      for (int64_t g = 0; g < G; ++g) {  // per group: R query heads, its key head, its value head
        run(hpre + "self_attn.q_proj" + kind, g * R * D, R * D);
        run(hpre + "self_attn.k_proj" + kind, g * D, D);
        run(hpre + "self_attn.v_proj" + kind, g * D, D);
      }
    } else if (ends(".self_attention.linear_q_proj.weight") || ends(".self_attention.linear_q_up_proj.weight")) {
      const std::string hf = hpre + (qr ? "self_attn.q_b_proj.weight" : "self_attn.q_proj.weight");
      for (int64_t h = 0; h < nh; ++h) {  // per head [nope | rope], the rope channels de-interleaved
        run(hf, h * (dn + dr), dn);
        rope_rows(hf, h * (dn + dr) + dn);
      }
    } else if (ends(".self_attention.linear_q_down_proj.weight")) {
      whole(hpre + "self_attn.q_a_proj.weight");
    } else if (ends(".self_attention.q_layernorm.weight") && deepseek) {
      whole(hpre + "self_attn.q_a_layernorm.weight");
    } else if (ends(".self_attention.linear_kv_down_proj.weight")) {
      const std::string hf = hpre + "self_attn.kv_a_proj_with_mqa.weight";
      run(hf, 0, kvr);
      rope_rows(hf, kvr);
    } else if (ends(".self_attention.kv_layernorm.weight")) {
      whole(hpre + "self_attn.kv_a_layernorm.weight");
    } else if (ends(".self_attention.linear_kv_up_proj.weight")) {
      whole(hpre + "self_attn.kv_b_proj.weight");
    } else if (ends(".self_attention.linear_proj.weight")) {
      whole(hpre + "self_attn.o_proj.weight");
    } else if (ends(".self_attention.q_layernorm.weight")) {
      whole(hpre + "self_attn.q_norm.weight");
    } else if (ends(".self_attention.k_layernorm.weight")) {
      whole(hpre + "self_attn.k_norm.weight");
    } else if (ends(".mlp.linear_fc1.weight")) {
      whole(hpre + "mlp.gate_proj.weight");
      whole(hpre + "mlp.up_proj.weight");
    } else if (ends(".mlp.linear_fc2.weight")) {
      whole(hpre + "mlp.down_proj.weight");
    } else if (ends(".mlp.router.weight")) {
      whole(moe + "gate.weight");
    } else if (ends(".mlp.experts.linear_fc1.weight")) {
      for (int64_t e = 0; e < E; ++e) {
        const std::string ex = moe + "experts." + std::to_string(e) + ".";
        whole(ex + (mixtral ? "w1.weight" : "gate_proj.weight"));
        whole(ex + (mixtral ? "w3.weight" : "up_proj.weight"));
      }
    } else if (ends(".mlp.experts.linear_fc2.weight")) {
      for (int64_t e = 0; e < E; ++e)
        whole(moe + "experts." + std::to_string(e) + "." + (mixtral ? "w2.weight" : "down_proj.weight"));
    } else if (ends(".mlp.shared_experts.linear_fc1.weight")) {
      const std::string shared = moe + (deepseek ? "shared_experts." : "shared_expert.");
      whole(shared + "gate_proj.weight");
      whole(shared + "up_proj.weight");
    } else if (ends(".mlp.shared_experts.linear_fc2.weight")) {
      whole(moe + (deepseek ? "shared_experts." : "shared_expert.") + "down_proj.weight");
    } else if (ends(".mlp.shared_experts.gate_weight")) {
      whole(moe + "shared_expert_gate.weight");
    } else {
      MOECORE_FAIL("Hugging Face ", hf_family_name(family), ": no HF tensor for parameter '", n, "'");
    }
    MOECORE_CHECK(row == p.rows(), "HF map of '", n, "' covers ", row, " of ", p.rows(), " rows");
    m.params.push_back(std::move(p));
  }
  for (size_t i = 0; i < m.params.size(); ++i)
    for (size_t r = 0; r < m.params[i].runs.size(); ++r) {
      HfTensorSpec& t = m.tensors.at(tensor_index.at(m.params[i].runs[r].hf));
      MOECORE_CHECK(io::hf_row_width(t.shape) == m.params[i].width, "width of ", t.name, " vs ", m.params[i].param);
      t.sources.emplace_back(i, r);
    }
  for (HfTensorSpec& t : m.tensors) {
    if (t.expert_bias_layer >= 0 || !t.copy_of.empty()) continue;
    std::sort(t.sources.begin(), t.sources.end(), [&](const auto& a, const auto& b) {
      return m.params[a.first].runs[a.second].hf_row < m.params[b.first].runs[b.second].hf_row;
    });
    int64_t covered = 0;
    for (const auto& [pi, ri] : t.sources) covered += m.params[pi].runs[ri].rows;
    MOECORE_CHECK(covered * io::hf_row_width(t.shape) == t.shape.numel(), "HF tensor ", t.name, " covered ", covered);
  }
  return m;
}

HfWeightMap hf_weight_map_without_mtp(const ModelConfig& cfg, HfFamily family, bool rope_interleave) {
  ModelConfig main = cfg;
  main.mtp_num_layers = 0;
  HfWeightMap m = hf_weight_map(main, family, rope_interleave);
  std::set<std::string> read;
  for (const HfParamMap& p : m.params) read.insert(p.param);
  for (const ParamSpec& s : parameter_specs(cfg))
    if (!read.count(s.name)) m.initialised.push_back(s.name);
  return m;
}

void hf_check_tensors(const HfWeightMap& map, const io::HfCheckpointReader& hf) {
  std::map<std::string, const HfTensorSpec*> want;
  for (const HfTensorSpec& t : map.tensors) want[t.name] = &t;
  for (const io::HfTensorInfo& t : hf.tensors()) {
    auto it = want.find(t.name);
    if (it == want.end() && t.name.ends_with("_scale_inv") &&
        want.count(t.name.substr(0, t.name.size() - 10)))  // DeepSeek-V3's FP8 block scales, read with the weight
      continue;
    if (it == want.end())
      MOECORE_FAIL("hf checkpoint '", hf.dir(), "': tensor '", t.name, "' (in '", t.shard, "') is not part of a ",
                   hf_family_name(map.family),
                   " model with this config; hint: check config.json against the weights (layers, experts, "
                   "tie_word_embeddings, mlp_only_layers)");
    if (!(t.shape == it->second->shape))
      MOECORE_FAIL("hf checkpoint '", hf.dir(), "': tensor '", t.name, "' in '", t.shard, "' has shape ", t.shape.str(),
                   " but config.json implies ", it->second->shape.str());
    if (!t.type || !dtype_is_float(*t.type))
      MOECORE_FAIL("hf checkpoint '", hf.dir(), "': tensor '", t.name, "' in '", t.shard, "' has dtype ", t.dtype_name,
                   ", expected a float dtype (F32, BF16, F16, or F8_E4M3 with a block scale)");
  }
  for (const HfTensorSpec& t : map.tensors)
    if (!hf.contains(t.name))
      MOECORE_FAIL("hf checkpoint '", hf.dir(), "' lacks tensor '", t.name, "' ", t.shape.str(), " of the ",
                   hf_family_name(map.family), " model its config.json describes");
}

namespace {
// Rows per part: at most kHfPartElements elements (at least one row).
int64_t part_rows(int64_t width) {
  return std::max<int64_t>(1, kHfPartElements / std::max<int64_t>(width, 1));
}
}  // namespace

void hf_read_param_rows(const HfParamMap& map, const io::HfCheckpointReader& hf, int64_t first_row, int64_t last_row,
                        const std::function<void(const Tensor& part)>& sink) {
  MOECORE_CHECK(0 <= first_row && first_row <= last_row && last_row <= map.rows(), "rows [", first_row, ", ", last_row,
                ") of ", map.param);
  const int64_t step = part_rows(map.width);
  std::string scaled_name;  // FP8 block-scaled weights are dequantised whole, once per parameter
  Tensor scaled;
  for (const HfRowRun& r : map.runs) {
    const int64_t a = std::max(first_row, r.param_row), b = std::min(last_row, r.param_row + r.rows);
    if (a < b && hf.block_scaled(r.hf) && scaled_name != r.hf) {
      scaled = hf.read_dequantized(r.hf);
      scaled_name = r.hf;
    }
    for (int64_t x = a; x < b; x += step) {
      const int64_t first = r.hf_row + (x - r.param_row), n = std::min(step, b - x);
      sink(scaled_name == r.hf ? scaled.slice(0, first, first + n) : hf.read_rows(r.hf, first, n, DType::f32));
    }
  }
}

void hf_check_copies(const HfWeightMap& map, const io::HfCheckpointReader& hf) {
  for (const HfTensorSpec& t : map.tensors) {
    if (t.copy_of.empty()) continue;
    const int64_t width = io::hf_row_width(t.shape), rows = t.shape.numel() / width;
    const int64_t step = part_rows(width);
    for (int64_t r = 0; r < rows; r += step) {
      const int64_t n = std::min(step, rows - r);
      const Tensor a = hf.read_rows(t.name, r, n), b = hf.read_rows(t.copy_of, r, n);
      if (a.dtype() != b.dtype() || std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) != 0)
        MOECORE_FAIL("hf checkpoint '", hf.dir(), "': tensor '", t.name, "' differs from '", t.copy_of, "' (rows [", r,
                     ", ", r + n,
                     ")); moecore shares one parameter between them, as Megatron's MTP shares the main model's "
                     "embedding and output layer");
    }
  }
}

void hf_import(const HfWeightMap& map, const io::HfCheckpointReader& hf, GptModel& gpt) {
  hf_check_copies(map, hf);
  std::vector<Param>& params = gpt.params();  // (a pipeline stage's: a subset of the map's, by name)
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < map.params.size(); ++i) by_name[map.params[i].param] = i;
  const std::set<std::string> initialised(map.initialised.begin(), map.initialised.end());
  MOECORE_CHECK(gpt.parallel().pp.size() > 1 || params.size() == map.params.size() + initialised.size(), params.size(),
                " parameters for a map of ", map.params.size(), " + ", initialised.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (initialised.count(params[i].name)) continue;
    const auto found = by_name.find(params[i].name);
    MOECORE_CHECK(found != by_name.end(), "parameter ", params[i].name, " is not in the HF map");
    const HfParamMap& m = map.params[found->second];
    Tensor& v = params[i].value;
    const TensorShard& tp = params[i].tp;
    if (tp.sharded()) {  // a tensor-parallel shard: the whole tensor (this rank's experts) on the host, then its part
      Tensor whole = Tensor::empty(tp.global_shape(v.shape()), DType::f32, MemCategory::workspace);
      const Tensor flat = whole.view({whole.numel()});
      const int64_t rows = whole.numel() / m.width, first = m.expert ? gpt.ep_rank() * rows : 0;
      int64_t at = 0;
      hf_read_param_rows(m, hf, first, first + rows, [&](const Tensor& part) {
        flat.slice(0, at, at + part.numel()).copy_from(part.view({part.numel()}));
        at += part.numel();
      });
      v.copy_from(shard_slice(whole, tp));
      continue;
    }
    const int64_t local_rows = v.numel() / m.width, first = m.expert ? gpt.ep_rank() * local_rows : 0;
    int64_t at = 0;
    const Tensor flat = v.view({v.numel()});
    hf_read_param_rows(m, hf, first, first + local_rows, [&](const Tensor& part) {
      // Host parts into the parameter (a transfer when it lives on a device).
      flat.slice(0, at, at + part.numel()).copy_from(part.view({part.numel()}));
      at += part.numel();
    });
  }
  for (const HfTensorSpec& t : map.tensors) {
    if (t.expert_bias_layer < 0 || gpt.chunk_of_layer(t.expert_bias_layer) < 0) continue;  // (another stage's)
    moe::RouterState* st = gpt.router_state(t.expert_bias_layer);
    MOECORE_CHECK(st && st->expert_bias.defined(), "layer ", t.expert_bias_layer, " has no expert bias");
    st->expert_bias.copy_from(hf.read(t.name, DType::f32));
  }
  gpt.refresh_compute_weights();
}

void hf_gather_parts(const HfWeightMap& map, const HfTensorSpec& tensor,
                     const std::function<Tensor(size_t param, int64_t first_row, int64_t rows)>& rows,
                     const std::function<void(const Tensor& part)>& sink) {
  if (!tensor.copy_of.empty()) {
    for (const HfTensorSpec& t : map.tensors)
      if (t.name == tensor.copy_of) return hf_gather_parts(map, t, rows, sink);
    MOECORE_CHECK(false, "no tensor ", tensor.copy_of, " to copy into ", tensor.name);
  }
  for (const auto& [pi, ri] : tensor.sources) {
    const HfRowRun& r = map.params[pi].runs[ri];
    const int64_t step = part_rows(map.params[pi].width);
    for (int64_t x = 0; x < r.rows; x += step) sink(rows(pi, r.param_row + x, std::min(step, r.rows - x)));
  }
}

Tensor hf_gather(const HfWeightMap& map, const HfTensorSpec& tensor,
                 const std::function<Tensor(size_t param, int64_t first_row, int64_t rows)>& rows) {
  Tensor out = Tensor::empty(tensor.shape, DType::f32, MemCategory::other);
  int64_t at = 0;
  hf_gather_parts(map, tensor, rows, [&](const Tensor& part) {
    MOECORE_CHECK(part.dtype() == DType::f32 && part.is_contiguous(), "hf_gather parts are contiguous f32");
    std::copy_n(part.data<float>(), part.numel(), out.data<float>() + at);
    at += part.numel();
  });
  return out;
}

}  // namespace moecore::model
