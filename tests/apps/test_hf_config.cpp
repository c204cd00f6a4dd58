// `--hf-config`: the config.json -> Megatron flag translation checked flag by flag on the shared real configs
// (Mixtral-8x7B, Qwen3-30B-A3B) and a Qwen2-MoE one written here, refusals naming the key, the value or the path,
// and `moecore train` building the model from each real config shrunk by flags (command-line flags win).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "apps/cli_support.h"
#include "apps/hf_config.h"
#include "apps/model_flags.h"
#include "moecore/core/error.h"
#include "moecore/model/config_record.h"
#include "moecore/model/hf_weights.h"
#include "test_util.h"

namespace moecore {
namespace {

using nlohmann::json;

std::string shared_config(const std::string& name) {
  const std::string dir = testing::shared_data_dir();
  if (dir.empty()) return "";
  const std::string p = dir + "/hf_configs/" + name + ".config.json";
  return std::filesystem::exists(p) ? p : "";
}

std::map<std::string, std::string> flags_of(const json& cfg) {
  std::map<std::string, std::string> m;
  for (const auto& [f, v] : apps::hf_config_flags(cfg)) m[f] = v;
  return m;
}

std::string error_of(const json& cfg) {
  try {
    apps::hf_config_flags(cfg);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

json qwen2_moe_config() {
  return json::parse(R"({"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "decoder_sparse_step": 2, "eos_token_id": 1, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 96, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "moe_intermediate_size": 32, "norm_topk_prob": false, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 4, "output_router_logits": false,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 48, "sliding_window": 32768, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 512, "mlp_only_layers": [3]})");
}

void expect_flags(const std::map<std::string, std::string>& got, const std::map<std::string, std::string>& want) {
  for (const auto& [f, v] : want) {
    ASSERT_TRUE(got.count(f)) << f;
    EXPECT_EQ(got.at(f), v) << f;
  }
}

TEST(HfConfig, MixtralTranslatesToMegatronFlags) {
  const std::string path = shared_config("mixtral-8x7b");
  if (path.empty()) GTEST_SKIP() << "../shared/data/hf_configs not found";
  const auto f = flags_of(apps::hf_config_load(path, "--hf-config"));
  expect_flags(f, {{"--num-layers", "32"},
                   {"--hidden-size", "4096"},
                   {"--num-attention-heads", "32"},
                   {"--group-query-attention", ""},
                   {"--num-query-groups", "8"},
                   {"--ffn-hidden-size", "14336"},
                   {"--num-experts", "8"},
                   {"--moe-router-topk", "2"},
                   {"--moe-aux-loss-coeff", "0.02"},
                   {"--moe-router-load-balancing-type", "aux_loss"},
                   {"--rotary-base", "1000000"},
                   {"--position-embedding-type", "rope"},
                   {"--normalization", "RMSNorm"},
                   {"--norm-epsilon", "1e-05"},
                   {"--max-position-embeddings", "32768"},
                   {"--vocab-size", "32000"},
                   {"--swiglu", ""},
                   {"--disable-bias-linear", ""},
                   {"--untie-embeddings-and-output-weights", ""},
                   {"--attention-dropout", "0"},
                   {"--hidden-dropout", "0"},
                   {"--init-method-std", "0.02"}});
  for (const char* absent : {"--qk-layernorm", "--moe-router-pre-softmax", "--kv-channels", "--add-qkv-bias",
                             "--moe-layer-freq", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"})
    EXPECT_FALSE(f.count(absent)) << absent;
}

TEST(HfConfig, Qwen3MoeTranslatesToMegatronFlags) {
  const std::string path = shared_config("qwen3-30b-a3b");
  if (path.empty()) GTEST_SKIP() << "../shared/data/hf_configs not found";
  const auto f = flags_of(apps::hf_config_load(path, "--hf-config"));
  expect_flags(f, {{"--num-layers", "48"},
                   {"--hidden-size", "2048"},
                   {"--num-attention-heads", "32"},
                   {"--num-query-groups", "4"},
                   {"--kv-channels", "128"},
                   {"--qk-layernorm", ""},
                   {"--ffn-hidden-size", "6144"},
                   {"--moe-ffn-hidden-size", "768"},
                   {"--num-experts", "128"},
                   {"--moe-router-topk", "8"},
                   {"--moe-aux-loss-coeff", "0.001"},
                   {"--norm-epsilon", "1e-06"},
                   {"--rotary-base", "1000000"},
                   {"--vocab-size", "151936"}});
  // norm_topk_prob true is Megatron's default (softmax over the top k); every layer is MoE (Megatron's default).
  for (const char* absent : {"--moe-router-pre-softmax", "--moe-layer-freq", "--add-qkv-bias"})
    EXPECT_FALSE(f.count(absent)) << absent;
}

TEST(HfConfig, Qwen2MoeSharedExpertQkvBiasAndLayerPattern) {
  const auto f = flags_of(qwen2_moe_config());
  expect_flags(f, {{"--add-qkv-bias", ""},
                   {"--moe-router-pre-softmax", ""},
                   {"--moe-shared-expert-intermediate-size", "48"},
                   {"--moe-shared-expert-gate", ""},
                   {"--moe-layer-freq", "[0]*1+[1]*1+[0]*2"}});  // (i + 1) % 2 == 0, minus mlp_only_layers [3]
  EXPECT_FALSE(f.count("--qk-layernorm"));
}

// DeepSeek-V3's hub config.json (FP8, YaRN, MTP): MLA sizes, routing, layer pattern, YaRN and MTP flags.
TEST(HfConfig, DeepSeekV3TranslatesToMegatronFlags) {
  const std::string path = shared_config("deepseek-v3");
  if (path.empty()) GTEST_SKIP() << "../shared/data/hf_configs not found";
  const auto f = flags_of(apps::hf_config_load(path, "--hf-config"));
  expect_flags(f, {{"--num-layers", "61"},
                   {"--hidden-size", "7168"},
                   {"--num-attention-heads", "128"},
                   {"--multi-latent-attention", ""},
                   {"--qk-layernorm", ""},
                   {"--q-lora-rank", "1536"},
                   {"--kv-lora-rank", "512"},
                   {"--qk-head-dim", "128"},
                   {"--qk-pos-emb-head-dim", "64"},
                   {"--v-head-dim", "128"},
                   {"--ffn-hidden-size", "18432"},
                   {"--moe-ffn-hidden-size", "2048"},
                   {"--num-experts", "256"},
                   {"--moe-router-topk", "8"},
                   {"--moe-shared-expert-intermediate-size", "2048"},
                   {"--moe-layer-freq", "[0]*3+[1]*58"},
                   {"--moe-router-score-function", "sigmoid"},
                   {"--moe-router-enable-expert-bias", ""},
                   {"--moe-router-num-groups", "8"},
                   {"--moe-router-group-topk", "4"},
                   {"--moe-router-topk-scaling-factor", "2.5"},
                   {"--moe-router-load-balancing-type", "none"},
                   {"--rope-type", "yarn"},
                   {"--rotary-base", "10000"},
                   {"--rotary-scaling-factor", "40"},
                   {"--yarn-original-max-position-embeddings", "4096"},
                   {"--yarn-beta-fast", "32"},
                   {"--yarn-beta-slow", "1"},
                   {"--mscale", "1"},
                   {"--mscale-all-dim", "1"},
                   {"--mtp-num-layers", "1"},
                   {"--vocab-size", "129280"}});
  EXPECT_FALSE(f.count("--moe-shared-expert-gate"));
  EXPECT_EQ(f.at("--moe-router-group-score-topk"), "2");  // transformers' group score: the top 2 of each group
  json c = apps::hf_config_load(path, "--hf-config");
  c["norm_topk_prob"] = false;
  EXPECT_NE(error_of(c).find("'norm_topk_prob' = false"), std::string::npos) << error_of(c);
  c = apps::hf_config_load(path, "--hf-config");
  c["rope_scaling"].erase("mscale_all_dim");
  EXPECT_NE(error_of(c).find("both mscale and mscale_all_dim"), std::string::npos) << error_of(c);
}

// GLM-4.5's published config.json (zai-org/GLM-4.5; transformers 4.54's legacy layout: partial_rotary_factor and
// rope_theta at the top level): Megatron's flags as GLM-4.5 is trained (the slime / Megatron-Bridge recipes).
json glm45_config() {
  return json::parse(R"({"architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": true, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": null,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": true, "use_qk_norm": true, "vocab_size": 151552})");
}

// DeepSeek-V2's published config.json (deepseek-ai/DeepSeek-V2, the hub's own configuration_deepseek.py keys).
json deepseek_v2_config() {
  return json::parse(R"({"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.003, "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1536, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 160, "n_shared_experts": 2,
    "norm_topk_prob": false, "num_attention_heads": 128, "num_experts_per_tok": 6, "num_hidden_layers": 60,
    "num_key_value_heads": 128, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
    "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 16.0, "scoring_func": "softmax", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 3, "topk_method": "group_limited_greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.39.3", "use_cache": true, "v_head_dim": 128, "vocab_size": 102400})");
}

TEST(HfConfig, Glm45TranslatesToMegatronFlags) {
  const auto f = flags_of(glm45_config());
  expect_flags(f, {{"--num-layers", "92"},
                   {"--hidden-size", "5120"},
                   {"--num-attention-heads", "96"},
                   {"--group-query-attention", ""},
                   {"--num-query-groups", "8"},
                   {"--kv-channels", "128"},
                   {"--add-qkv-bias", ""},
                   {"--qk-layernorm", ""},
                   {"--rotary-percent", "0.5"},
                   {"--rotary-base", "1000000"},
                   {"--ffn-hidden-size", "12288"},
                   {"--moe-ffn-hidden-size", "1536"},
                   {"--moe-shared-expert-intermediate-size", "1536"},
                   {"--num-experts", "160"},
                   {"--moe-router-topk", "8"},
                   {"--moe-layer-freq", "[0]*3+[1]*89"},
                   {"--moe-router-score-function", "sigmoid"},
                   {"--moe-router-enable-expert-bias", ""},
                   {"--moe-router-topk-scaling-factor", "2.5"},
                   {"--moe-router-load-balancing-type", "none"},
                   {"--mtp-num-layers", "1"},
                   {"--untie-embeddings-and-output-weights", ""},
                   {"--vocab-size", "151552"}});
  EXPECT_FALSE(f.count("--moe-router-num-groups"));  // n_group 1: no group-limited routing
  EXPECT_FALSE(f.count("--moe-shared-expert-gate"));
  EXPECT_FALSE(f.count("--multi-latent-attention"));
  // GLM-4.5-Air: no QK-norm, no q/k/v-bias flag when attention_bias is false; transformers 5's layout.
  json c = glm45_config();
  c["use_qk_norm"] = false;
  c["attention_bias"] = false;
  c.erase("partial_rotary_factor");
  c.erase("rope_theta");
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}, {"partial_rotary_factor", 0.5}};
  const auto air = flags_of(c);
  EXPECT_FALSE(air.count("--qk-layernorm"));
  EXPECT_FALSE(air.count("--add-qkv-bias"));
  EXPECT_EQ(air.at("--rotary-percent"), "0.5");
  EXPECT_EQ(air.at("--rotary-base"), "1000000");
  c.erase("rope_parameters");
  c["rope_theta"] = 1e6;
  EXPECT_EQ(flags_of(c).at("--rotary-percent"), "0.5") << "transformers' default partial_rotary_factor for glm4_moe";
  // Bad input, by key: a factor that splits a channel pair, two factors that disagree, unnormalised sigmoid top-k.
  c = glm45_config();
  c["partial_rotary_factor"] = 0.3;
  EXPECT_NE(error_of(c).find("partial_rotary_factor 0.3 of head_dim 128 is not an even number of channels"),
            std::string::npos)
      << error_of(c);
  c = glm45_config();
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000}, {"partial_rotary_factor", 0.25}};
  EXPECT_NE(error_of(c).find("'partial_rotary_factor' = 0.5 differs from rope_parameters' 0.25"), std::string::npos)
      << error_of(c);
  c = glm45_config();
  c["norm_topk_prob"] = false;
  EXPECT_NE(error_of(c).find("'norm_topk_prob' = false"), std::string::npos) << error_of(c);
  c = glm45_config();
  c["use_qk_norm"] = "yes";
  EXPECT_NE(error_of(c).find("'use_qk_norm' = \"yes\""), std::string::npos) << error_of(c);
}

// OLMoE-1B-7B-0924's published config.json (allenai/OLMoE-1B-7B-0924).
TEST(HfConfig, OlmoeTranslatesToMegatronFlags) {
  const json olmoe = json::parse(R"({"architectures": ["OlmoeForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "clip_qkv": null, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe",
    "norm_topk_prob": false, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": false, "pad_token_id": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": true,
    "vocab_size": 50304})");
  const auto f = flags_of(olmoe);
  expect_flags(f, {{"--num-layers", "16"},
                   {"--hidden-size", "2048"},
                   {"--num-attention-heads", "16"},
                   {"--num-query-groups", "16"},
                   {"--ffn-hidden-size", "1024"},
                   {"--num-experts", "64"},
                   {"--moe-router-topk", "8"},
                   {"--moe-router-pre-softmax", ""},
                   {"--moe-aux-loss-coeff", "0.01"},
                   {"--moe-router-load-balancing-type", "aux_loss"},
                   {"--qk-layernorm", ""},
                   {"--qk-layernorm-over-heads", ""},
                   {"--vocab-size", "50304"}});
  json c = olmoe;
  c["clip_qkv"] = 8.0;
  EXPECT_NE(error_of(c).find("'clip_qkv' = 8.0"), std::string::npos) << error_of(c);
  c = olmoe;
  c["attention_bias"] = true;
  EXPECT_NE(error_of(c).find("'attention_bias' = true"), std::string::npos) << error_of(c);
}

// gpt-oss-20b's published config.json (openai/gpt-oss-20b; layer_types shortened with the layers).
TEST(HfConfig, GptOssTranslatesToMegatronFlags) {
  json c = json::parse(R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
    "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
    "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
    "rope_type": "yarn", "truncate": false}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
    "use_cache": true, "vocab_size": 201088})");
  const auto f = flags_of(c);
  expect_flags(f, {{"--num-layers", "4"},
                   {"--hidden-size", "2880"},
                   {"--num-attention-heads", "64"},
                   {"--num-query-groups", "8"},
                   {"--kv-channels", "64"},
                   {"--num-experts", "32"},
                   {"--moe-router-topk", "4"},
                   {"--moe-ffn-hidden-size", "2880"},
                   {"--quick-geglu", ""},
                   {"--glu-linear-offset", "1"},
                   {"--activation-func-clamp-value", "7"},
                   {"--softmax-type", "learnable"},
                   {"--window-size", "(127,0)"},
                   {"--window-attn-skip-freq", "[1]*1+[0]*1+[1]*1+[0]*1"},
                   {"--position-embedding-type", "yarn"},
                   {"--rotary-base", "150000"},
                   {"--rotary-scaling-factor", "32"},
                   {"--yarn-original-max-position-embeddings", "4096"},
                   {"--no-yarn-correction-range-round-to-int", ""},
                   {"--moe-aux-loss-coeff", "0.9"},
                   {"--vocab-size", "201088"}});
  EXPECT_FALSE(f.count("--disable-bias-linear"));  // Megatron's default: biases on every linear layer
  EXPECT_FALSE(f.count("--swiglu"));
  EXPECT_FALSE(f.count("--mscale"));  // transformers' and Megatron's default concentration, 0.1 ln(factor) + 1
  c["swiglu_alpha"] = 1.5;
  EXPECT_NE(error_of(c).find("'swiglu_alpha' = 1.5"), std::string::npos) << error_of(c);
  c.erase("swiglu_alpha");
  c["attention_bias"] = false;
  EXPECT_NE(error_of(c).find("'attention_bias' = false"), std::string::npos) << error_of(c);
  c["attention_bias"] = true;
  c["layer_types"] = json::array({"sliding_attention", "chunked_attention", "full_attention", "full_attention"});
  EXPECT_NE(error_of(c).find("\"chunked_attention\" is not"), std::string::npos) << error_of(c);
  c["layer_types"] = json::array({"sliding_attention"});
  EXPECT_NE(error_of(c).find("one entry per layer (4)"), std::string::npos) << error_of(c);
  c["layer_types"] = json::array({"full_attention", "full_attention", "full_attention", "full_attention"});
  EXPECT_FALSE(flags_of(c).count("--window-size"));
  c.erase("layer_types");  // (the default alternates sliding and full layers)
  for (const json& w : {json(0), json(-4), json(1.5), json("128")}) {
    c["sliding_window"] = w;
    EXPECT_NE(error_of(c).find("'sliding_window'"), std::string::npos) << w.dump();
  }
  c["sliding_window"] = 128;
  c["quantization_config"] = {{"quant_method", "bitsandbytes"}};
  EXPECT_NE(error_of(c).find("'quantization_config'"), std::string::npos) << error_of(c);
  c["quantization_config"] = nullptr;
  c["experts_per_token"] = 2;
  EXPECT_NE(error_of(c).find("'experts_per_token' = 2"), std::string::npos) << error_of(c);
}

TEST(HfConfig, DeepSeekV2TranslatesToMegatronFlags) {
  const auto f = flags_of(deepseek_v2_config());
  expect_flags(f, {{"--num-layers", "60"},
                   {"--multi-latent-attention", ""},
                   {"--qk-layernorm", ""},
                   {"--q-lora-rank", "1536"},
                   {"--kv-lora-rank", "512"},
                   {"--qk-head-dim", "128"},
                   {"--qk-pos-emb-head-dim", "64"},
                   {"--v-head-dim", "128"},
                   {"--num-experts", "160"},
                   {"--moe-router-topk", "6"},
                   {"--moe-shared-expert-intermediate-size", "3072"},
                   {"--moe-layer-freq", "[0]*1+[1]*59"},
                   {"--moe-router-pre-softmax", ""},
                   {"--moe-router-num-groups", "8"},
                   {"--moe-router-group-topk", "3"},
                   {"--moe-router-topk-scaling-factor", "16"},
                   {"--moe-router-load-balancing-type", "seq_aux_loss"},
                   {"--moe-aux-loss-coeff", "0.003"},
                   {"--rope-type", "yarn"},
                   {"--rotary-scaling-factor", "40"},
                   {"--mscale", "0.707"},
                   {"--mscale-all-dim", "0.707"}});
  // transformers scores a group by its best expert; Megatron's default would sum the top 6 / 3 = 2.
  EXPECT_EQ(f.at("--moe-router-group-score-topk"), "1");
  EXPECT_FALSE(f.count("--moe-router-score-function"));  // softmax: Megatron's default
  EXPECT_FALSE(f.count("--moe-router-enable-expert-bias"));
  EXPECT_FALSE(f.count("--mtp-num-layers"));
  // DeepSeek-V2-Lite: greedy routing ignores n_group / topk_group.
  json c = deepseek_v2_config();
  c["topk_method"] = "greedy";
  EXPECT_FALSE(flags_of(c).count("--moe-router-num-groups"));
  // Bad input, by key.
  c = deepseek_v2_config();
  c["norm_topk_prob"] = true;
  EXPECT_NE(error_of(c).find("'norm_topk_prob' = true"), std::string::npos) << error_of(c);
  c = deepseek_v2_config();
  c["topk_method"] = "noaux_tc";
  EXPECT_NE(error_of(c).find("'topk_method' = \"noaux_tc\""), std::string::npos) << error_of(c);
  c = deepseek_v2_config();
  c["scoring_func"] = "sigmoid";
  EXPECT_NE(error_of(c).find("'scoring_func' = \"sigmoid\""), std::string::npos) << error_of(c);
  c = deepseek_v2_config();
  c["topk_group"] = 9;
  EXPECT_NE(error_of(c).find("'topk_group' = 9 must be in [1, n_group = 8]"), std::string::npos) << error_of(c);
  c = deepseek_v2_config();
  c["n_group"] = 7;
  EXPECT_NE(error_of(c).find("n_routed_experts (160) must be divisible by n_group (7)"), std::string::npos)
      << error_of(c);
  c = deepseek_v2_config();
  c["num_nextn_predict_layers"] = 1;  // a DeepSeek-V3 key
  EXPECT_NE(error_of(c).find("unknown config.json key 'num_nextn_predict_layers' for model_type deepseek_v2"),
            std::string::npos)
      << error_of(c);
  c = deepseek_v2_config();
  c["model_type"] = "gpt_neox";
  EXPECT_NE(
      error_of(c).find("supported: mixtral, qwen2_moe, qwen3_moe, deepseek_v3, deepseek_v2, glm4_moe, olmoe, gpt_oss"),
      std::string::npos)
      << error_of(c);
}

TEST(HfConfig, RefusalsNameTheKeyAndValue) {
  json c = qwen2_moe_config();
  c["rope_scaling"] = json::parse(R"({"type": "yarn", "factor": 4.0})");
  std::string e = error_of(c);
  EXPECT_NE(e.find("'rope_scaling'"), std::string::npos) << e;
  EXPECT_NE(e.find("yarn"), std::string::npos) << e;
  c = qwen2_moe_config();
  c["frobnicate"] = 3;
  e = error_of(c);
  EXPECT_NE(e.find("unknown config.json key 'frobnicate' for model_type qwen2_moe"), std::string::npos) << e;
  c = qwen2_moe_config();
  c["use_sliding_window"] = true;
  EXPECT_NE(error_of(c).find("'use_sliding_window' = true"), std::string::npos) << error_of(c);
  c = qwen2_moe_config();
  c["hidden_act"] = "gelu";
  EXPECT_NE(error_of(c).find("'hidden_act' = \"gelu\""), std::string::npos) << error_of(c);
  c = qwen2_moe_config();
  c.erase("hidden_size");
  EXPECT_NE(error_of(c).find("lacks 'hidden_size'"), std::string::npos) << error_of(c);
  c = qwen2_moe_config();
  c["attention_bias"] = true;  // a Qwen3-MoE key only
  EXPECT_NE(error_of(c).find("unknown config.json key 'attention_bias'"), std::string::npos) << error_of(c);
  try {
    apps::hf_config_load("/nonexistent/moecore-hf", "--hf-config");
    ADD_FAILURE() << "no error for a bad path";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("--hf-config /nonexistent/moecore-hf"), std::string::npos) << err.what();
  }
}

// Values that contradict each other are refused by their config.json keys (issue 29), not by the Megatron flags
// they become: query heads over key/value heads, hidden size over heads without head_dim, top-k over the experts.
TEST(HfConfig, ContradictingValuesAreRefusedNamingTheKeys) {
  json c = qwen2_moe_config();
  c["num_key_value_heads"] = 3;
  std::string e = error_of(c);
  EXPECT_NE(e.find("num_attention_heads (4) must be divisible by num_key_value_heads (3)"), std::string::npos) << e;
  c = qwen2_moe_config();
  c["hidden_size"] = 30;
  e = error_of(c);
  EXPECT_NE(e.find("hidden_size (30) must be divisible by num_attention_heads (4) when head_dim is not given"),
            std::string::npos)
      << e;
  c = qwen2_moe_config();
  c["num_experts_per_tok"] = c["num_experts"].get<int64_t>() + 1;
  e = error_of(c);
  EXPECT_NE(e.find("num_experts_per_tok (" + std::to_string(c["num_experts_per_tok"].get<int64_t>()) +
                   ") exceeds num_experts"),
            std::string::npos)
      << e;
}

// A small DeepSeek-V3 config.json written here (YaRN, groups, a dense first layer, a shared expert).
json deepseek_v3_config() {
  return json::parse(R"({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
    "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": true, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000, "vocab_size": 512,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": false, "num_nextn_predict_layers": 0})");
}

// Regression (issue 15): a key of the wrong JSON type escaped as nlohmann's type_error ("type must be boolean, but
// is string"), a float where an integer was read was cast with undefined behaviour, and absurd sizes
// (hidden_size 2^62, num_hidden_layers 10^12: a 10^12-entry layer list) reached the model. Each is now an Error
// naming the key, before anything is allocated.
TEST(HfConfig, HostileValuesAreErrorsNamingTheKey) {
  auto expect_refused = [](const json& c, const std::string& key) {
    try {
      apps::hf_model_config(c, "config.json under test", {{"--seq-length", "1"}});
      ADD_FAILURE() << "no error for " << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos) << e.what();
    }
  };
  const json q = qwen2_moe_config(), d = deepseek_v3_config();
  EXPECT_EQ(apps::hf_model_config(q, "qwen2", {{"--seq-length", "1"}}).hidden_size, 64);
  EXPECT_EQ(apps::hf_model_config(d, "deepseek", {{"--seq-length", "1"}}).hidden_size, 64);
  const std::vector<std::pair<std::string, json>> qwen_cases = {
      {"hidden_size", int64_t{1} << 62},
      {"hidden_size", "64"},
      {"hidden_size", 64.5},
      {"hidden_size", 18446744073709551615ull},
      {"num_hidden_layers", int64_t{1000000000000}},
      {"num_hidden_layers", 1e300},
      {"num_hidden_layers", -4},
      {"vocab_size", int64_t{1} << 40},
      {"rms_norm_eps", 1e300},
      {"rms_norm_eps", -1e-6},
      {"rms_norm_eps", "1e-6"},
      {"rope_theta", json::array()},
      {"use_sliding_window", "no"},
      {"mlp_only_layers", "3"},
      {"mlp_only_layers", json::array({int64_t{1} << 40})},
      {"decoder_sparse_step", 0},
      {"norm_topk_prob", 0},
      {"layer_types", json::object()},
  };
  for (const auto& [key, value] : qwen_cases) {
    json c = q;
    c[key] = value;
    expect_refused(c, key);
  }
  json big_layers = q;  // a huge layer count must fail before the layer pattern is expanded
  big_layers["num_hidden_layers"] = int64_t{1000000000000};
  big_layers["decoder_sparse_step"] = 2;
  expect_refused(big_layers, "num_hidden_layers");
  const std::vector<std::pair<std::string, json>> deepseek_cases = {
      {"seq_aux", "yes"},
      {"qk_head_dim", "24"},
      {"qk_head_dim", 24.0},
      {"n_shared_experts", int64_t{1} << 40},
      {"moe_intermediate_size", int64_t{1} << 62},
      {"quantization_config", json::array()},
      {"quantization_config", json::parse(R"({"quant_method": 8})")},
      {"quantization_config", json::parse(R"({"quant_method": "fp8", "fmt": 1})")},
      {"rope_scaling", json::parse(R"({"type": 5, "factor": 4})")},
      {"rope_scaling", json::parse(R"({"type": "yarn", "factor": "4", "original_max_position_embeddings": 64})")},
      {"rope_scaling", json::parse(R"({"type": "yarn", "factor": 4, "original_max_position_embeddings": 1e300})")},
      {"rope_scaling", json::parse(R"({"type": "yarn", "factor": 1e300, "original_max_position_embeddings": 64})")},
      {"rope_scaling", json::parse(R"({"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                       "beta_fast": "32"})")},
      {"rope_scaling", json::parse(R"({"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                       "mscale": [], "mscale_all_dim": 1})")},
      {"rope_scaling", json::parse(R"({"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                       "truncate": "no"})")},
      {"first_k_dense_replace", 1e300},
      {"n_group", 3.5},
      {"routed_scaling_factor", 1e39},
  };
  for (const auto& [key, value] : deepseek_cases) {
    json c = d;
    c[key] = value;
    expect_refused(c, key);
  }
  json wm = q;
  wm["model_type"] = 5;
  EXPECT_THROW(apps::hf_config_weight_map(wm, model::ModelConfig{}), Error);
  // JSON text: overflowing numbers and deep nesting are Errors naming the file.
  for (const std::string& text : {std::string(R"({"rms_norm_eps": 1e400})"), std::string(100000, '[')}) {
    try {
      apps::hf_config_parse(text, "the config under test");
      ADD_FAILURE() << "no error for " << text.substr(0, 40);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the config under test"), std::string::npos) << e.what();
    }
  }
}

// The fuzzer's seeds (fuzz/seeds/hf_config/) must stay valid configs, or the harness explores only error paths.
// A model without a recorded config.json exports with one written for its family (hf_config_for_model checks that
// it reads back to the same parameters and function); each golden family's model, and the guess of its family.
TEST(HfConfig, ConfigWrittenForAModelReadsBackInEveryFamily) {
  for (const char* c : {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "deepseek_v2_greedy",
                        "glm4_moe", "olmoe", "gpt_oss", "deepseek_v3_mtp"}) {
    const std::string dir = std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/" + c;
    const json original = apps::hf_config_load(dir, "--hf-config");
    const model::ModelConfig cfg = apps::hf_model_config(original, dir, {{"--seq-length", "1"}});
    const model::HfFamily family = model::hf_family_parse(original["model_type"].get<std::string>());
    EXPECT_EQ(model::hf_family_of(cfg), family) << c;
    json written;
    ASSERT_NO_THROW(written = apps::hf_config_for_model(cfg, family)) << c;
    EXPECT_EQ(written["model_type"], original["model_type"]) << c;
    const model::ModelConfig back = apps::hf_model_config(written, "written", {{"--seq-length", "1"}});
    EXPECT_TRUE(model::model_differences(cfg, back, "a", "b").empty()) << c;
  }
}

// A family refuses, by the flag, a model its modeling code cannot compute (the traits table in model/hf_weights.cpp).
TEST(HfConfig, FamiliesRefuseWhatTheirModelingCodeLacks) {
  const std::string dir = std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/";
  auto error = [&](const char* golden, const std::vector<std::pair<std::string, std::string>>& flags,
                   model::HfFamily family) {
    std::vector<std::pair<std::string, std::string>> all = {{"--seq-length", "1"}};
    all.insert(all.end(), flags.begin(), flags.end());
    const model::ModelConfig cfg = apps::hf_model_config(apps::hf_config_load(dir + golden, "--hf"), golden, all);
    try {
      model::hf_weight_map(cfg, family);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string e = error("qwen3_moe", {}, model::HfFamily::olmoe);
  EXPECT_NE(e.find("olmoe models cannot hold this model: QK-norm per head"), std::string::npos) << e;
  e = error("olmoe", {}, model::HfFamily::qwen3_moe);
  EXPECT_NE(e.find("--qk-layernorm-over-heads (its q_norm / k_norm run per head"), std::string::npos) << e;
  e = error("qwen3_moe", {}, model::HfFamily::glm4_moe);
  EXPECT_NE(e.find("glm4_moe models cannot hold this model: no shared expert"), std::string::npos) << e;
  e = error("qwen3_moe", {}, model::HfFamily::deepseek_v2);
  EXPECT_NE(e.find("deepseek_v2 models cannot hold this model: standard attention"), std::string::npos) << e;
  e = error("deepseek_v2", {}, model::HfFamily::deepseek_v3);
  EXPECT_NE(e.find("deepseek_v3 models cannot hold this model: no expert bias"), std::string::npos) << e;
  e = error("glm4_moe", {}, model::HfFamily::qwen3_moe);
  EXPECT_NE(e.find("positions other than RoPE over whole heads"), std::string::npos) << e;  // partial RoPE
  e = error("qwen2_moe", {}, model::HfFamily::qwen3_moe);
  EXPECT_NE(e.find("--add-qkv-bias (q/k/v biases) (only qwen2_moe and glm4_moe have it)"), std::string::npos) << e;
}

TEST(HfConfig, FuzzSeedsAreValidConfigs) {
  int seen = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(MOECORE_SOURCE_DIR) + "/fuzz/seeds/hf_config")) {
    std::ifstream f(e.path());
    const std::string text((std::istreambuf_iterator<char>(f)), {});
    const json c = apps::hf_config_parse(text, e.path().string());
    const model::ModelConfig cfg = apps::hf_model_config(c, e.path().string(), {{"--seq-length", "1"}});
    EXPECT_NO_THROW(apps::hf_config_weight_map(c, cfg)) << e.path();
    ++seen;
  }
  EXPECT_EQ(seen, 8);
}

using testing::CmdResult;
const auto run_cmd = testing::run_moecore;

TEST(HfConfig, TrainBuildsTheModelAndCommandLineFlagsWin) {
  namespace fs = std::filesystem;
  const std::string mixtral = shared_config("mixtral-8x7b"), qwen3 = shared_config("qwen3-30b-a3b");
  if (mixtral.empty() || qwen3.empty()) GTEST_SKIP() << "../shared/data/hf_configs not found";
  const fs::path dir = fs::temp_directory_path() / ("moecore_hf_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  testing::write_byte_corpus(dir, 100, "Document: the quick brown fox.");
  if (HasFatalFailure()) return;
  const std::string common = " --data-path " + (dir / "c_text_document").string() +
                             " --tokenizer-type ByteLevel --generate-tokens 0 --seq-length 32 --micro-batch-size 1 "
                             "--global-batch-size 2 --train-iters 1 --num-layers 2 --hidden-size 64 "
                             "--num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 96 --vocab-size 512 ";
  CmdResult r = run_cmd("train --hf-config " + mixtral + common + "--num-experts 4");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("moecore train: RMSNorm, rope, layers 2, hidden 64, heads 4 (kv 2, dim 16), ffn 96 swiglu, "
                          "vocab 512, seq 32, untied, f32, MoE 4 experts top-2 ffn 96 layer-freq 1"),
            std::string::npos)
      << r.output;
  // A model directory holding config.json, and the head dim and expert count from config.json kept.
  fs::create_directories(dir / "qwen3");
  fs::copy_file(qwen3, dir / "qwen3" / "config.json");
  r = run_cmd("train --hf-config " + (dir / "qwen3").string() + common + "--moe-ffn-hidden-size 32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("moecore train: RMSNorm, rope, qk-norm, layers 2, hidden 64, heads 4 (kv 2, dim 128), ffn "
                          "96 swiglu, vocab 512, seq 32, untied, f32, MoE 128 experts top-8 ffn 32 layer-freq 1"),
            std::string::npos)
      << r.output;
  r = run_cmd("train --hf-config " + (dir / "missing").string() + common);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--hf-config " + (dir / "missing").string() + ": no such file"), std::string::npos)
      << r.output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moecore

namespace moecore {
namespace {

// The config.json table and the model-flag table are linked by flag names: every flag a supported config.json
// translates to is a declared model flag and its value is accepted (an unknown or unsupported one would throw).
TEST(HfConfig, EveryTranslatedFlagIsAModelFlag) {
  std::vector<std::string> paths;
  for (const char* c :
       {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_tied", "deepseek_v3", "deepseek_v2lite", "deepseek_v3_mtp"})
    paths.push_back(std::string(MOECORE_SOURCE_DIR) + "/tests/golden/hf_models/" + c + "/config.json");
  for (const char* c : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"})
    if (!shared_config(c).empty()) paths.push_back(shared_config(c));
  for (const std::string& p : paths) {
    apps::Args a("t");
    const model::ModelConfig defaults;
    apps::add_model_flags(a, defaults);
    std::string argv0 = "t";
    char* argv[] = {argv0.data()};
    ASSERT_TRUE(a.parse(1, argv));
    const auto flags = apps::hf_config_flags(apps::hf_config_load(p, "--hf-config"));
    EXPECT_GE(flags.size(), 10u) << p;
    for (const auto& [flag, value] : flags) EXPECT_NO_THROW(a.fill_unset(flag, value, " in " + p)) << p << " " << flag;
  }
}

}  // namespace
}  // namespace moecore
