// Hugging Face <-> Megatron parameter layouts of the model families moecore imports and exports: Mixtral,
// Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, DeepSeek-V2, GLM-4.5, OLMoE (transformers' hub checkpoint names, one tensor per
// expert) and GPT-OSS (fused experts, read through column runs; MXFP4 experts dequantised). Every moecore
// parameter is a concatenation of row runs of HF tensors, both viewed as [rows, width] with the same width (the last
// dim; 1-D tensors: width 1): linear_qkv interleaves q_proj, k_proj and v_proj per query group (Megatron's [G, R + 2,
// D] layout), linear_fc1 stacks gate_proj over up_proj (SwiGLU's [gate; up]), and the experts' fc1/fc2 stack the
// experts; DeepSeek-V3's interleaved RoPE channels (rope_interleave) are de-interleaved row by row in q_b_proj / q_proj
// and kv_a_proj_with_mqa (the scores are unchanged: q and k are permuted alike). DeepSeek-V3's e_score_correction_bias
// is the router's expert bias (router state, not a parameter). Copies are exact (no arithmetic), so HF -> moecore -> HF
// returns the same bytes. Not here: config.json keys (apps/hf_config), file formats (io/hf_checkpoint).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moecore/core/param.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/model/config.h"
#include "moecore/model/gpt.h"

namespace moecore::model {

enum class HfFamily : uint8_t { mixtral, qwen2_moe, qwen3_moe, deepseek_v3, deepseek_v2, glm4_moe, olmoe, gpt_oss };
HfFamily hf_family_parse(const std::string& model_type);  // config.json's model_type; throws naming the supported
const char* hf_family_name(HfFamily family);              // "mixtral", ...
// The family whose modeling code computes what cfg computes: gpt_oss with attention sinks or quick-GEGLU; with MLA
// deepseek_v3 (expert bias) or deepseek_v2; glm4_moe with an expert bias or partial RoPE; olmoe with QK-norm over
// heads, qwen3_moe with QK-norm; qwen2_moe with a QKV bias or a shared expert; else mixtral. Throws (via
// hf_weight_map) when none can.
HfFamily hf_family_of(const ModelConfig& cfg);

// Rows [param_row, param_row + rows) of a parameter are rows [hf_row, hf_row + rows) of HF tensor `hf`; or, for a
// column run (col0 >= 0: GPT-OSS's fused, transposed experts), columns col0, col0 + col_stride, ... of the matrix
// hf[hf_row] of HF tensor `hf` viewed as [lead, R, C] (lead its first dim, C its last, R = the parameter's width).
struct HfRowRun {
  std::string hf;
  int64_t hf_row = 0, param_row = 0, rows = 0;
  int64_t col0 = -1, col_stride = 1;
  bool columns() const { return col0 >= 0; }
};

struct HfParamMap {
  std::string param;           // Megatron name
  Shape shape;                 // global shape
  int64_t width = 1;           // row width of the parameter and of its HF tensors
  bool expert = false;         // dim 0 indexes experts (sharded over EP)
  std::vector<HfRowRun> runs;  // ascending param_row, covering every row once
  int64_t rows() const { return shape.numel() / width; }
};

struct HfTensorSpec {
  std::string name;
  Shape shape;
  std::vector<std::pair<size_t, size_t>> sources;  // (parameter, run) pairs filling it, ascending hf_row
  int64_t expert_bias_layer = -1;  // >= 0: the router's expert bias of that layer (no parameter, no gradient)
  std::string copy_of;  // DeepSeek-V3's MTP copies of the embedding / output head: that tensor's (no own gradient)
};

struct HfWeightMap {
  HfFamily family = HfFamily::mixtral;
  std::vector<HfParamMap> params;     // parameter_specs(cfg) order
  std::vector<HfTensorSpec> tensors;  // every HF tensor of the model, where a parameter (of params) first names it
  // Parameters of the model that the checkpoint lacks and hf_import leaves at their initial values (Megatron's init):
  // fresh MTP layers (hf_weight_map_without_mtp). Not in `params`.
  std::vector<std::string> initialised;
};

// Throws Error naming the setting when cfg has something the family's modeling code lacks (LayerNorm, learned
// positions, linear biases, GeLU, a dense layer in Mixtral, QK-norm outside Qwen3, MLA outside DeepSeek, ...).
// rope_interleave: DeepSeek-V3's config.json key (transformers' default true); ignored by the other families.
HfWeightMap hf_weight_map(const ModelConfig& cfg, HfFamily family, bool rope_interleave = true);

// The map of cfg less DeepSeek-V3's MTP layers (checkpoint layers num_layers + k, with their copies of the embedding
// and head), whose parameters are listed in `initialised`: for a checkpoint that transformers' save_pretrained wrote
// (it drops those layers) loaded with fresh MTP layers (--mtp-num-layers given).
HfWeightMap hf_weight_map_without_mtp(const ModelConfig& cfg, HfFamily family, bool rope_interleave = true);

// Parts are at most this many elements (32 MiB in f32) whatever the tensor's size: the streaming bound.
inline constexpr int64_t kHfPartElements = int64_t{8} << 20;

// Calls sink(rows [first_row, first_row + n) of the parameter) in ascending order, each part a [k, width] (1-D:
// [k]) f32 tensor of at most kHfPartElements elements (or one row) read from the HF checkpoint, until rows
// [first_row, last_row) are delivered. Memory: one part; for an FP8 weight with a 128x128 block scale
// (`<name>_scale_inv`, DeepSeek-V3) the whole dequantised f32 tensor, read once per parameter.
void hf_read_param_rows(const HfParamMap& map, const io::HfCheckpointReader& hf, int64_t first_row, int64_t last_row,
                        const std::function<void(const Tensor& part)>& sink);

// Checks that the checkpoint holds exactly the map's tensors (plus `<name>_scale_inv` block scales of FP8 weights)
// with the map's shapes and float dtypes; throws naming the directory, the tensor and expected vs found (an extra
// tensor is refused: it would be silently dropped).
void hf_check_tensors(const HfWeightMap& map, const io::HfCheckpointReader& hf);

// Checks that each copy (copy_of) holds the same bytes as its original, streaming; throws naming both.
void hf_check_copies(const HfWeightMap& map, const io::HfCheckpointReader& hf);

// Fills this rank's parameters (expert parameters hold experts [ep_rank * n, (ep_rank + 1) * n); a pipeline stage
// its own layers, embeddings and heads) and its routers' expert biases from the checkpoint, after hf_check_tensors, and
// refreshes the compute copies. The map's `initialised` parameters keep their values.
void hf_import(const HfWeightMap& map, const io::HfCheckpointReader& hf, GptModel& gpt);

// One HF tensor assembled from parameter rows: rows(param index, first_row, n) returns those rows of the global
// parameter as a [n, width] (1-D: [n]) tensor. Export walks map.tensors and writes each.
Tensor hf_gather(const HfWeightMap& map, const HfTensorSpec& tensor,
                 const std::function<Tensor(size_t param, int64_t first_row, int64_t rows)>& rows);
// The same in parts, for streaming writers: sink gets the tensor's rows in order, at most kHfPartElements
// elements (or one row) at a time, each part from one rows() call.
void hf_gather_parts(const HfWeightMap& map, const HfTensorSpec& tensor,
                     const std::function<Tensor(size_t param, int64_t first_row, int64_t rows)>& rows,
                     const std::function<void(const Tensor& part)>& sink);

}  // namespace moecore::model
