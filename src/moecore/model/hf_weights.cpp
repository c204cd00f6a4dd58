#include "moecore/model/hf_weights.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "moecore/core/error.h"
#include "moecore/core/shard.h"
#include "moecore/model/param_specs.h"

namespace moecore::model {

namespace {

enum class Need : uint8_t { no, optional, yes };

// What a family's modeling code has: the one table the checks, the family guess and the weight names read.
struct FamilyTraits {
  HfFamily family;
  const char* model_type;
  bool mla;                   // multi-latent attention (q/kv LoRA), else standard GQA attention
  Need qkv_bias;              // q/k/v projection biases
  Need qk_norm;               // standard: q_norm / k_norm per head; MLA: the q_a / kv_a latent norms (always)
  bool qk_over_heads;         // q_norm / k_norm over each token's whole q / k projection (--qk-layernorm-over-heads)
  bool partial_rope;          // RoPE over part of each head (partial_rotary_factor)
  Need shared;                // a shared expert
  bool shared_gated;          // its sigmoid gate (shared_expert_gate)
  bool expert_bias;           // sigmoid routing with e_score_correction_bias (the router's expert bias)
  bool mtp;                   // multi-token-prediction layers after the decoder layers
  bool dense_layers;          // dense (non-MoE) decoder layers
  bool biases;                // every linear layer's bias (--add-bias-linear: q/k/v/o, router, experts), GPT-OSS
  bool fused_experts;         // GPT-OSS: experts.gate_up_proj [E, H, 2F] (gate and up interleaved), down_proj [E, F, H]
  const char* moe;            // the MoE block's module under a layer
  const char* router_module;  // its router's
  const char* shared_module;
  const char* gate_up_down[3];  // the experts' gate / up / down projections
};

// clang-format off
constexpr FamilyTraits kFamilies[] = {
  // family               model_type     mla    qkv_bias        qk_norm         over   partial shared          gated  bias   mtp    dense  biases fused  moe block            router     shared module      experts' gate / up / down
  {HfFamily::mixtral,     "mixtral",     false, Need::no,       Need::no,       false, false,  Need::no,       false, false, false, false, false, false, "block_sparse_moe.", "gate.",   "",                {"w1", "w3", "w2"}},
  {HfFamily::qwen2_moe,   "qwen2_moe",   false, Need::yes,      Need::no,       false, false,  Need::optional, true,  false, false, true,  false, false, "mlp.",              "gate.",   "shared_expert.",  {"gate_proj", "up_proj", "down_proj"}},
  {HfFamily::qwen3_moe,   "qwen3_moe",   false, Need::no,       Need::yes,      false, false,  Need::no,       false, false, false, true,  false, false, "mlp.",              "gate.",   "",                {"gate_proj", "up_proj", "down_proj"}},
  {HfFamily::deepseek_v3, "deepseek_v3", true,  Need::no,       Need::yes,      false, false,  Need::optional, false, true,  true,  true,  false, false, "mlp.",              "gate.",   "shared_experts.", {"gate_proj", "up_proj", "down_proj"}},
  {HfFamily::deepseek_v2, "deepseek_v2", true,  Need::no,       Need::yes,      false, false,  Need::yes,      false, false, false, true,  false, false, "mlp.",              "gate.",   "shared_experts.", {"gate_proj", "up_proj", "down_proj"}},
  {HfFamily::glm4_moe,    "glm4_moe",    false, Need::optional, Need::optional, false, true,   Need::yes,      false, true,  true,  true,  false, false, "mlp.",              "gate.",   "shared_experts.", {"gate_proj", "up_proj", "down_proj"}},
  {HfFamily::olmoe,       "olmoe",       false, Need::no,       Need::yes,      true,  false,  Need::no,       false, false, false, false, false, false, "mlp.",              "gate.",   "",                {"gate_proj", "up_proj", "down_proj"}},
  {HfFamily::gpt_oss,     "gpt_oss",     false, Need::no,       Need::no,       false, false,  Need::no,       false, false, false, false, true,  true,  "mlp.",              "router.", "",                {"gate_up_proj", "gate_up_proj", "down_proj"}},
};
// clang-format on

const FamilyTraits& traits(HfFamily f) {
  for (const FamilyTraits& t : kFamilies)
    if (t.family == f) return t;
  MOECORE_FAIL("unknown Hugging Face family ", static_cast<int>(f));
}

std::string supported_list() {
  std::string s;
  for (const FamilyTraits& t : kFamilies) s += (s.empty() ? "" : ", ") + std::string(t.model_type);
  return s;
}

}  // namespace

HfFamily hf_family_parse(const std::string& model_type) {
  for (const FamilyTraits& t : kFamilies)
    if (model_type == t.model_type) return t.family;
  MOECORE_FAIL("Hugging Face model_type '", model_type, "' is not supported (supported: ", supported_list(), ")");
}

const char* hf_family_name(HfFamily family) {
  return traits(family).model_type;
}

HfFamily hf_family_of(const ModelConfig& cfg) {
  if (cfg.softmax_type == SoftmaxType::learnable || cfg.quick_geglu) return HfFamily::gpt_oss;
  if (cfg.multi_latent_attention) return cfg.moe.enable_expert_bias ? HfFamily::deepseek_v3 : HfFamily::deepseek_v2;
  if (cfg.moe.enable_expert_bias || cfg.rotary_percent != 1.0f) return HfFamily::glm4_moe;
  if (cfg.qk_layernorm_over_heads) return HfFamily::olmoe;
  if (cfg.qk_layernorm) return HfFamily::qwen3_moe;
  if (cfg.add_qkv_bias || cfg.moe.shared_expert_intermediate_size > 0) return HfFamily::qwen2_moe;
  return HfFamily::mixtral;
}

namespace {

void require(bool ok, HfFamily f, const char* what) {
  if (!ok) MOECORE_FAIL("Hugging Face ", hf_family_name(f), " models cannot hold this model: ", what);
}

// `has` is allowed by `need`; else the error names the flag and which families have it.
void require_need(Need need, bool has, HfFamily f, const std::string& flag, const char* families) {
  if (need == Need::yes && !has)
    MOECORE_FAIL("Hugging Face ", hf_family_name(f), " models cannot hold this model: no ", flag, " (", families,
                 " always have it)");
  if (need == Need::no && has)
    MOECORE_FAIL("Hugging Face ", hf_family_name(f), " models cannot hold this model: ", flag, " (only ", families,
                 " have it)");
}

void check_family(const ModelConfig& c, HfFamily f) {
  const FamilyTraits& t = traits(f);
  require(c.normalization == Normalization::rmsnorm, f, "--normalization LayerNorm (it uses RMSNorm)");
  require(c.rope() && (t.partial_rope || c.rotary_percent == 1.0f), f,
          t.partial_rope ? "positions other than RoPE" : "positions other than RoPE over whole heads");
  require(c.swiglu, f, "a GeLU MLP (it uses SwiGLU: pass --swiglu)");
  const ops::GluParams glu = c.glu_params();
  if (f != HfFamily::gpt_oss)
    require(glu == ops::GluParams{}, f,
            "--quick-geglu, --glu-linear-offset or --activation-func-clamp-value (its MLPs are plain SwiGLU)");
  require(t.biases == c.add_bias_linear, f,
          t.biases ? "no linear-layer biases (its q/k/v/o projections, router and experts have them: drop "
                     "--disable-bias-linear)"
                   : "linear-layer biases (pass --disable-bias-linear)");
  if (f == HfFamily::gpt_oss)
    require(c.quick_geglu && glu.offset == 1.0f && glu.clamp > 0.0f, f,
            "an MLP other than its clamped quick-GEGLU (--quick-geglu --glu-linear-offset 1 "
            "--activation-func-clamp-value L)");
  require(!c.yarn || t.mla || f == HfFamily::gpt_oss, f, "YaRN RoPE (only deepseek_v2/v3 and gpt_oss carry it)");
  const bool gpt_oss = f == HfFamily::gpt_oss;
  require(gpt_oss == (c.softmax_type == SoftmaxType::learnable), f,
          gpt_oss ? "no learnable attention sinks (its attention has them: --softmax-type learnable)"
                  : "--softmax-type other than vanilla (only gpt_oss has attention sinks, learnable ones)");
  require(gpt_oss || c.window_size < 0, f, "--window-size (only gpt_oss has sliding-window layers)");
  require(t.mla == c.multi_latent_attention, f,
          t.mla ? "standard attention (it uses --multi-latent-attention)"
                : "--multi-latent-attention (only deepseek_v2 and deepseek_v3 have MLA)");
  require_need(t.qkv_bias, c.add_qkv_bias, f, "--add-qkv-bias (q/k/v biases)", "qwen2_moe and glm4_moe");
  require_need(t.qk_norm, c.qk_layernorm, f,
               t.mla ? "--qk-layernorm (the q / kv latent norms)" : "--qk-layernorm (q_norm / k_norm)",
               t.mla ? "MLA models" : "qwen3_moe, glm4_moe and olmoe");
  if (c.qk_layernorm && !t.mla)
    require(t.qk_over_heads == c.qk_layernorm_over_heads, f,
            t.qk_over_heads ? "QK-norm per head (its q_norm / k_norm run over all heads: --qk-layernorm-over-heads)"
                            : "--qk-layernorm-over-heads (its q_norm / k_norm run per head; olmoe's over all heads)");
  require(c.moe.enabled(), f, "no routed experts (--num-experts)");
  const bool shared = c.moe.shared_expert_intermediate_size > 0;
  require_need(t.shared, shared, f, "shared expert (--moe-shared-expert-intermediate-size)",
               "qwen2_moe, deepseek_v2, deepseek_v3 and glm4_moe");
  if (shared)
    require(t.shared_gated == c.moe.shared_expert_gate, f,
            t.shared_gated ? "a shared expert without --moe-shared-expert-gate (it gates it)"
                           : "--moe-shared-expert-gate (its shared experts are ungated)");
  require(t.expert_bias == c.moe.enable_expert_bias, f,
          t.expert_bias ? "no expert bias (its router has e_score_correction_bias: --moe-router-enable-expert-bias)"
                        : "--moe-router-enable-expert-bias (no expert-bias tensor in this family; deepseek_v3 and "
                          "glm4_moe have one)");
  require(t.mtp || c.mtp_num_layers == 0, f, "--mtp-num-layers (only deepseek_v3 and glm4_moe have MTP layers)");
  if (!t.dense_layers) {
    const std::vector<bool> moe = c.moe_layers();
    require(std::all_of(moe.begin(), moe.end(), [](bool m) { return m; }), f,
            "dense layers (every layer is MoE: --moe-layer-freq 1)");
    require(c.moe_ffn() == c.ffn(), f,
            "--moe-ffn-hidden-size different from --ffn-hidden-size (its experts use intermediate_size)");
  }
}

// The height R of a tensor viewed as [lead, R, C] for column runs (lead: the first dim, C: the last).
int64_t hf_column_height(const Shape& shape) {
  const int64_t lead = shape.ndim >= 1 ? shape[0] : 1, C = io::hf_row_width(shape);
  return lead * C > 0 ? shape.numel() / (lead * C) : 0;
}

// DeepSeek's interleaved RoPE channel of our (rotate-half) channel j of dr: pairs (2i, 2i + 1) become (i, i + dr/2).
int64_t deinterleave(int64_t j, int64_t dr, bool interleaved) {
  if (!interleaved) return j;
  return j < dr / 2 ? 2 * j : 2 * (j - dr / 2) + 1;
}

}  // namespace

namespace {

// The map in the making: each parameter's row runs of the family's HF tensors, chosen by the parameter's role; each HF
// tensor is declared (name and shape) by the run that first names it, so its name is written once. The tensors no
// parameter fills are the routers' expert biases (declared with the router) and the MTP depths' copies of the
// embedding and the output head.
class HfMapBuilder {
 public:
  HfMapBuilder(const ModelConfig& cfg, HfFamily family, bool rope_interleave)
      : c_(cfg), f_(family), t_(traits(family)), interleave_(rope_interleave), H_(cfg.hidden_size) {
    m_.family = family;
  }
  HfWeightMap take() { return std::move(m_); }

  void params() {
    for (const ParamSpec& s : parameter_specs(c_)) {
      HfParamMap p;
      p.param = s.name;
      p.shape = s.shape;
      // GPT-OSS's fc1 bias is read element by element (its HF row interleaves gate and up).
      p.width = t_.fused_experts && s.role == ParamRole::experts_fc1_bias ? 1 : io::hf_row_width(s.shape);
      p.expert = s.expert;
      cur_ = &p;
      row_ = 0;
      runs(s);
      MOECORE_CHECK(row_ == p.rows(), "HF map of '", s.name, "' covers ", row_, " of ", p.rows(), " rows");
      m_.params.push_back(std::move(p));
    }
    // DeepSeek-V3's (and GLM-4.5's) MTP depths are layers num_layers + k of the checkpoint, with copies of the shared
    // embedding and output head (one parameter each in moecore, as in Megatron).
    const std::string head = c_.untie_embeddings_and_output_weights ? "lm_head.weight" : "model.embed_tokens.weight";
    for (int64_t k = 0; k < c_.mtp_num_layers; ++k) {
      const std::string pre = layer_prefix(c_.num_layers + k);
      declare(pre + "embed_tokens.weight", {c_.vocab_size, H_}).copy_of = "model.embed_tokens.weight";
      declare(pre + "shared_head.head.weight", {c_.vocab_size, H_}).copy_of = head;
    }
    for (size_t i = 0; i < m_.params.size(); ++i)
      for (size_t r = 0; r < m_.params[i].runs.size(); ++r) {
        const HfRowRun& run = m_.params[i].runs[r];
        HfTensorSpec& t = m_.tensors.at(index_.at(run.hf));
        MOECORE_CHECK((run.columns() ? hf_column_height(t.shape) : io::hf_row_width(t.shape)) == m_.params[i].width,
                      "width of ", t.name, " vs ", m_.params[i].param);
        t.sources.emplace_back(i, r);
      }
  }

  // Every tensor's sources in ascending HF rows, covering it.
  void order_sources() {
    for (HfTensorSpec& t : m_.tensors) {
      if (t.expert_bias_layer >= 0 || !t.copy_of.empty()) continue;
      std::sort(t.sources.begin(), t.sources.end(), [&](const auto& a, const auto& b) {
        const HfRowRun &x = m_.params[a.first].runs[a.second], &y = m_.params[b.first].runs[b.second];
        return std::pair(x.hf_row, x.col0) < std::pair(y.hf_row, y.col0);
      });
      int64_t covered = 0;  // elements
      for (const auto& [pi, ri] : t.sources) covered += m_.params[pi].runs[ri].rows * m_.params[pi].width;
      MOECORE_CHECK(covered == t.shape.numel(), "HF tensor ", t.name, " covered ", covered);
    }
  }

 private:
  static std::string layer_prefix(int64_t l) { return "model.layers." + std::to_string(l) + "."; }
  std::string moe_prefix(int64_t l) const { return layer_prefix(l) + t_.moe; }
  std::string expert_prefix(int64_t l, int64_t e) const { return moe_prefix(l) + "experts." + std::to_string(e) + "."; }
  // HF tensor `name` of `shape`: added where a run first names it, the same shape wherever another names it.
  HfTensorSpec& declare(const std::string& name, const Shape& shape) {
    const auto [it, fresh] = index_.try_emplace(name, m_.tensors.size());
    if (fresh) {
      HfTensorSpec& t = m_.tensors.emplace_back();
      t.name = name;
      t.shape = shape;
    }
    HfTensorSpec& t = m_.tensors[it->second];
    MOECORE_CHECK(t.shape == shape, "HF tensor ", name, ": shape ", t.shape.str(), " and ", shape.str());
    return t;
  }
  // The shape of an HF tensor holding `rows` rows of the parameter being mapped ([rows, width]; 1-D: [rows]).
  Shape rows_shape(int64_t rows) const {
    return cur_->shape.ndim >= 2 ? Shape{rows, cur_->shape[cur_->shape.ndim - 1]} : Shape{rows};
  }

  void run(const std::string& hf, int64_t hf_row, int64_t rows) {
    cur_->runs.push_back({hf, hf_row, row_, rows});
    row_ += rows;
  }
  // `rows` parameter rows from columns col0, col0 + stride, ... of matrix `lead` of HF tensor `hf`.
  void column_run(const std::string& hf, int64_t lead, int64_t col0, int64_t stride, int64_t rows) {
    cur_->runs.push_back({hf, lead, row_, rows, col0, stride});
    row_ += rows;
  }
  // The whole parameter is HF tensor `hf` (same shape and row order).
  void whole(const std::string& hf) {
    declare(hf, cur_->shape);
    run(hf, 0, cur_->rows());
  }
  // The parameter's next `rows` rows are the whole of HF tensor `hf`.
  void part(const std::string& hf, int64_t rows) {
    declare(hf, rows_shape(rows));
    run(hf, 0, rows);
  }
  // The experts' gate (0), up (1) or down (2) projection weight.
  std::string expert_proj(int i) const { return std::string(t_.gate_up_down[i]) + ".weight"; }
  // DeepSeek's dr RoPE rows starting at HF row `first`, in moecore's rotate-half channel order.
  void rope_rows(const std::string& hf, int64_t first) {
    const int64_t dr = c_.qk_pos_emb_head_dim;
    for (int64_t j = 0; j < dr; ++j) run(hf, first + deinterleave(j, dr, interleave_), 1);
  }

  // A parameter's rows, by its role: the model's own, then a transformer layer's (MTP depth k: checkpoint layer
  // num_layers + k), attention then MLP.
  void runs(const ParamSpec& s) {
    using enum ParamRole;
    const std::string pre = s.layer >= 0 ? layer_prefix(s.layer) : "", sa = pre + "self_attn.";
    switch (s.role) {
      case word_embeddings:
        return whole("model.embed_tokens.weight");
      case final_norm:
        return whole("model.norm.weight");
      case output_layer:
        return whole("lm_head.weight");
      case mtp_enorm:
        return whole(pre + "enorm.weight");
      case mtp_hnorm:
        return whole(pre + "hnorm.weight");
      case mtp_eh_proj:
        return whole(pre + "eh_proj.weight");
      case mtp_final_norm:
        return whole(pre + "shared_head.norm.weight");
      case input_norm:
        return whole(pre + "input_layernorm.weight");
      case mlp_norm:
        return whole(pre + "post_attention_layernorm.weight");
      case qkv:
        return qkv_runs(sa, ".weight");
      case qkv_bias:
        return qkv_runs(sa, ".bias");
      case proj:
        return whole(sa + "o_proj.weight");
      case proj_bias:
        return whole(sa + "o_proj.bias");
      case softmax_offset:
        return whole(sa + "sinks");
      case q_norm:
        return whole(sa + (t_.mla ? "q_a_layernorm.weight" : "q_norm.weight"));
      case k_norm:
        return whole(sa + "k_norm.weight");
      case q_proj:
        return mla_q_runs(sa + "q_proj.weight");
      case q_up_proj:
        return mla_q_runs(sa + "q_b_proj.weight");
      case q_down_proj:
        return whole(sa + "q_a_proj.weight");
      case kv_down_proj: {
        const std::string hf = declare(sa + "kv_a_proj_with_mqa.weight", cur_->shape).name;
        run(hf, 0, c_.kv_lora_rank);
        return rope_rows(hf, c_.kv_lora_rank);
      }
      case kv_norm:
        return whole(sa + "kv_a_layernorm.weight");
      case kv_up_proj:
        return whole(sa + "kv_b_proj.weight");
      case fc1:
        part(pre + "mlp.gate_proj.weight", c_.ffn());
        return part(pre + "mlp.up_proj.weight", c_.ffn());
      case fc2:
        return whole(pre + "mlp.down_proj.weight");
      default:
        return moe_runs(s);
    }
  }
  // Per query group: R query heads, its key head, its value head.
  void qkv_runs(const std::string& sa, const std::string& kind) {
    const int64_t D = c_.head_dim(), G = c_.query_groups(), R = c_.num_attention_heads / G;
    declare(sa + "q_proj" + kind, rows_shape(G * R * D));
    declare(sa + "k_proj" + kind, rows_shape(G * D));
    declare(sa + "v_proj" + kind, rows_shape(G * D));
    for (int64_t g = 0; g < G; ++g) {
      run(sa + "q_proj" + kind, g * R * D, R * D);
      run(sa + "k_proj" + kind, g * D, D);
      run(sa + "v_proj" + kind, g * D, D);
    }
  }
  // Per head [nope | rope], the rope channels de-interleaved.
  void mla_q_runs(const std::string& hf) {
    const int64_t dn = c_.qk_head_dim, dr = c_.qk_pos_emb_head_dim;
    declare(hf, cur_->shape);
    for (int64_t h = 0; h < c_.num_attention_heads; ++h) {
      run(hf, h * (dn + dr), dn);
      rope_rows(hf, h * (dn + dr) + dn);
    }
  }
  void moe_runs(const ParamSpec& s) {
    using enum ParamRole;
    const std::string moe = moe_prefix(s.layer), shared = moe + t_.shared_module;
    if (t_.fused_experts) return fused_expert_runs(s, moe);
    const int64_t F = c_.moe_ffn(), Fs = c_.moe.shared_expert_intermediate_size;
    switch (s.role) {
      case router:
        return router_runs(s.layer);
      case experts_fc1:
        for (int64_t e = 0; e < c_.moe.num_experts; ++e) {
          part(expert_prefix(s.layer, e) + expert_proj(0), F);
          part(expert_prefix(s.layer, e) + expert_proj(1), F);
        }
        return;
      case experts_fc2:
        for (int64_t e = 0; e < c_.moe.num_experts; ++e) part(expert_prefix(s.layer, e) + expert_proj(2), H_);
        return;
      case shared_fc1:
        part(shared + "gate_proj.weight", Fs);
        return part(shared + "up_proj.weight", Fs);
      case shared_fc2:
        return whole(shared + "down_proj.weight");
      case shared_gate:
        return whole(moe + "shared_expert_gate.weight");
      default:
        MOECORE_FAIL("Hugging Face ", hf_family_name(f_), ": no HF tensor for parameter '", s.name, "'");
    }
  }

  // Layer l's router, and its expert bias (DeepSeek-V3's e_score_correction_bias: router state, no parameter).
  void router_runs(int64_t l) {
    whole(moe_prefix(l) + t_.router_module + "weight");
    if (t_.expert_bias)
      declare(moe_prefix(l) + t_.router_module + "e_score_correction_bias", {c_.moe.num_experts}).expert_bias_layer = l;
  }

  // GPT-OSS's router (with its bias) and fused experts: fc1 row j of expert e is gate_up_proj[e][:, 2j] (gate, j < F)
  // or [:, 2(j - F) + 1] (up), of gate_up_proj [E, H, 2F]; fc2 row h is down_proj[e][:, h], of down_proj [E, F, H];
  // the fc1 bias [E, 2F] interleaves the same way.
  void fused_expert_runs(const ParamSpec& s, const std::string& moe) {
    using enum ParamRole;
    const int64_t E = c_.moe.num_experts, F = c_.moe_ffn(), H = H_;
    switch (s.role) {
      case router:
        return router_runs(s.layer);
      case router_bias:
        return whole(moe + t_.router_module + "bias");
      case experts_fc1:
      case experts_fc1_bias: {
        const bool w = s.role == experts_fc1;
        const std::string hf = moe + (w ? "experts.gate_up_proj" : "experts.gate_up_proj_bias");
        declare(hf, w ? Shape{E, H, 2 * F} : Shape{E, 2 * F});
        for (int64_t e = 0; e < E; ++e) {
          column_run(hf, e, 0, 2, F);
          column_run(hf, e, 1, 2, F);
        }
        return;
      }
      case experts_fc2: {
        const std::string hf = declare(moe + "experts.down_proj", {E, F, H}).name;
        for (int64_t e = 0; e < E; ++e) column_run(hf, e, 0, 1, H);
        return;
      }
      case experts_fc2_bias: {  // a run per expert: an expert-parallel checkpoint holds them in several files
        const std::string hf = declare(moe + "experts.down_proj_bias", {E, H}).name;
        for (int64_t e = 0; e < E; ++e) run(hf, e, 1);
        return;
      }
      default:
        MOECORE_FAIL("Hugging Face ", hf_family_name(f_), ": no HF tensor for parameter '", s.name, "'");
    }
  }

  const ModelConfig& c_;
  const HfFamily f_;
  const FamilyTraits& t_;
  const bool interleave_;
  const int64_t H_;
  HfWeightMap m_;
  std::map<std::string, size_t> index_;  // tensor name -> m_.tensors index
  HfParamMap* cur_ = nullptr;            // the parameter whose runs are being added, and its rows so far
  int64_t row_ = 0;
};

}  // namespace

HfWeightMap hf_weight_map(const ModelConfig& cfg, HfFamily family, bool rope_interleave) {
  cfg.validate();
  check_family(cfg, family);
  HfMapBuilder b(cfg, family, rope_interleave);
  b.params();
  b.order_sources();
  return b.take();
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

namespace {
// `<name>_blocks` / `<name>_scales` of an MXFP4 stand-in for a map tensor `name`.
bool mxfp4_part(const HfWeightMap& map, const io::HfCheckpointReader& hf, const std::string& name) {
  for (const char* suffix : {"_blocks", "_scales"})
    if (name.ends_with(suffix)) {
      const std::string base = name.substr(0, name.size() - std::strlen(suffix));
      if (hf.mxfp4(base))
        return std::any_of(map.tensors.begin(), map.tensors.end(),
                           [&](const HfTensorSpec& t) { return t.name == base; });
    }
  return false;
}

// An MXFP4 tensor stands for GPT-OSS's fused experts only (their column runs read it), in the map's shape [lead, R, C]:
// blocks [lead, C, R / 32, 16], scales [lead, C, R / 32].
void check_mxfp4(const HfWeightMap& map, const io::HfCheckpointReader& hf, const HfTensorSpec& t) {
  const io::HfTensorInfo &b = hf.info(t.name + "_blocks"), &s = hf.info(t.name + "_scales");
  const bool columns =
      !t.sources.empty() && map.params[t.sources.front().first].runs[t.sources.front().second].columns();
  const Shape& w = t.shape;
  const bool ok = columns && w.ndim == 3 && w[1] % 32 == 0 && b.dtype_name == "U8" && s.dtype_name == "U8" &&
                  b.shape == Shape{w[0], w[2], w[1] / 32, 16} && s.shape == Shape{w[0], w[2], w[1] / 32};
  if (!ok)
    MOECORE_FAIL("hf checkpoint '", hf.dir(), "': MXFP4 tensor '", t.name, "' (", b.dtype_name, " ", b.shape.str(),
                 " blocks, ", s.dtype_name, " ", s.shape.str(), " scales) does not stand for ", t.shape.str(),
                 columns ? "" : " (only GPT-OSS's experts may be MXFP4)", "; expected U8 blocks [", w[0], ", ",
                 w.ndim == 3 ? w[2] : 0, ", ", w.ndim == 3 ? w[1] / 32 : 0, ", 16] and scales");
}
}  // namespace

void hf_check_tensors(const HfWeightMap& map, const io::HfCheckpointReader& hf) {
  std::map<std::string, const HfTensorSpec*> want;
  for (const HfTensorSpec& t : map.tensors) want[t.name] = &t;
  for (const io::HfTensorInfo& t : hf.tensors()) {
    auto it = want.find(t.name);
    if (it == want.end() && t.name.ends_with("_scale_inv") &&
        want.count(t.name.substr(0, t.name.size() - 10)))  // DeepSeek-V3's FP8 block scales, read with the weight
      continue;
    if (it == want.end() && mxfp4_part(map, hf, t.name)) continue;  // checked with the tensor it stands for
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
    if (hf.mxfp4(t.name))
      check_mxfp4(map, hf, t);
    else if (!hf.contains(t.name))
      MOECORE_FAIL("hf checkpoint '", hf.dir(), "' lacks tensor '", t.name, "' ", t.shape.str(), " of the ",
                   hf_family_name(map.family), " model its config.json describes");
}

namespace {
// Rows per part: at most kHfPartElements elements (at least one row).
int64_t part_rows(int64_t width) {
  return std::max<int64_t>(1, kHfPartElements / std::max<int64_t>(width, 1));
}
}  // namespace

namespace {
// Parameter rows [a, b) of column run r: columns of the [R, C] matrix r.hf_row of the HF tensor (R = width), read
// whole (one expert's matrix) and handed on as [k, R] parts of at most `step` rows.
void read_column_run(const HfRowRun& r, int64_t width, const io::HfCheckpointReader& hf, int64_t a, int64_t b,
                     int64_t step, const std::function<void(const Tensor& part)>& sink) {
  const Tensor m =
      hf.mxfp4(r.hf) ? hf.read_mxfp4_matrix(r.hf, r.hf_row) : hf.read_rows(r.hf, r.hf_row * width, width, DType::f32);
  MOECORE_CHECK(m.numel() % width == 0 && m.size(0) == width, "matrix ", r.hf_row, " of ", r.hf, " ", m.str());
  const int64_t C = m.numel() / width;
  const float* src = m.data<float>();
  for (int64_t x = a; x < b; x += step) {
    const int64_t n = std::min(step, b - x);
    Tensor part = Tensor::empty({n, width}, DType::f32, MemCategory::workspace);
    float* dst = part.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = r.col0 + (x + i - r.param_row) * r.col_stride;
      MOECORE_CHECK(c < C, "column ", c, " of ", r.hf, " (", C, " columns)");
      for (int64_t k = 0; k < width; ++k) dst[i * width + k] = src[k * C + c];
    }
    sink(part);
  }
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
    if (r.columns()) {
      if (a < b) read_column_run(r, map.width, hf, a, b, step, sink);
      continue;
    }
    if (a < b && hf.mxfp4(r.hf))
      MOECORE_FAIL("hf checkpoint '", hf.dir(), "': '", r.hf,
                   "' is MXFP4-quantised, which moecore reads only for "
                   "GPT-OSS's experts");
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

namespace {
// A tensor of column runs (GPT-OSS's fused experts), matrix by matrix: each [R, C] matrix filled from its runs'
// parameter rows (one column each) and handed on whole.
void gather_columns(const HfWeightMap& map, const HfTensorSpec& tensor,
                    const std::function<Tensor(size_t param, int64_t first_row, int64_t rows)>& rows,
                    const std::function<void(const Tensor& part)>& sink) {
  const int64_t R = map.params[tensor.sources.front().first].width, lead = tensor.shape[0];
  const int64_t C = tensor.shape.numel() / (lead * R);
  size_t s = 0;
  for (int64_t e = 0; e < lead; ++e) {
    Tensor m = Tensor::zeros({R, C}, DType::f32, MemCategory::workspace);
    float* dst = m.data<float>();
    for (; s < tensor.sources.size(); ++s) {
      const auto [pi, ri] = tensor.sources[s];
      const HfRowRun& r = map.params[pi].runs[ri];
      if (r.hf_row != e) break;
      const Tensor part = rows(pi, r.param_row, r.rows).to(DType::f32);
      MOECORE_CHECK(part.is_contiguous() && part.numel() == r.rows * R, "rows of ", map.params[pi].param);
      const float* src = part.data<float>();
      for (int64_t i = 0; i < r.rows; ++i)
        for (int64_t k = 0; k < R; ++k) dst[k * C + r.col0 + i * r.col_stride] = src[i * R + k];
    }
    sink(m);
  }
}
}  // namespace

void hf_gather_parts(const HfWeightMap& map, const HfTensorSpec& tensor,
                     const std::function<Tensor(size_t param, int64_t first_row, int64_t rows)>& rows,
                     const std::function<void(const Tensor& part)>& sink) {
  if (!tensor.copy_of.empty()) {
    for (const HfTensorSpec& t : map.tensors)
      if (t.name == tensor.copy_of) return hf_gather_parts(map, t, rows, sink);
    MOECORE_CHECK(false, "no tensor ", tensor.copy_of, " to copy into ", tensor.name);
  }
  if (!tensor.sources.empty() && map.params[tensor.sources.front().first].runs[tensor.sources.front().second].columns())
    return gather_columns(map, tensor, rows, sink);
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
