// `moecore convert`: Hugging Face checkpoints in and out (docs/hf-models.md).
//   --from-hf HF_DIR --save ROOT   writes ROOT/iter_0000000, a weights-only moecore checkpoint (any EP layout)
//   --load ROOT --to-hf OUT_DIR    writes OUT_DIR: sharded safetensors, model.safetensors.index.json, config.json
// Both stream: one part of at most kHfPartElements elements (plus an 8 MiB conversion chunk and the shard headers;
// an FP8 weight is dequantised whole) is in memory at a time, whatever the model's size. Copies are exact, so an
// export of an import is bit-identical.
// Output appears only when complete: the checkpoint through the commit protocol (io/checkpoint.h), the HF
// directory through a staging directory renamed into place.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "apps/args.h"
#include "apps/commands.h"
#include "apps/hf_config.h"
#include "apps/hf_load.h"
#include "apps/model_flags.h"
#include "moecore/core/memory.h"
#include "moecore/core/rng.h"
#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/io/hf_checkpoint.h"
#include "moecore/io/json.h"
#include "moecore/model/config_record.h"
#include "moecore/model/hf_weights.h"
#include "moecore/model/param_specs.h"
#include "moecore/train/checkpointing.h"

namespace moecore::apps {
namespace {

using nlohmann::json;

// Conversion reads no activations: the sequence length only has to pass validation against the position limit.
const std::vector<std::pair<std::string, std::string>> kWeightsOnly = {{"--seq-length", "1"}};

// "5GB", "500MB", "2GiB", "1.5GB", "1000000" -> bytes (HF's units: GB = 10^9, GiB = 2^30): a decimal number (digits
// with at most one '.') and a unit, from 1 byte to kMaxShardBytes. Anything else ("1.2.3MB", "-1", "1e3", "0.1B")
// is refused naming the flag.
constexpr uint64_t kMaxShardBytes = uint64_t{1} << 40;  // 1 TiB: HF's default is 5GB

uint64_t parse_size(const std::string& s) {
  const auto bad = [&]() -> uint64_t {
    MOECORE_FAIL("--max-shard-size '", s,
                 "' is not a size from 1 byte to 1TiB: a number with at most one '.' and a unit B, KB, MB, GB, KiB, "
                 "MiB or GiB (e.g. 5GB, 500MB, 2GiB, or bytes)");
  };
  size_t i = 0, dots = 0, digits = 0;
  for (; i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.'); ++i)
    (s[i] == '.' ? dots : digits) += 1;
  if (digits == 0 || dots > 1 || digits > 30) return bad();
  const std::string unit = s.substr(i);
  double mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  if (unit == "KB") mult = 1e3;
  if (unit == "MB") mult = 1e6;
  if (unit == "GB") mult = 1e9;
  if (unit == "KiB") mult = 1024.0;
  if (unit == "MiB") mult = 1048576.0;
  if (unit == "GiB") mult = 1073741824.0;
  const double bytes = std::strtod(s.substr(0, i).c_str(), nullptr) * mult;
  if (mult == 0 || !(bytes >= 1) || !(bytes <= static_cast<double>(kMaxShardBytes))) return bad();
  return static_cast<uint64_t>(bytes);
}

uint64_t max_shard_bytes(const Args& a) {
  const std::string s = a.str("--max-shard-size");
  return parse_size(s.empty() ? "5GB" : s);  // "" is unset (Megatron's None): HF's default
}

DType parse_dtype(const std::string& s, const std::string& where) {
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "fp16" || s == "f16" || s == "float16") return DType::f16;
  if (s == "fp32" || s == "f32" || s == "float32") return DType::f32;
  MOECORE_FAIL(where, " '", s, "' is not one of bf16, fp16, fp32");
}

// A parameter the checkpoint lacks (fresh MTP layers), initialised as training initialises it (ParamStore: values
// from seed, name and global element index alone), in parts; routed experts split over the EP files like the rest.
void write_initialised(std::vector<std::unique_ptr<io::SafetensorsStreamWriter>>& files, const std::string& name,
                       const model::ModelConfig& cfg, int64_t ep, uint64_t seed) {
  const std::vector<model::ParamSpec> specs = model::parameter_specs(cfg);
  const auto s = std::find_if(specs.begin(), specs.end(), [&](const model::ParamSpec& x) { return x.name == name; });
  MOECORE_CHECK(s != specs.end(), "no parameter ", name);
  const int64_t shards = s->expert && ep > 1 ? ep : 1, n = s->shape.numel() / shards;
  for (int64_t r = 0; r < shards; ++r) {
    Shape shape = s->shape;
    shape[0] /= shards;
    io::SafetensorsStreamWriter& w = *files[shards > 1 ? 1 + r : 0];
    w.begin(name, DType::f32, shape);
    for (int64_t at = 0; at < n; at += model::kHfPartElements) {
      Tensor part = Tensor::empty({std::min(model::kHfPartElements, n - at)}, DType::f32, MemCategory::workspace);
      if (s->init == model::ParamInit::normal)
        rng_fill_normal(part, seed, name, 0.0f, s->std, static_cast<uint64_t>(r * n + at));
      else
        part.fill_(s->init == model::ParamInit::ones ? 1.0f : 0.0f);
      w.append(part);
    }
  }
}

void import_hf(const Args& a) {
  const std::string src = a.str("--from-hf"), root = a.str("--save");
  const int64_t ep = a.i64("--expert-model-parallel-size");
  const uint64_t seed = static_cast<uint64_t>(a.i64("--seed"));
  std::string config_text = io::read_file(hf_config_path(src, "--from-hf"));
  json config = hf_config_parse(config_text, src + "/config.json");
  const io::HfCheckpointReader hf(src);
  std::vector<std::pair<std::string, std::string>> flags = kWeightsOnly;
  const bool given_mtp = a.given("--mtp-num-layers");
  if (given_mtp) flags.emplace_back("--mtp-num-layers", a.str("--mtp-num-layers"));
  const json original = config;
  const bool mtp_fresh = hf_mtp_adjust(
      config, hf, given_mtp ? std::optional<int64_t>(a.i64("--mtp-num-layers")) : std::nullopt, "convert", stdout);
  if (config != original) config_text = config.dump(2) + "\n";  // the record describes the model written (no MTP)
  const model::ModelConfig cfg = hf_model_config(config, "--from-hf " + src, flags);
  const model::HfWeightMap map = hf_load_weight_map(config, cfg, mtp_fresh);
  const model::HfFamily family = map.family;
  if (ep < 1 || cfg.moe.num_experts % ep != 0)
    MOECORE_FAIL("--expert-model-parallel-size (", ep, ") must divide the number of experts (", cfg.moe.num_experts,
                 ")");
  model::hf_check_tensors(map, hf);
  model::hf_check_copies(map, hf);
  if (!io::checkpoint_list_committed(root).empty())
    MOECORE_FAIL("--save ", root, " already holds a checkpoint; hint: convert into a new directory");
  const std::string token = "convert" + std::to_string(::getpid());
  const std::string staging = io::checkpoint_staging_begin(root, 0, token);
  // A failure leaves nothing behind: the staging directory goes (discovery would ignore it, but it is litter).
  struct RemoveOnFailure {
    std::string dir;
    bool done = false;
    ~RemoveOnFailure() {
      std::error_code ec;
      if (!done) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{staging};
  std::map<std::string, io::CheckpointFileInfo> infos;
  {
    std::vector<std::unique_ptr<io::SafetensorsStreamWriter>> files;  // [0]: model; [1 + r]: EP rank r's experts
    files.push_back(std::make_unique<io::SafetensorsStreamWriter>(staging + "/" + train::kCheckpointModelFile));
    for (int64_t r = 0; ep > 1 && r < ep; ++r)
      files.push_back(
          std::make_unique<io::SafetensorsStreamWriter>(staging + "/" + train::checkpoint_expert_file(r, ep)));
    for (const model::HfParamMap& p : map.params) {
      const int64_t shards = p.expert && ep > 1 ? ep : 1, rows = p.rows() / shards;
      for (int64_t r = 0; r < shards; ++r) {
        io::SafetensorsStreamWriter& w = *files[shards > 1 ? 1 + r : 0];
        Shape shape = p.shape;
        shape[0] /= shards;
        w.begin(p.param, DType::f32, shape);
        model::hf_read_param_rows(p, hf, r * rows, (r + 1) * rows, [&](const Tensor& part) { w.append(part); });
      }
    }
    for (const std::string& name : map.initialised) write_initialised(files, name, cfg, ep, seed);
    for (const model::HfTensorSpec& t : map.tensors)  // DeepSeek-V3's e_score_correction_bias: the expert bias
      if (t.expert_bias_layer >= 0)
        files[0]->add(train::checkpoint_expert_bias_name(t.expert_bias_layer), hf.read(t.name, DType::f32));
    for (auto& f : files) {
      f->finish();
      infos[f->path().substr(staging.size() + 1)] = io::checkpoint_file_info(f->path());
    }
  }
  io::CheckpointWriteRequest req;
  req.iteration = 0;
  req.state_json = train::weights_only_state_json(cfg, ep, config_text);
  io::checkpoint_staging_commit(root, req, token, infos, /*keep_last=*/0);
  cleanup.done = true;
  std::printf(
      "convert: %s (%s, %zu tensors, %.1f MB) -> %s/iter_0000000 (%zu parameters, expert-parallel size %lld); "
      "peak resident memory %.1f MB; train from it with --load %s --finetune (or --no-load-optim --no-load-rng)\n",
      src.c_str(), model::hf_family_name(family), hf.tensors().size(), static_cast<double>(hf.total_bytes()) / 1e6,
      root.c_str(), map.params.size(), static_cast<long long>(ep),
      static_cast<double>(memory_resident_peak_bytes()) / 1e6, root.c_str());
}

// The config.json an export writes, and where it came from (errors name it).
struct ExportConfig {
  std::string text, where;
};

ExportConfig export_config(const Args& a, const io::VerifiedCheckpoint& ck, const std::string& dir) {
  const json state = io::parse_json(ck.state_json, ck.dir + "/state.json");
  // The model as trained (state.json's record; older checkpoints: the model flags given here) and its config.json:
  // --hf-config's (which must describe that model), else the recorded one updated to what was trained, else one
  // written for the model by the table.
  const std::string recorded_hf = state.contains("hf_config_json") && state["hf_config_json"].is_string()
                                      ? state["hf_config_json"].get<std::string>()
                                      : "";
  const std::string recorded_where = dir + "/state.json (hf_config_json)";
  // The training-only settings (initialisation, loss coefficients, dropout) come from the config it was imported with.
  model::ModelConfig base;
  if (!recorded_hf.empty())
    base = hf_model_config(hf_config_parse(recorded_hf, recorded_where), recorded_where, kWeightsOnly);
  const std::optional<model::ModelConfig> recorded = train::checkpoint_recorded_model(ck.state_json, ck.dir, base);
  auto refuse_differences = [&](const model::ModelConfig& given, const std::string& what) {
    const std::vector<std::string> diffs = model::model_differences(*recorded, given, "trained", what);
    if (diffs.empty()) return;
    std::string list;
    for (const std::string& d : diffs) list += "\n  " + d;
    MOECORE_FAIL("convert: the model ", ck.dir, " records (trained) and ", what, " differ:", list, "\nhint: leave ",
                 what, " out: the checkpoint records its model, and the export writes that");
  };
  if (recorded && model_flags_given(a))
    refuse_differences(model_config_from(a, recorded->vocab_size), "the model flags");
  std::string config_text;
  std::string where;
  if (!a.str("--hf-config").empty()) {
    where = hf_config_path(a.str("--hf-config"), "--hf-config");
    config_text = io::read_file(where);
    if (recorded)
      refuse_differences(hf_model_config(hf_config_parse(config_text, where), where, kWeightsOnly),
                         "--hf-config " + where);
  } else if (!recorded_hf.empty()) {
    where = recorded_where;
    config_text = recorded_hf;
    if (recorded && !model::model_differences(*recorded, base, "trained", "imported").empty()) {
      config_text = hf_config_update(hf_config_parse(config_text, where), *recorded, where).dump(2) + "\n";
      std::printf(
          "convert: %s was trained with settings that differ from the config.json it came from; writing "
          "the trained model's\n",
          ck.dir.c_str());
    }
  } else {  // a model trained from Megatron flags: its config.json written by the table
    const model::ModelConfig flags_cfg = recorded ? *recorded : model_config_from(a, 0);
    const model::HfFamily family = a.str("--hf-model-type").empty() ? model::hf_family_of(flags_cfg)
                                                                    : model::hf_family_parse(a.str("--hf-model-type"));
    json generated = hf_config_for_model(flags_cfg, family);
    config_text = generated.dump(2) + "\n";
    where = std::string("the config.json written for the model") + (recorded ? "" : " flags") + " (" +
            model::hf_family_name(family) + ")";
    std::printf("convert: %s records no config.json; writing one for the %s (model_type %s)\n", ck.dir.c_str(),
                recorded ? "trained model" : "model flags", model::hf_family_name(family));
  }
  return {config_text, where};
}

// Every tensor of the map into `writer`, in `dtype`, read from the checkpoint's model file (the experts, when the
// checkpoint's expert-parallel size ep is over 1: from its ep expert files).
void export_tensors(io::HfCheckpointWriter& writer, const model::HfWeightMap& map,
                    const io::HfCheckpointReader& model_file,
                    const std::vector<std::unique_ptr<io::HfCheckpointReader>>& expert_files, int64_t ep, DType dtype) {
  // Rows [first, first + n) of the map's [rows, width] view of a parameter (the file's rows may be wider: GPT-OSS's fc1
  // bias is mapped element by element), as an f32 [n, width] tensor.
  auto read = [](const io::HfCheckpointReader& f, const model::HfParamMap& m, int64_t first, int64_t n) {
    const int64_t fw = io::hf_row_width(f.info(m.param).shape);
    if (fw == m.width) return f.read_rows(m.param, first, n, DType::f32);
    const int64_t e0 = first * m.width, e1 = (first + n) * m.width, r0 = e0 / fw, r1 = (e1 + fw - 1) / fw;
    const Tensor covering = f.read_rows(m.param, r0, r1 - r0, DType::f32);
    return covering.view({covering.numel()}).slice(0, e0 - r0 * fw, e1 - r0 * fw).clone().view({n, m.width});
  };
  auto rows = [&](size_t p, int64_t first, int64_t n) {
    const model::HfParamMap& m = map.params[p];
    if (!m.expert || ep == 1) return read(model_file, m, first, n);
    const int64_t per = m.rows() / ep, r = first / per;
    MOECORE_CHECK((first + n - 1) / per == r, "a run of ", m.param, " spans expert shards");
    return read(*expert_files[static_cast<size_t>(r)], m, first - r * per, n);
  };
  for (const model::HfTensorSpec& t : map.tensors) {
    if (t.expert_bias_layer >= 0) {  // e_score_correction_bias: F32 as DeepSeek-V3 keeps it
      writer.add(t.name, model_file.read(train::checkpoint_expert_bias_name(t.expert_bias_layer), DType::f32));
      continue;
    }
    writer.begin(t.name, dtype, t.shape);
    model::hf_gather_parts(map, t, rows, [&](const Tensor& part) { writer.append(part); });
  }
}

void export_hf(const Args& a) {
  const std::string root = a.str("--load"), out = a.str("--to-hf");
  const auto dir = io::checkpoint_find_latest(
      root, a.i64_or("--ckpt-step", -1) >= 0 ? std::optional<int64_t>(a.i64("--ckpt-step")) : std::nullopt);
  if (!dir) MOECORE_FAIL("--load ", root, ": no committed checkpoint");
  const io::VerifiedCheckpoint ck = io::checkpoint_verify(*dir);
  const train::TrainStateJson parsed = train::train_state_parse(ck.state_json, ck.dir);  // strict: an Error if damaged
  if (parsed.iteration != ck.iteration)
    MOECORE_FAIL("checkpoint: '", ck.dir, "/state.json' records iteration ", parsed.iteration, " but COMMIT records ",
                 ck.iteration, ".", io::checkpoint_recovery_hint(ck.dir));
  ExportConfig exported = export_config(a, ck, *dir);
  std::string& config_text = exported.text;
  const std::string& where = exported.where;
  const json config = hf_config_parse(config_text, where);
  const model::ModelConfig cfg = hf_model_config(config, where, kWeightsOnly);
  train::check_checkpoint_model(ck.state_json, cfg, ck.dir);
  const model::HfWeightMap map = hf_config_weight_map(config, cfg);
  const model::HfFamily family = map.family;
  const int64_t ep = parsed.expert_model_parallel_size;
  if (ep < 1 || (ep > 1 && cfg.moe.num_experts % ep != 0))
    MOECORE_FAIL("checkpoint ", ck.dir, ": expert_model_parallel_size ", ep, " does not divide ", cfg.moe.num_experts,
                 " experts");
  const io::HfCheckpointReader model_file(ck.dir, train::kCheckpointModelFile);
  std::vector<std::unique_ptr<io::HfCheckpointReader>> expert_files;
  for (int64_t r = 0; ep > 1 && r < ep; ++r)
    expert_files.push_back(std::make_unique<io::HfCheckpointReader>(ck.dir, train::checkpoint_expert_file(r, ep)));
  std::string dtype_text = a.str("--hf-dtype");
  if (dtype_text.empty()) dtype_text = hf_config_dtype(config).value_or("bfloat16");
  const DType dtype = parse_dtype(dtype_text, a.str("--hf-dtype").empty() ? "config.json dtype" : "--hf-dtype");
  io::HfCheckpointWriter writer(out, max_shard_bytes(a));
  export_tensors(writer, map, model_file, expert_files, ep, dtype);
  if (config.contains("quantization_config")) {  // FP8 weights were dequantised on import; these are not FP8
    json plain = config;
    plain.erase("quantization_config");
    config_text = plain.dump(2) + "\n";
    std::printf("convert: the weights are written in %s, so config.json loses its quantization_config\n",
                std::string(dtype_name(dtype)).c_str());
  }
  writer.set_config_json(config_text);
  const int shards = writer.finish();
  std::printf(
      "convert: %s (iteration %lld) -> %s (%s, %zu tensors in %d shard%s, %s, %.1f MB); peak resident memory %.1f "
      "MB\n",
      ck.dir.c_str(), static_cast<long long>(ck.iteration), out.c_str(), model::hf_family_name(family),
      map.tensors.size(), shards, shards == 1 ? "" : "s", std::string(dtype_name(dtype)).c_str(),
      static_cast<double>(writer.total_bytes()) / 1e6, static_cast<double>(memory_resident_peak_bytes()) / 1e6);
}

}  // namespace

int convert_main(int argc, char** argv) {
  Args a("convert");
  a.option("--from-hf", "", "import: Hugging Face model directory (config.json, safetensors shards and index)")
      .option("--save", "", "import: checkpoint root to write (iteration 0, weights only)")
      .option("--expert-model-parallel-size", "1", "import: expert-parallel size of the written checkpoint's layout")
      .option("--seed", "1234",
              "import: seed of the layers the checkpoint lacks (--mtp-num-layers N on a checkpoint without MTP "
              "layers: N fresh MTP layers, initialised as train --seed initialises them)")
      .option("--load", "", "export: checkpoint root (its newest committed iteration) or iteration directory")
      .option("--ckpt-step", "", "export: load this iteration of --load instead of the newest")
      .option("--to-hf", "", "export: Hugging Face model directory to write (must not exist, or be empty)")
      .option("--hf-config", "",
              "export: config.json (or a directory holding one) of the model; default: the one recorded in the "
              "checkpoint (by convert --from-hf, or train --hf-config / --load-hf), else one written for the "
              "model flags given here (as in training)")
      .option("--hf-dtype", "", "export: bf16 | fp16 | fp32 (default: config.json's dtype / torch_dtype, else bf16)")
      .option("--max-shard-size", "5GB", "export: largest shard file (HF units: 5GB = 5e9 bytes)")
      .option("--hf-model-type", "",
              "export without a recorded config.json: mixtral | qwen2_moe | qwen3_moe | deepseek_v3 | deepseek_v2 | "
              "glm4_moe | olmoe | gpt_oss (unset: the family that holds the model flags)")
      .domain("--expert-model-parallel-size", FlagDomain::integer(1, 1e6))
      .domain("--ckpt-step", FlagDomain::integer(0, 1e12))
      .domain("--seed", FlagDomain::integer(0, 4294967295.0));
  const model::ModelConfig defaults;
  add_model_flags(a, defaults);  // export without a recorded config.json: the model flags of the training run
  if (!a.parse(argc, argv)) return 0;
  (void)max_shard_bytes(a);  // checked like a numeric flag: up front, whether or not this is an export
  const bool in = !a.str("--from-hf").empty() || !a.str("--save").empty();
  const bool out = !a.str("--load").empty() || !a.str("--to-hf").empty();
  if (in == out)
    MOECORE_FAIL("convert: give either --from-hf HF_DIR --save ROOT (import) or --load ROOT --to-hf OUT_DIR (export)");
  if (in && (a.str("--from-hf").empty() || a.str("--save").empty()))
    MOECORE_FAIL("convert: an import needs both --from-hf and --save");
  if (out && (a.str("--load").empty() || a.str("--to-hf").empty()))
    MOECORE_FAIL("convert: an export needs both --load and --to-hf");
  if (in)
    import_hf(a);
  else
    export_hf(a);
  return 0;
}

}  // namespace moecore::apps
