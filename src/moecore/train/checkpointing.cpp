#include "moecore/train/checkpointing.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>

#include "moecore/io/checkpoint.h"
#include "moecore/io/file_util.h"
#include "moecore/io/json.h"
#include "moecore/model/config_record.h"
#include "moecore/model/layer_pattern.h"
#include "moecore/model/param_specs.h"
#include "moecore/parallel/shards.h"

namespace moecore::train {
namespace {

using nlohmann::json;
constexpr const char* kModelFile = kCheckpointModelFile;
constexpr const char* kOptimizerFile = "optimizer.safetensors";

json base_fingerprint(const model::ModelConfig& c) {
  return {{"num_layers", c.num_layers},
          {"hidden_size", c.hidden_size},
          {"num_attention_heads", c.num_attention_heads},
          {"num_query_groups", c.query_groups()},
          {"kv_channels", c.head_dim()},
          {"ffn_hidden_size", c.ffn()},
          {"vocab_size", c.vocab_size},
          {"num_experts", c.moe.num_experts},
          {"moe_ffn_hidden_size", c.moe.enabled() ? c.moe_ffn() : 0},
          {"moe_layer_freq", c.moe_layer_freq},
          {"swiglu", c.swiglu},
          {"normalization", c.normalization == model::Normalization::layernorm ? "LayerNorm" : "RMSNorm"},
          {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights}};
}

json model_fingerprint(const model::ModelConfig& c) {
  json f = base_fingerprint(c);
  if (c.mtp_num_layers > 0) f["mtp_num_layers"] = c.mtp_num_layers;  // absent otherwise: older checkpoints match
  if (c.multi_latent_attention)
    f["mla"] = {c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim};
  return f;
}

// The tensor `name` of `file`, which must have like's dtype and shape. `file` is the path shown in errors.
const Tensor& need(const io::SafetensorsFile& f, const std::string& file, const std::string& name, const Shape& shape,
                   DType dtype) {
  auto it = f.tensors.find(name);
  if (it == f.tensors.end()) MOECORE_FAIL("checkpoint: '", file, "' has no tensor '", name, "'");
  if (!(it->second.shape() == shape) || it->second.dtype() != dtype)
    MOECORE_FAIL("checkpoint: '", file, "' tensor '", name, "' is ", it->second.str(), " but the model expects ",
                 shape.str(), " ", dtype_name(dtype));
  return it->second;
}
const Tensor& need(const io::SafetensorsFile& f, const std::string& file, const std::string& name, const Tensor& like) {
  return need(f, file, name, like.shape(), like.dtype());
}

// Field readers for state.json: the type and range are checked, so no nlohmann exception and no overflowing
// conversion can escape.
[[noreturn]] void bad_field(const std::string& dir, const std::string& key, const std::string& why) {
  MOECORE_FAIL("checkpoint: '", dir, "/state.json' field \"", key, "\" ", why);
}
int64_t int_field(const json& j, const std::string& key, const std::string& dir, int64_t min,
                  std::optional<int64_t> fallback = std::nullopt) {
  if (!j.contains(key)) {
    if (fallback) return *fallback;
    bad_field(dir, key, "is missing");
  }
  const json& v = j[key];
  if (!v.is_number_integer()) bad_field(dir, key, "is " + std::string(v.type_name()) + ", not an integer");
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    bad_field(dir, key, "is out of range: " + v.dump());
  const int64_t x = v.get<int64_t>();
  if (x < min) bad_field(dir, key, "is " + std::to_string(x) + ", less than " + std::to_string(min));
  return x;
}
float float_field(const json& j, const std::string& key, const std::string& dir) {
  if (!j.contains(key) || !j[key].is_number()) bad_field(dir, key, "is missing or not a number");
  const double d = j[key].get<double>();
  if (!std::isfinite(d) || std::fabs(d) > std::numeric_limits<float>::max())
    bad_field(dir, key, "is " + j[key].dump() + ", not a finite float");
  return static_cast<float>(d);
}
std::string string_field(const json& j, const std::string& key, const std::string& dir) {
  if (!j.contains(key) || !j[key].is_string()) bad_field(dir, key, "is missing or not a string");
  return j[key].get<std::string>();
}

json scheduler_to_json(const OptParamSchedulerState& s) {
  return {{"max_lr", static_cast<double>(s.max_lr)},    {"min_lr", static_cast<double>(s.min_lr)},
          {"lr_warmup_steps", s.lr_warmup_steps},       {"lr_decay_steps", s.lr_decay_steps},
          {"lr_decay_style", s.lr_decay_style},         {"wsd_decay_steps", s.wsd_decay_steps},
          {"lr_wsd_decay_style", s.lr_wsd_decay_style}, {"num_steps", s.num_steps}};
}

OptParamSchedulerState scheduler_from_json(const json& j, const std::string& dir) {
  if (!j.is_object()) bad_field(dir, "opt_param_scheduler", "is not an object");
  OptParamSchedulerState s;
  s.max_lr = float_field(j, "max_lr", dir);
  s.min_lr = float_field(j, "min_lr", dir);
  s.lr_warmup_steps = float_field(j, "lr_warmup_steps", dir);
  if (s.lr_warmup_steps < 0) bad_field(dir, "lr_warmup_steps", "is negative");
  s.lr_decay_steps = int_field(j, "lr_decay_steps", dir, 0);
  s.lr_decay_style = string_field(j, "lr_decay_style", dir);
  s.wsd_decay_steps = int_field(j, "wsd_decay_steps", dir, 0);
  s.lr_wsd_decay_style = string_field(j, "lr_wsd_decay_style", dir);
  s.num_steps = int_field(j, "num_steps", dir, 0);
  return s;
}

json grad_scaler_to_json(const GradScalerState& s) {
  return {{"scale", static_cast<double>(s.scale)},
          {"growth_tracker", s.growth_tracker},
          {"hysteresis_tracker", s.hysteresis_tracker}};
}

GradScalerState grad_scaler_from_json(const json& j, const std::string& dir) {
  if (!j.is_object()) bad_field(dir, "grad_scaler", "is not an object");
  GradScalerState s;
  s.scale = float_field(j, "scale", dir);
  if (!(s.scale > 0) || !std::isfinite(s.scale)) bad_field(dir, "grad_scaler.scale", "is not a positive number");
  s.growth_tracker = int_field(j, "growth_tracker", dir, 0);
  s.hysteresis_tracker = int_field(j, "hysteresis_tracker", dir, INT64_MIN);
  return s;
}

// Shortest text that reads back as the same value (two learning rates that differ never print alike).
std::string value_text(float v) {
  char b[32];
  const auto r = std::to_chars(b, b + sizeof b, v);
  return std::string(b, r.ptr);
}
std::string value_text(double v) {
  char b[32];
  const auto r = std::to_chars(b, b + sizeof b, v);
  return std::string(b, r.ptr);
}
std::string value_text(int64_t v) {
  return std::to_string(v);
}
std::string value_text(const std::string& v) {
  return v;
}

}  // namespace

OptParamSchedulerState opt_param_scheduler_resolve(const OptParamSchedulerState& run,
                                                   const OptParamSchedulerState& saved, int64_t iteration,
                                                   bool override_opt_param_scheduler,
                                                   bool use_checkpoint_opt_param_scheduler, const std::string& dir) {
  if (override_opt_param_scheduler && use_checkpoint_opt_param_scheduler)
    MOECORE_FAIL("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other ",
                 "(both override and use-checkpoint are set)");
  if (override_opt_param_scheduler) {
    OptParamSchedulerState s = run;
    s.num_steps = iteration;
    return s;
  }
  if (use_checkpoint_opt_param_scheduler) return saved;
  auto check = [&](const auto& cls, const auto& sd, const char* name, const char* flag) {
    if (cls == sd) return;
    MOECORE_FAIL("OptimizerParamScheduler: class input value ", value_text(cls), " and checkpoint value ",
                 value_text(sd), " for ", name, " (", flag, ") do not match (checkpoint ", dir,
                 "); pass --override-opt_param-scheduler to use the command-line values or ",
                 "--use-checkpoint-opt_param-scheduler to use the checkpoint's");
  };
  // Megatron's order and names; the WSD fields (which Megatron does not save) only where they shape the LR.
  check(run.max_lr, saved.max_lr, "learning rate", "--lr");
  check(run.min_lr, saved.min_lr, "minimum learning rate", "--min-lr");
  check(run.lr_warmup_steps, saved.lr_warmup_steps, "warmup iterations", "--lr-warmup-iters");
  check(run.lr_decay_steps, saved.lr_decay_steps, "total number of iterations",
        "--lr-decay-iters, or --train-iters when that is 0");
  check(run.lr_decay_style, saved.lr_decay_style, "learning rate decay style", "--lr-decay-style");
  if (run.lr_decay_style == "WSD") {
    check(run.wsd_decay_steps, saved.wsd_decay_steps, "WSD decay iterations", "--lr-wsd-decay-iters");
    check(run.lr_wsd_decay_style, saved.lr_wsd_decay_style, "WSD decay style", "--lr-wsd-decay-style");
  }
  return saved;
}

uint64_t parameter_hash(const model::GptModel& gpt) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& p : gpt.params()) {
    const Tensor host = p.value.to_device(Device::cpu);  // device parameters are hashed from a host copy
    const auto* b = static_cast<const unsigned char*>(host.raw());
    for (int64_t i = 0; i < p.value.nbytes(); ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  }
  return h;
}

namespace {

// The ranks of a pipeline stage that write a checkpoint together: tp x dp x cp (dp alone without TP and CP).
const ProcessGroup& stage_group(const TrainGroups& g) {
  const bool split = g.tp.size() > 1 || g.cp.size() > 1;
  const ProcessGroup& all = split ? g.tp_dp : g.dp;
  if (split && all.size() != g.stage_size())
    MOECORE_FAIL("checkpoint: the tp_dp group has ", all.size(), " ranks, not tp (", g.tp.size(), ") x dp (",
                 g.dp.size(), ") x cp (", g.cp.size(), ")");
  return all;
}

// Collective over `pp`: runs `first_stage` on the first pipeline stage (whose ranks write every stage's parts) and
// tells the other stages how it went, so that a failure stops every rank alike.
void on_first_stage(const ProcessGroup& pp, const std::function<void()>& first_stage, const char* what) {
  std::string error;
  std::vector<int64_t> ok = {1};
  if (pp.rank() == 0) {
    try {
      first_stage();
    } catch (const Error& e) {
      error = e.what();
      ok[0] = 0;
    }
  }
  broadcast(std::span<int64_t>(ok), 0, pp);
  if (!ok[0])
    MOECORE_FAIL(pp.rank() == 0 ? error : std::string("checkpoint: the first pipeline stage failed to ") + what);
}

// Collective over `all`: its rank 0 (the committer) creates the staging directory every rank writes into; returns its
// token (the committer's pid).
std::string staging_open(const std::string& root, int64_t iteration, const ProcessGroup& all) {
  std::vector<int64_t> token = {all.rank() == 0 ? static_cast<int64_t>(::getpid()) : 0};
  broadcast(std::span<int64_t>(token), 0, all);
  const std::string tok = (all.size() > 1 ? "mr" : "") + std::to_string(token[0]);
  std::string error;
  std::vector<int64_t> ok = {1};
  if (all.rank() == 0) {
    try {
      io::checkpoint_staging_begin(root, iteration, tok);
    } catch (const Error& e) {
      error = e.what();
      ok[0] = 0;
    }
  }
  broadcast(std::span<int64_t>(ok), 0, all);
  if (!ok[0]) MOECORE_FAIL(all.rank() == 0 ? error : "checkpoint: rank 0 could not create the staging directory");
  return tok;
}

// Collective over `all`: every rank's outcome is gathered ({status 1 wrote an expert file / 0 nothing of that kind /
// -1 failed, its index, bytes, crc}); when every rank succeeded the committer commits with every file listed, else it
// removes the staging directory and every rank fails (a rank that failed with its own error, naming the file).
void staging_close(const CheckpointSaveInFlight& s, const std::map<std::string, io::CheckpointFileInfo>& written,
                   const std::string& error, const ProcessGroup& all) {
  constexpr int kFields = 4;
  std::vector<int64_t> mine = {0, s.shard_index, 0, 0}, every(static_cast<size_t>(kFields * all.size()));
  if (!error.empty()) {
    mine[0] = -1;
  } else if (s.shard_index >= 0) {
    const io::CheckpointFileInfo& info = written.at(checkpoint_expert_file(s.shard_index, s.num_shards));
    mine = {1, s.shard_index, static_cast<int64_t>(info.bytes), static_cast<int64_t>(info.crc32c)};
  }
  all_gather(std::span<int64_t>(every), std::span<const int64_t>(mine), all);
  int failed_rank = -1;
  for (int r = 0; r < all.size() && failed_rank < 0; ++r)
    if (every[kFields * r] < 0) failed_rank = r;
  if (failed_rank >= 0) {
    if (all.rank() == 0) io::checkpoint_staging_remove(s.root, s.iteration, s.token);  // no rank writes any more
    MOECORE_FAIL(!error.empty() ? error
                                : "checkpoint: rank " + std::to_string(failed_rank) + " of group '" + all.name() +
                                      "' failed to write its part of the checkpoint");
  }
  std::string commit_error;
  std::vector<int64_t> ok = {1};
  if (all.rank() == 0) {
    std::map<std::string, io::CheckpointFileInfo> files = written;  // the committer's own
    for (int r = 0; r < all.size(); ++r) {
      const int64_t* f = every.data() + kFields * r;
      if (f[0] == 1)
        files[checkpoint_expert_file(f[1], s.num_shards)] = {static_cast<uint64_t>(f[2]), static_cast<uint32_t>(f[3])};
    }
    try {
      io::checkpoint_staging_commit(s.root, s.request, s.token, files, s.keep_last);
    } catch (const Error& e) {
      commit_error = e.what();
      ok[0] = 0;
    }
  }
  broadcast(std::span<int64_t>(ok), 0, all);
  if (!ok[0]) MOECORE_FAIL(all.rank() == 0 ? commit_error : "checkpoint: rank 0 could not commit the checkpoint");
}

// Pipeline parallelism: the stages after the first send their parts of the files (maps[k] for file k; null: not
// written) to the rank of the first stage with the same other coordinates (pp rank 0), which merges them: the files
// hold every layer whatever the PP size. Point-to-point over pp, stage by stage; the entries are described by an i64
// header per tensor (file, dtype, rank, dims, name length) and their names as i32 characters.
void gather_pipeline_stages(const std::array<std::map<std::string, Tensor>*, 3>& maps, const ProcessGroup& pp) {
  constexpr int kHeader = 4 + kMaxDims;  // file, dtype, ndim, name length, dims
  if (pp.rank() > 0) {
    std::vector<int64_t> header;
    std::vector<int32_t> names;
    std::vector<const Tensor*> data;
    for (size_t k = 0; k < maps.size(); ++k) {
      if (!maps[k]) continue;
      for (const auto& [name, t] : *maps[k]) {
        header.insert(header.end(), {static_cast<int64_t>(k), static_cast<int64_t>(t.dtype()), t.shape().ndim,
                                     static_cast<int64_t>(name.size())});
        for (int d = 0; d < kMaxDims; ++d) header.push_back(t.shape().d[d]);
        for (char c : name) names.push_back(static_cast<unsigned char>(c));
        data.push_back(&t);
      }
    }
    const std::vector<int64_t> sizes = {static_cast<int64_t>(data.size()), static_cast<int64_t>(names.size())};
    send(std::span<const int64_t>(sizes), 0, pp);
    send(std::span<const int64_t>(header), 0, pp);
    send(std::span<const int32_t>(names), 0, pp);
    for (const Tensor* t : data) send(t->is_contiguous() ? *t : t->clone(), 0, pp);
    return;
  }
  for (int stage = 1; stage < pp.size(); ++stage) {
    std::vector<int64_t> sizes(2);
    recv(std::span<int64_t>(sizes), stage, pp);
    std::vector<int64_t> header(static_cast<size_t>(sizes[0] * kHeader));
    std::vector<int32_t> names(static_cast<size_t>(sizes[1]));
    recv(std::span<int64_t>(header), stage, pp);
    recv(std::span<int32_t>(names), stage, pp);
    size_t at = 0;
    for (int64_t e = 0; e < sizes[0]; ++e) {
      const int64_t* h = header.data() + e * kHeader;
      Shape shape;
      shape.ndim = static_cast<int>(h[2]);
      for (int d = 0; d < kMaxDims; ++d) shape.d[d] = h[4 + d];
      std::string name;
      for (int64_t c = 0; c < h[3]; ++c) name.push_back(static_cast<char>(names[at++]));
      Tensor t = Tensor::empty(shape, static_cast<DType>(h[1]), MemCategory::workspace);
      recv(t, stage, pp);
      if (std::map<std::string, Tensor>* m = maps[static_cast<size_t>(h[0])]) (*m)[name] = t;
    }
  }
}

}  // namespace

std::string checkpoint_expert_bias_name(int64_t layer) {
  return "router_state." + std::to_string(layer) + ".expert_bias";
}

std::string checkpoint_fp8_state_name(const std::string& linear) {
  return std::string(kFp8StatePrefix) + linear;
}

std::string checkpoint_expert_file(int64_t ep_rank, int64_t ep) {
  char b[96];
  std::snprintf(b, sizeof b, "experts-ep%03lld-of-%03lld.safetensors", static_cast<long long>(ep_rank),
                static_cast<long long>(ep));
  return b;
}

std::string weights_only_state_json(const model::ModelConfig& cfg, int64_t ep, const std::string& hf_config_json) {
  json state = {{"format", "moecore-train-state"},
                {"version", 1},
                {"iteration", 0},
                {"consumed_samples", 0},
                {"seed", 0},
                {"expert_model_parallel_size", ep},
                {"data_parallel_size", 1},
                {"model", model_fingerprint(cfg)},
                {"model_config", model::model_record(cfg)}};
  if (!hf_config_json.empty()) state["hf_config_json"] = hf_config_json;
  return state.dump(1);
}

namespace {
json parse_state(std::string_view state_json, const std::string& dir) {
  const json state = io::parse_json(state_json, "checkpoint: '" + dir + "/state.json'");
  if (!state.is_object() || !state.contains("format") || state["format"] != "moecore-train-state" ||
      !state.contains("version") || state["version"] != 1)
    MOECORE_FAIL("checkpoint: '", dir, "/state.json' is not a moecore training state (format/version)");
  if (!state.contains("model") || !state["model"].is_object())
    bad_field(dir, "model", "is missing or not an object (the model fingerprint)");
  return state;
}
}  // namespace

namespace {
// The FP8 flags of a config, as state.json records them ("" without FP8).
std::string fp8_flags(const model::ModelConfig& c) {
  if (!c.fp8.on) return "";
  return std::string("--fp8-format ") + enum_name(c.fp8.format) + " --fp8-recipe " + enum_name(c.fp8.recipe);
}
}  // namespace

TrainStateJson train_state_parse(std::string_view state_json, const std::string& dir) {
  const json state = parse_state(state_json, dir);
  TrainStateJson t;
  t.iteration = int_field(state, "iteration", dir, 0);
  t.consumed_samples = int_field(state, "consumed_samples", dir, 0);
  if (state.contains("seed")) {
    if (!state["seed"].is_number_unsigned()) bad_field(dir, "seed", "is not an integer >= 0");
    t.seed = state["seed"].get<uint64_t>();
  }
  t.expert_model_parallel_size = int_field(state, "expert_model_parallel_size", dir, 1, 1);
  if (state.contains("optimizer_steps")) t.optimizer_steps = int_field(state, "optimizer_steps", dir, 0);
  if (state.contains("optimizer")) {
    if (!state["optimizer"].is_string()) bad_field(dir, "optimizer", "is not a string");
    try {
      t.optimizer = enum_parse<optim::OptimizerKind>(state["optimizer"].get<std::string>(), "optimizer");
    } catch (const Error& e) {
      bad_field(dir, "optimizer", e.what());
    }
  }
  if (state.contains("fp8")) {
    if (!state["fp8"].is_string()) bad_field(dir, "fp8", "is not a string");
    t.fp8 = state["fp8"].get<std::string>();
  }
  if (state.contains("muon_scalar_optimizer")) {
    if (!state["muon_scalar_optimizer"].is_string()) bad_field(dir, "muon_scalar_optimizer", "is not a string");
    try {
      t.scalar = enum_parse<optim::ScalarOptimizer>(state["muon_scalar_optimizer"].get<std::string>(),
                                                    "muon_scalar_optimizer");
    } catch (const Error& e) {
      bad_field(dir, "muon_scalar_optimizer", e.what());
    }
  }
  if (state.contains("opt_param_scheduler")) t.scheduler = scheduler_from_json(state["opt_param_scheduler"], dir);
  if (state.contains("grad_scaler")) t.grad_scaler = grad_scaler_from_json(state["grad_scaler"], dir);
  if (state.contains("router_calls")) {
    const json& c = state["router_calls"];
    if (!c.is_array()) bad_field(dir, "router_calls", "is not an array");
    std::vector<int64_t> calls;
    for (size_t l = 0; l < c.size(); ++l) {
      if (!c[l].is_number_unsigned() || c[l].get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        bad_field(dir, "router_calls", "has an entry " + c[l].dump().substr(0, 32) + " that is not an integer >= 0");
      calls.push_back(c[l].get<int64_t>());
    }
    t.router_calls = std::move(calls);
  }
  return t;
}

std::string checkpoint_model_difference(const std::string& state_json, const model::ModelConfig& cfg,
                                        const std::string& dir) {
  const json state = parse_state(state_json, dir);
  const json& saved = state["model"];
  const json want = model_fingerprint(cfg);
  for (const auto& [k, v] : want.items()) {
    // A layer pattern compares by the layers it makes MoE, not by its spelling ("[0]+[1]" == "[0]*1+[1]*1").
    if (k == "moe_layer_freq" && saved.contains(k) && saved[k].is_string() && cfg.moe.enabled()) {
      try {
        if (model::parse_layer_pattern(saved[k].get<std::string>(), cfg.num_layers, "moe_layer_freq") ==
            cfg.moe_layers())
          continue;
      } catch (const Error&) {
        // an unparsable saved pattern differs: reported below
      }
    }
    if (!saved.contains(k) || saved[k] != v)
      return k + " = " + (saved.contains(k) ? saved[k].dump().substr(0, 200) : std::string("(absent)")) +
             " but the model has " + k + " = " + v.dump();
  }
  return "";
}

void check_checkpoint_model(const std::string& state_json, const model::ModelConfig& cfg, const std::string& dir) {
  const std::string diff = checkpoint_model_difference(state_json, cfg, dir);
  if (!diff.empty()) MOECORE_FAIL("checkpoint: ", dir, " was saved with ", diff);
}

std::optional<model::ModelConfig> checkpoint_recorded_model(const std::string& state_json, const std::string& dir,
                                                            const model::ModelConfig& base) {
  const json state = parse_state(state_json, dir);
  if (!state.contains("model_config")) return std::nullopt;  // saved before the record existed
  return model::model_from_record(state["model_config"], "checkpoint: '" + dir + "/state.json'", base);
}

void check_checkpoint_function(const std::string& state_json, const model::ModelConfig& cfg, const std::string& dir,
                               bool finetune, bool notes) {
  static const model::ModelConfig kDefaults;
  const std::optional<model::ModelConfig> saved = checkpoint_recorded_model(state_json, dir, kDefaults);
  if (!saved) return;
  const std::vector<std::string> diffs = model::model_differences(*saved, cfg, "checkpoint", "this run");
  if (diffs.empty()) return;
  std::string list;
  for (const std::string& d : diffs) list += "\n  " + d;
  if (finetune) {
    if (notes)
      std::fprintf(stderr,
                   "checkpoint: note: %s was trained as another model; --finetune continues from its weights "
                   "with this run's settings:%s\n",
                   dir.c_str(), list.c_str());
    return;
  }
  MOECORE_FAIL(
      "checkpoint: ", dir, " was trained with settings that change what the model computes from its weights, ",
      "and this run's differ:", list,
      "\nResuming would continue another model from these weights; hint: resume with the checkpoint's values, ",
      "or pass --finetune to start a new run from the weights with this run's settings");
}

void check_save_directory(const std::string& root, const model::ModelConfig& cfg) {
  for (int64_t it : io::checkpoint_list_committed(root)) {
    const std::string dir = io::checkpoint_iteration_dir(root, it);
    std::string why;
    try {
      const std::string diff =
          checkpoint_model_difference(io::read_file(dir + "/" + io::kCheckpointStateFile), cfg, dir);
      if (!diff.empty()) why = "a checkpoint of another model (saved with " + diff + ")";
    } catch (const Error& e) {
      why = std::string("a checkpoint whose state.json cannot be read (") + e.what() + ")";
    }
    if (!why.empty())
      MOECORE_FAIL("--save ", root, " holds ", dir, ", ", why,
                   ": saving into it would mix two models' checkpoints under one tracker; hint: give a new --save ",
                   "directory, or pass --allow-other-models-in-save to save beside it (--keep-last-checkpoints then ",
                   "removes only this model's checkpoints)");
  }
}

OptimizerState OptimizerState::adam(std::vector<Tensor> exp_avg, std::vector<Tensor> exp_avg_sq, int64_t steps) {
  OptimizerState st;
  st.slots = {{"exp_avg", std::move(exp_avg)}, {"exp_avg_sq", std::move(exp_avg_sq)}};
  st.steps = steps;
  return st;
}

OptimizerState::Slot* OptimizerState::slot(std::string_view key) {
  for (Slot& s : slots)
    if (s.key == key) return &s;
  return nullptr;
}

std::vector<std::string> optimizer_state_keys(optim::OptimizerKind optimizer, optim::ScalarOptimizer scalar,
                                              const std::string& name, int ndim, bool expert_parallel) {
  if (optimizer != optim::OptimizerKind::muon) return {"exp_avg", "exp_avg_sq"};
  if (optim::muon_managed(name, ndim, expert_parallel)) return {"momentum_buffer"};
  if (scalar == optim::ScalarOptimizer::lion) return {"exp_avg"};
  return {"exp_avg", "exp_avg_sq"};
}

CheckpointSaveInFlight checkpoint_save_begin(const std::string& root, const model::GptModel& gpt,
                                             const OptimizerState& opt, const TrainProgress& progress, uint64_t seed,
                                             int keep_last, const TrainGroups* groups,
                                             const CheckpointSaveOptions& options) {
  if (keep_last < 0) MOECORE_FAIL("checkpoint: keep_last (", keep_last, ") must be >= 0 (0 keeps all)");
  const TrainGroups g = groups ? *groups : TrainGroups{};
  const auto& params = gpt.params();
  if (options.save_optim)
    for (const OptimizerState::Slot& s : opt.slots)
      if (s.per_param.size() != params.size())
        MOECORE_FAIL("checkpoint: the optimizer state has ", s.per_param.size(), " ", s.key, " tensors for ",
                     params.size(), " parameters");
  const int64_t EP = gpt.ep_size();
  io::CheckpointWriteRequest req;
  req.iteration = progress.iteration;
  req.same_model = [cfg = gpt.config()](const std::string& state) {  // a copy: an async save outlives the call
    try {
      return checkpoint_model_difference(state, cfg, "").empty();
    } catch (const Error&) {
      return false;  // not a training state this version reads: not known to be this model's
    }
  };
  auto& model = req.files[kModelFile];
  std::map<std::string, Tensor>* optim = options.save_optim ? &req.files[kOptimizerFile] : nullptr;
  std::map<std::string, Tensor> shard;
  // The writer reads host memory: device tensors are copied to the host (CPU ones are used as they are). Tensor-
  // parallel shards are gathered into the whole tensor (collective over tp, for the experts' slices over etp): the
  // files do not depend on TP or ETP.
  auto host = [&](const Param& p, const Tensor& t) {
    return all_gather_shards(t, p.tp, p.expert_parallel ? g.etp : g.tp);
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const bool sharded = EP > 1 && params[i].expert_parallel;
    (sharded ? shard : model)[params[i].name] = host(params[i], params[i].value);
    if (!optim) continue;
    auto& o = sharded ? shard : *optim;
    for (const OptimizerState::Slot& s : opt.slots)
      if (s.per_param[i].defined()) o[s.key + "." + params[i].name] = host(params[i], s.per_param[i]);
  }
  std::vector<int64_t> layer_calls;
  for (int64_t l = 0; l < gpt.config().num_transformer_layers(); ++l) {
    const moe::RouterState* st = gpt.router_state(l);
    layer_calls.push_back(st ? st->calls : 0);
    if (st && st->expert_bias.defined()) model[checkpoint_expert_bias_name(l)] = st->expert_bias.to_device(Device::cpu);
  }
  if (g.pp.size() > 1) all_reduce_sum(std::span<int64_t>(layer_calls), g.pp);  // each stage counts its layers
  // Delayed scaling's quantizer state, the same on every rank of a stage (reduced over TP x DP x CP; an expert slot by
  // its local index): an expert linear's as one row per global expert, expert e holding local expert e mod E/EP's.
  if (const nn::Fp8Delayed* d = gpt.fp8_delayed())
    for (const auto& [name, r] : d->records()) {
      const int64_t rows = r.experts > 0 ? gpt.config().moe.num_experts : r.gemms, row = 3 * (1 + r.history);
      Tensor t = Tensor::empty({rows, 3, 1 + r.history}, DType::f32, MemCategory::workspace);
      for (int64_t e = 0; e < rows; ++e)
        std::copy_n(r.slots.data() + (e % r.gemms) * row, row, t.data<float>() + e * row);
      model[checkpoint_fp8_state_name(name)] = t;
    }
  const json calls = layer_calls;
  // A part saved without (--no-save-optim, --no-save-rng) is an absent key, so old checkpoints read as complete.
  json state = {{"format", "moecore-train-state"},
                {"version", 1},
                {"iteration", progress.iteration},
                {"consumed_samples", progress.consumed_samples},
                {"seed", seed},
                {"expert_model_parallel_size", EP},
                {"tensor_model_parallel_size", g.tp.size()},
                {"expert_tensor_parallel_size", g.etp.size()},
                {"data_parallel_size", g.dp.size()},
                {"model", model_fingerprint(gpt.config())},
                {"model_config", model::model_record(gpt.config())}};
  if (options.save_optim) {
    state["optimizer_steps"] = opt.steps;
    if (opt.optimizer != optim::OptimizerKind::adam) state["optimizer"] = enum_name(opt.optimizer);
    if (opt.scalar != optim::ScalarOptimizer::adam) state["muon_scalar_optimizer"] = enum_name(opt.scalar);
    if (options.scheduler) state["opt_param_scheduler"] = scheduler_to_json(*options.scheduler);
    if (options.grad_scaler) state["grad_scaler"] = grad_scaler_to_json(*options.grad_scaler);
  }
  if (!fp8_flags(gpt.config()).empty()) state["fp8"] = fp8_flags(gpt.config());
  if (options.save_rng) state["router_calls"] = calls;
  if (g.pp.size() > 1) state["pipeline_model_parallel_size"] = g.pp.size();
  if (!options.hf_config_json.empty()) state["hf_config_json"] = options.hf_config_json;
  req.state_json = state.dump(1);
  const ProcessGroup& all = stage_group(g);
  const bool writes_shard = EP > 1 && g.edp.rank() == 0 && g.etp.rank() == 0;
  // Pipelines: the first stage writes every stage's part.
  if (g.pp.size() > 1 && (all.rank() == 0 || writes_shard))  // (the same on every stage: its ranks share coordinates)
    gather_pipeline_stages(
        {all.rank() == 0 ? &model : nullptr, all.rank() == 0 ? optim : nullptr, writes_shard ? &shard : nullptr}, g.pp);
  CheckpointSaveInFlight s;
  s.root = root;
  s.iteration = progress.iteration;
  s.keep_last = keep_last;
  s.writes = g.pp.rank() == 0;
  s.num_shards = EP;
  if (s.writes) {
    if (all.rank() == 0) s.files = std::move(req.files);
    if (writes_shard) {
      s.shard_index = g.ep.rank();
      s.files[checkpoint_expert_file(s.shard_index, EP)] = std::move(shard);
    }
  }
  req.files.clear();
  s.request = std::move(req);
  on_first_stage(
      g.pp,
      [&] {
        s.token = staging_open(root, s.iteration, all);
        s.staging_dir = io::checkpoint_iteration_dir(root, s.iteration) + ".tmp-" + s.token;
      },
      "create the staging directory");
  return s;
}

void checkpoint_save_finish(const CheckpointSaveInFlight& s,
                            const std::map<std::string, io::CheckpointFileInfo>& written, const std::string& error,
                            const TrainGroups* groups) {
  const TrainGroups g = groups ? *groups : TrainGroups{};
  on_first_stage(
      g.pp, [&] { staging_close(s, written, error, stage_group(g)); }, "write the checkpoint");
}

void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const OptimizerState& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last, const TrainGroups* groups,
                              const CheckpointSaveOptions& options) {
  const CheckpointSaveInFlight s = checkpoint_save_begin(root, gpt, opt, progress, seed, keep_last, groups, options);
  std::map<std::string, io::CheckpointFileInfo> written;
  std::string error;
  try {
    for (const auto& [name, tensors] : s.files)
      written[name] = io::checkpoint_staging_write(s.staging_dir, name, tensors);
  } catch (const Error& e) {
    error = e.what();
  }
  checkpoint_save_finish(s, written, error, groups);
}

void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const optim::AdamW& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last, const TrainGroups* groups,
                              const CheckpointSaveOptions& options) {
  save_training_checkpoint(root, gpt, OptimizerState::adam(opt.exp_avg(), opt.exp_avg_sq(), opt.steps_taken()),
                           progress, seed, keep_last, groups, options);
}

namespace {
// Copies rows [first, first + dst.size(0)) of the global [E, ...] tensor `name` into dst, from the file that
// holds it whole (saved at EP 1: shape [E, ...]) or from the EP shards that hold those rows (saved at EP > 1:
// shape [E / EP, ...] each). Every source must have dst's dtype and exactly that shape. With copy false only
// the checks run (a load checks everything before it writes anything).
void load_expert_rows(Tensor& dst, const io::LoadedCheckpoint& ck, const std::string& whole_file,
                      const std::string& name, int64_t first, int64_t saved_ep, int64_t num_experts, bool copy) {
  const int64_t n = dst.size(0);
  auto use = [&](const std::string& file, int64_t rows, int64_t src_first) {
    auto f = ck.files.find(file);
    if (f == ck.files.end())
      MOECORE_FAIL("checkpoint: ", ck.dir, " has no ", file, saved_ep > 1 ? " (saved at EP " : "",
                   saved_ep > 1 ? std::to_string(saved_ep) + ")" : "");
    const std::string path = ck.dir + "/" + file;
    auto it = f->second.tensors.find(name);
    if (it == f->second.tensors.end()) MOECORE_FAIL("checkpoint: '", path, "' has no tensor '", name, "'");
    const Tensor& src = it->second;
    Shape want = dst.shape();
    want[0] = rows;
    if (!(src.shape() == want) || src.dtype() != dst.dtype())
      MOECORE_FAIL("checkpoint: '", path, "' tensor '", name, "' is ", src.str(), " but ", want.str(), " ",
                   dtype_name(dst.dtype()), " is expected (", rows, " experts of ", dst.str(), ")");
    if (!copy) return;
    const int64_t lo = std::max(first, src_first), hi = std::min(first + n, src_first + rows);
    if (lo < hi) dst.slice(0, lo - first, hi - first).copy_from(src.slice(0, lo - src_first, hi - src_first));
  };
  if (saved_ep <= 1) {
    use(whole_file, num_experts, 0);
    return;
  }
  const int64_t per_shard = num_experts / saved_ep;
  for (int64_t j = 0; j < saved_ep; ++j) {
    if ((j + 1) * per_shard <= first || j * per_shard >= first + n) continue;
    use(checkpoint_expert_file(j, saved_ep), per_shard, j * per_shard);
  }
}
}  // namespace

bool loads_on_unexpected(CkptStrictness s) {
  return s != CkptStrictness::assume_ok_unexpected && s != CkptStrictness::raise_unexpected &&
         s != CkptStrictness::raise_all;
}

namespace {
// Tensors of the checkpoint that no parameter of the model (every pipeline stage's: the files hold the whole model)
// takes (Megatron's "missing" keys): a model built with flags that drop them (--disable-bias-linear,
// --position-embedding-type rope, no expert bias, ...) loads the rest and saves a smaller checkpoint. With raise_all an
// Error names them; in the other modes one warning line does. Tensors the model needs that the checkpoint lacks are
// found by the loads themselves (need, load_expert_rows).
void check_no_unexpected_tensors(const io::LoadedCheckpoint& ck, const model::ModelConfig& cfg, bool optimizer,
                                 optim::OptimizerKind kind, optim::ScalarOptimizer scalar, CkptStrictness strictness) {
  std::set<std::string> expected;
  for (const model::ParamSpec& p : model::parameter_specs(cfg)) {
    expected.insert(p.name);
    if (!optimizer) continue;
    for (const std::string& key : optimizer_state_keys(kind, scalar, p.name, p.shape.ndim, p.expert))
      expected.insert(key + "." + p.name);
  }
  const std::vector<model::LayerSpec> layers = model::layer_specs(cfg);
  for (size_t l = 0; l < layers.size(); ++l)
    if (layers[l].mlp == model::MlpKind::moe && cfg.moe.enable_expert_bias)
      expected.insert(checkpoint_expert_bias_name(static_cast<int64_t>(l)));
  std::vector<std::string> unexpected;
  for (const auto& [file, f] : ck.files) {
    if (file == kOptimizerFile && !optimizer) continue;  // not read
    for (const auto& [name, t] : f.tensors)  // (FP8 delayed-scaling state: read by a delayed run, else dropped)
      if (!expected.count(name) && !name.starts_with(kFp8StatePrefix)) unexpected.push_back(file + ": " + name);
  }
  if (unexpected.empty()) return;
  std::string list;
  for (size_t i = 0; i < unexpected.size() && i < 12; ++i) list += "\n  " + unexpected[i];
  if (unexpected.size() > 12) list += "\n  ... and " + std::to_string(unexpected.size() - 12) + " more";
  if (strictness != CkptStrictness::raise_all) {
    std::fprintf(stderr,
                 "warning: checkpoint %s holds %zu tensor%s that this model has no parameter for, not loaded "
                 "(--dist-ckpt-strictness raise_all refuses them):%s\n",
                 ck.dir.c_str(), unexpected.size(), unexpected.size() == 1 ? "" : "s", list.c_str());
    return;
  }
  MOECORE_FAIL("checkpoint: ", ck.dir, " holds ", unexpected.size(), " tensor", unexpected.size() == 1 ? "" : "s",
               " that this model has no parameter for:", list,
               "\nThe model was built with flags that leave them out (e.g. --disable-bias-linear, ",
               "--position-embedding-type, --moe-router-enable-expert-bias); loading the rest would drop them without ",
               "a word. Use the flags the checkpoint was saved with");
}
}  // namespace

namespace {
// state.json checked against COMMIT, the model and the load switches, before any tensor is read. A file that passed
// its checksum but disagrees with COMMIT or the model was written wrong or forged: the error says so and lists the
// checkpoints to fall back on.
TrainStateJson checked_train_state(const io::LoadedCheckpoint& ck, const model::ModelConfig& cfg, uint64_t seed,
                                   const CheckpointLoadOptions& options, bool load_optim, bool load_rng) {
  TrainStateJson state;
  try {
    state = train_state_parse(ck.state_json, ck.dir);
    if (state.iteration != ck.iteration)
      MOECORE_FAIL("checkpoint: '", ck.dir, "/state.json' records iteration ", state.iteration, " but '", ck.dir,
                   "/COMMIT' records ", ck.iteration, " (a damaged or mixed-up checkpoint)");
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "." + io::checkpoint_recovery_hint(ck.dir));
  }
  check_checkpoint_model(ck.state_json, cfg, ck.dir);
  check_checkpoint_function(ck.state_json, cfg, ck.dir, options.finetune, options.notes);
  if (load_rng && state.seed != seed && options.warnings)
    std::fprintf(stderr, "checkpoint: warning: %s was saved with --seed %llu, resuming with --seed %llu\n",
                 ck.dir.c_str(), static_cast<unsigned long long>(state.seed), static_cast<unsigned long long>(seed));
  if (!ck.files.count(kModelFile)) MOECORE_FAIL("checkpoint: ", ck.dir, " has no ", kModelFile);
  if (load_optim && !state.optimizer_steps)
    MOECORE_FAIL("checkpoint: unable to load the optimizer state from ", ck.dir,
                 ": it was saved with --no-save-optim (no moments, step count or scheduler state); specify ",
                 "--no-load-optim or --finetune to load it without the optimizer state");
  if (load_optim && !ck.files.count(kOptimizerFile))
    MOECORE_FAIL("checkpoint: unable to load the optimizer state from ", ck.dir, ": it has no ", kOptimizerFile,
                 "; specify --no-load-optim or --finetune to load it without the optimizer state");
  if (load_rng && !state.router_calls)
    MOECORE_FAIL("checkpoint: unable to load the rng state from ", ck.dir,
                 ": it was saved with --no-save-rng (no router noise-stream positions); specify --no-load-rng or ",
                 "--finetune to load it with the noise streams restarting as in a fresh run");
  const int64_t layers = cfg.num_transformer_layers();
  if (load_rng && static_cast<int64_t>(state.router_calls->size()) != layers)
    MOECORE_FAIL("checkpoint: '", ck.dir, "/state.json' has ", state.router_calls->size(), " router_calls entries for ",
                 layers, " layers.", io::checkpoint_recovery_hint(ck.dir));
  return state;
}

// The checkpoint's tensors into the model's parameters, the optimizer's moments (when loaded) and the routers' expert
// biases, each rank taking its tensor-parallel shard and its experts (any saved TP and EP). Megatron's "unexpected"
// keys (tensors the model asks for that the checkpoint lacks): the modes that load on leave each as it is (a
// parameter at its initial value, zero moments) and moecore names them; the others stop at need().
class CheckpointTensors {
 public:
  CheckpointTensors(const io::LoadedCheckpoint& ck, model::GptModel& gpt, OptimizerState& opt, bool load_optim,
                    int64_t saved_ep, CkptStrictness strictness)
      : ck_(ck),
        gpt_(gpt),
        opt_(opt),
        model_(ck.files.at(kModelFile)),
        optim_(load_optim ? &ck.files.at(kOptimizerFile) : nullptr),
        model_path_(ck.dir + "/" + kModelFile),
        optim_path_(ck.dir + "/" + kOptimizerFile),
        saved_ep_(saved_ep),
        E_(gpt.config().moe.num_experts),
        strictness_(strictness),
        load_on_(loads_on_unexpected(strictness)) {}

  // Two passes: every check first (copy false), so a load that fails leaves the model and optimizer untouched.
  void load(bool copy) {
    auto& params = gpt_.params();
    for (size_t i = 0; i < params.size(); ++i) {
      Param& p = params[i];
      if (p.expert_parallel) {  // resharding: this rank's experts out of whichever files hold them (its ETP slice)
        const int64_t first = gpt_.ep_rank() * p.value.size(0);
        experts(p, first, p.value, kModelFile, p.name, copy);
        if (!optim_) continue;
        for (OptimizerState::Slot& s : opt_.slots)
          if (s.per_param[i].defined()) experts(p, first, s.per_param[i], kOptimizerFile, s.key + "." + p.name, copy);
        continue;
      }
      take(p, p.value, model_, model_path_, p.name, copy);
      if (!optim_) continue;
      for (OptimizerState::Slot& s : opt_.slots)
        if (s.per_param[i].defined()) take(p, s.per_param[i], *optim_, optim_path_, s.key + "." + p.name, copy);
    }
    expert_biases(copy);
  }

  // The tensors left at their initial values ("file: name"), known after the first pass.
  const std::vector<std::string>& absent() const { return absent_; }

 private:
  bool lacks(const std::string& file, const std::string& name) const {
    const auto f = ck_.files.find(file);
    return f != ck_.files.end() && !f->second.tensors.count(name);
  }

  bool lacks_experts(const std::string& whole_file, const std::string& name) const {
    if (saved_ep_ <= 1) return lacks(whole_file, name);
    for (int64_t j = 0; j < saved_ep_; ++j)
      if (!lacks(checkpoint_expert_file(j, saved_ep_), name)) return false;
    return true;
  }

  bool leave(bool absent_here, bool copy, const std::string& file, const std::string& name) {
    if (!absent_here) return false;
    if (!load_on_)
      MOECORE_FAIL("checkpoint: '", ck_.dir, "/", file, "' has no tensor '", name,
                   "', which this model has (Megatron's unexpected key: --dist-ckpt-strictness ",
                   enum_name(strictness_),
                   " refuses the load; log_unexpected would load the rest and leave it at its initial value)");
    if (!copy) absent_.push_back(file + ": " + name);
    return true;
  }

  void experts(const Param& p, int64_t first, Tensor& dst, const std::string& file, const std::string& name,
               bool copy) {
    if (leave(lacks_experts(file, name), copy, saved_ep_ <= 1 ? file : "experts-ep*", name)) return;
    if (!p.tp.sharded()) return load_expert_rows(dst, ck_, file, name, first, saved_ep_, E_, copy);
    Tensor whole = Tensor::empty(p.tp.global_shape(dst.shape()), dst.dtype(), MemCategory::workspace);
    load_expert_rows(whole, ck_, file, name, first, saved_ep_, E_, copy);
    if (copy) dst.copy_from(shard_slice(whole, p.tp));
  }

  // The files hold whole tensors: a tensor-parallel rank takes its shard of each (any saved TP).
  void take(const Param& p, Tensor& dst, const io::SafetensorsFile& f, const std::string& path, const std::string& name,
            bool copy) {
    if (leave(!f.tensors.count(name), copy, path.substr(ck_.dir.size() + 1), name)) return;
    if (!p.tp.sharded()) {
      const Tensor& t = need(f, path, name, dst);
      if (copy) dst.copy_from(t);
      return;
    }
    const Tensor& t = need(f, path, name, p.tp.global_shape(dst.shape()), dst.dtype());
    if (copy) dst.copy_from(shard_slice(t, p.tp));
  }

  void expert_biases(bool copy) {
    const int64_t layers = gpt_.config().num_transformer_layers();
    for (int64_t l = 0; l < layers; ++l) {
      moe::RouterState* st = gpt_.router_state(l);
      if (!st || !st->expert_bias.defined()) continue;
      if (leave(!model_.tensors.count(checkpoint_expert_bias_name(l)), copy, kModelFile,
                checkpoint_expert_bias_name(l)))
        continue;
      const Tensor& b = need(model_, model_path_, checkpoint_expert_bias_name(l), st->expert_bias);
      if (copy) st->expert_bias.copy_from(b);
    }
  }

  const io::LoadedCheckpoint& ck_;
  model::GptModel& gpt_;
  OptimizerState& opt_;
  const io::SafetensorsFile& model_;
  const io::SafetensorsFile* optim_;  // null when the optimizer state is not loaded
  const std::string model_path_, optim_path_;
  const int64_t saved_ep_, E_;
  const CkptStrictness strictness_;
  const bool load_on_;
  std::vector<std::string> absent_;
};

// Delayed scaling's state of this rank's linears from a checkpoint (none: every quantizer starts afresh, as from a
// checkpoint saved with another recipe or without FP8): each linear's of this stage, [gemms, 3, 1 + L], an expert
// linear's rows of this rank's experts. Checked whole before anything is loaded.
std::map<std::string, nn::Fp8Delayed::Record> fp8_delayed_records(const io::LoadedCheckpoint& ck,
                                                                  const model::GptModel& gpt) {
  std::map<std::string, nn::Fp8Delayed::Record> out;
  if (!gpt.fp8_delayed()) return out;
  const int64_t E = gpt.config().moe.num_experts, local = E / gpt.ep_size();
  for (const auto& [name, t] : ck.files.at(kModelFile).tensors) {
    if (!name.starts_with(kFp8StatePrefix)) continue;
    const std::string linear = name.substr(std::strlen(kFp8StatePrefix));
    if (!gpt.holds_linear(linear)) continue;  // (another pipeline stage's)
    const bool experts = linear.find(".mlp.experts.") != std::string::npos;
    const int64_t rows = experts ? E : 1;
    if (t.dtype() != DType::f32 || t.dim() != 3 || t.size(0) != rows || t.size(1) != 3 || t.size(2) < 2)
      MOECORE_FAIL("checkpoint: '", ck.dir, "/", kModelFile, "' tensor '", name, "' is ", t.str(), ", expected [", rows,
                   ", 3, 1 + amax history] f32 (FP8 delayed scaling's slots", experts ? ", per expert" : "", ")");
    const int64_t first = experts ? gpt.ep_rank() * local : 0, gemms = experts ? local : 1;
    const Tensor mine = t.slice(0, first, first + gemms).clone();  // (contiguous)
    out[linear] = {experts ? local : 0, gemms, t.size(2) - 1,
                   std::vector<float>(mine.data<float>(), mine.data<float>() + mine.numel())};
  }
  return out;
}

// One warning names the tensors that the loading modes of --dist-ckpt-strictness left at their initial values.
void warn_absent_tensors(const std::string& dir, const std::vector<std::string>& absent, CkptStrictness strictness) {
  if (absent.empty()) return;
  std::string list;
  for (size_t i = 0; i < absent.size() && i < 12; ++i) list += "\n  " + absent[i];
  if (absent.size() > 12) list += "\n  ... and " + std::to_string(absent.size() - 12) + " more";
  std::fprintf(stderr,
               "warning: checkpoint %s lacks %zu tensor%s this model has (Megatron's unexpected keys), left at "
               "their initial values, moments zero (--dist-ckpt-strictness %s; assume_ok_unexpected, "
               "raise_unexpected and raise_all refuse such a load):%s\n",
               dir.c_str(), absent.size(), absent.size() == 1 ? "" : "s", enum_name(strictness), list.c_str());
}
}  // namespace

LoadedTrainingState load_training_state(const std::string& dir, model::GptModel& gpt, OptimizerState& opt,
                                        uint64_t seed, const CheckpointLoadOptions& options) {
  // Megatron: --finetune implies neither the optimizer nor the rng state, whatever the other switches say.
  const bool load_optim = options.load_optim && !options.finetune;
  const bool load_rng = options.load_rng && !options.finetune;
  const io::LoadedCheckpoint ck = io::checkpoint_load(dir);
  const TrainStateJson state = checked_train_state(ck, gpt.config(), seed, options, load_optim, load_rng);
  const size_t params = gpt.params().size();
  if (load_optim)
    for (const OptimizerState::Slot& s : opt.slots)
      if (s.per_param.size() != params)
        MOECORE_FAIL("checkpoint: the optimizer state has ", s.per_param.size(), " ", s.key, " tensors for ", params,
                     " parameters");
  const std::string fp8 = fp8_flags(gpt.config());
  if (!state.fp8.empty() && !fp8.empty() && state.fp8 != fp8)
    MOECORE_FAIL("checkpoint: ", ck.dir, " was trained with ", state.fp8, " but this run uses ", fp8,
                 "; give the checkpoint's FP8 flags (a run may switch FP8 on or off, not change its recipe)");
  if (load_optim && state.optimizer != opt.optimizer)
    MOECORE_FAIL("checkpoint: ", ck.dir, " holds the state of --optimizer ", enum_name(state.optimizer),
                 " but this run uses --optimizer ", enum_name(opt.optimizer),
                 "; specify --no-load-optim to load the weights and start the optimizer afresh");
  if (load_optim && state.scalar != opt.scalar)
    MOECORE_FAIL("checkpoint: ", ck.dir, " holds the state of --muon-scalar-optimizer ", enum_name(state.scalar),
                 " but this run uses --muon-scalar-optimizer ", enum_name(opt.scalar),
                 "; specify --no-load-optim to load the weights and start the optimizer afresh");
  const int64_t saved_ep = state.expert_model_parallel_size;
  const int64_t E = gpt.config().moe.num_experts;
  if (E > 0 && E % saved_ep != 0)
    MOECORE_FAIL("checkpoint: ", ck.dir, "/state.json has expert_model_parallel_size ", saved_ep, " for ", E,
                 " experts");
  CheckpointTensors tensors(ck, gpt, opt, load_optim, saved_ep, options.strictness);
  try {
    tensors.load(false);
    check_no_unexpected_tensors(ck, gpt.config(), load_optim, opt.optimizer, opt.scalar, options.strictness);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "." + io::checkpoint_recovery_hint(ck.dir));
  }
  warn_absent_tensors(ck.dir, tensors.absent(), options.strictness);
  std::map<std::string, nn::Fp8Delayed::Record> fp8_state = fp8_delayed_records(ck, gpt);
  tensors.load(true);
  if (nn::Fp8Delayed* d = gpt.fp8_delayed()) d->restore(std::move(fp8_state));
  if (!load_optim) {  // a fresh optimizer, whatever the tensors held before
    for (OptimizerState::Slot& s : opt.slots)
      for (Tensor& t : s.per_param)
        if (t.defined()) t.zero_();
  }
  const int64_t layers = gpt.config().num_transformer_layers();
  for (int64_t l = 0; l < layers; ++l)
    if (moe::RouterState* st = gpt.router_state(l)) st->calls = load_rng ? (*state.router_calls)[l] : 0;
  gpt.refresh_compute_weights();
  gpt.zero_grad();
  LoadedTrainingState out;
  out.optimizer_loaded = load_optim;
  out.rng_loaded = load_rng;
  opt.steps = load_optim ? *state.optimizer_steps : 0;
  if (load_optim) out.scheduler = state.scheduler;
  if (load_optim) out.grad_scaler = state.grad_scaler;
  if (!options.finetune) out.progress = {state.iteration, state.consumed_samples};
  return out;
}

LoadedTrainingState load_training_state(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt, uint64_t seed,
                                        const CheckpointLoadOptions& options) {
  OptimizerState st = OptimizerState::adam(opt.exp_avg(), opt.exp_avg_sq(), 0);  // handles: loading writes through
  const LoadedTrainingState loaded = load_training_state(dir, gpt, st, seed, options);
  opt.set_steps_taken(st.steps);
  return loaded;
}

TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, OptimizerState& opt,
                                       uint64_t seed) {
  return load_training_state(dir, gpt, opt, seed, CheckpointLoadOptions{}).progress;
}

TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt, uint64_t seed) {
  return load_training_state(dir, gpt, opt, seed, CheckpointLoadOptions{}).progress;
}

}  // namespace moecore::train
