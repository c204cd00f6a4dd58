#include "moecore/train/checkpointing.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "moecore/io/checkpoint.h"

namespace moecore::train {
namespace {

using nlohmann::json;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";

json model_fingerprint(const model::ModelConfig& c) {
  return {{"num_layers", c.num_layers},       {"hidden_size", c.hidden_size},
          {"num_attention_heads", c.num_attention_heads}, {"num_query_groups", c.query_groups()},
          {"kv_channels", c.head_dim()},     {"ffn_hidden_size", c.ffn()},
          {"vocab_size", c.vocab_size},      {"num_experts", c.moe.num_experts},
          {"moe_ffn_hidden_size", c.moe.enabled() ? c.moe_ffn() : 0},
          {"moe_layer_freq", c.moe_layer_freq}, {"swiglu", c.swiglu},
          {"normalization", c.normalization == model::Normalization::layernorm ? "LayerNorm" : "RMSNorm"},
          {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights}};
}

std::string bias_name(int64_t layer) { return "router_state." + std::to_string(layer) + ".expert_bias"; }

const Tensor& need(const io::SafetensorsFile& f, const std::string& file, const std::string& name, const Tensor& like) {
  auto it = f.tensors.find(name);
  if (it == f.tensors.end()) MOECORE_FAIL("checkpoint: ", file, " has no tensor '", name, "'");
  if (!(it->second.shape() == like.shape()))
    MOECORE_FAIL("checkpoint: ", file, " tensor '", name, "' has shape ", it->second.shape().str(),
                 " but the model expects ", like.shape().str());
  return it->second;
}

}  // namespace

uint64_t parameter_hash(const model::GptModel& gpt) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& p : gpt.params()) {
    const auto* b = static_cast<const unsigned char*>(p.value.raw());
    for (int64_t i = 0; i < p.value.nbytes(); ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  }
  return h;
}

namespace {

std::string expert_shard_file(int64_t r, int64_t ep) {
  char b[96];
  std::snprintf(b, sizeof b, "experts-ep%03lld-of-%03lld.safetensors", static_cast<long long>(r),
                static_cast<long long>(ep));
  return b;
}

// Collective over dp (size > 1): rank 0 writes committer_req, ranks with shard_index >= 0 write expert shard
// shard_index of num_shards, all into one staging directory; dp rank 0 commits.
// A failure on any rank fails the save on every rank (no rank waits forever for a peer that gave up).
void save_collective(const std::string& root, const io::CheckpointWriteRequest& committer_req,
                     int64_t shard_index, int64_t num_shards, const std::map<std::string, Tensor>& shard,
                     int keep_last,
                     const ProcessGroup& dp) {
  std::vector<int64_t> token = {dp.rank() == 0 ? static_cast<int64_t>(::getpid()) : 0};
  broadcast(std::span<int64_t>(token), 0, dp);
  const std::string tok = "mr" + std::to_string(token[0]);
  std::string error;
  std::vector<int64_t> ok = {1};
  if (dp.rank() == 0) {
    try {
      io::checkpoint_staging_begin(root, committer_req.iteration, tok);
    } catch (const Error& e) {
      error = e.what();
      ok[0] = 0;
    }
  }
  broadcast(std::span<int64_t>(ok), 0, dp);
  if (!ok[0]) MOECORE_FAIL(dp.rank() == 0 ? error : "checkpoint: rank 0 could not create the staging directory");
  // {status (1 written, 0 nothing, -1 failed), shard index, bytes, crc} per rank.
  constexpr int kFields = 4;
  std::vector<int64_t> mine = {0, shard_index, 0, 0}, all(static_cast<size_t>(kFields * dp.size()));
  if (shard_index >= 0) {
    try {
      const std::string staging = io::checkpoint_iteration_dir(root, committer_req.iteration) + ".tmp-" + tok;
      const io::CheckpointFileInfo info =
          io::checkpoint_staging_write(staging, expert_shard_file(shard_index, num_shards), shard);
      mine = {1, shard_index, static_cast<int64_t>(info.bytes), static_cast<int64_t>(info.crc32c)};
    } catch (const Error& e) {
      error = e.what();
      mine[0] = -1;
    }
  }
  all_gather(std::span<int64_t>(all), std::span<const int64_t>(mine), dp);
  int failed_rank = -1;
  for (int r = 0; r < dp.size() && failed_rank < 0; ++r)
    if (all[kFields * r] < 0) failed_rank = r;
  if (failed_rank >= 0)
    MOECORE_FAIL(failed_rank == dp.rank() ? error
                                          : "checkpoint: rank " + std::to_string(failed_rank) +
                                                " of group '" + dp.name() + "' failed to write its shard");
  ok[0] = 1;
  if (dp.rank() == 0) {
    std::map<std::string, io::CheckpointFileInfo> others;
    for (int r = 0; r < dp.size(); ++r) {
      const int64_t* f = all.data() + kFields * r;
      if (f[0] == 1)
        others[expert_shard_file(f[1], num_shards)] = {static_cast<uint64_t>(f[2]), static_cast<uint32_t>(f[3])};
    }
    try {
      io::checkpoint_staging_commit(root, committer_req, tok, others, keep_last);
    } catch (const Error& e) {
      error = e.what();
      ok[0] = 0;
    }
  }
  broadcast(std::span<int64_t>(ok), 0, dp);
  if (!ok[0]) MOECORE_FAIL(dp.rank() == 0 ? error : "checkpoint: rank 0 could not commit the checkpoint");
}

}  // namespace

void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const OptimizerState& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last, const TrainGroups* groups) {
  const TrainGroups g = groups ? *groups : TrainGroups{};
  const auto& params = gpt.params();
  if (opt.exp_avg.size() != params.size() || opt.exp_avg_sq.size() != params.size())
    MOECORE_FAIL("checkpoint: the optimizer state has ", opt.exp_avg.size(), " moments for ", params.size(),
                 " parameters");
  const int64_t EP = gpt.ep_size();
  io::CheckpointWriteRequest req;
  req.iteration = progress.iteration;
  auto& model = req.files[kModelFile];
  auto& optim = req.files[kOptimizerFile];
  std::map<std::string, Tensor> shard;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool sharded = EP > 1 && params[i].expert_parallel;
    auto& m = sharded ? shard : model;
    auto& o = sharded ? shard : optim;
    m[params[i].name] = params[i].value;
    o["exp_avg." + params[i].name] = opt.exp_avg[i];
    o["exp_avg_sq." + params[i].name] = opt.exp_avg_sq[i];
  }
  json calls = json::array();
  for (int64_t l = 0; l < gpt.config().num_layers; ++l) {
    const moe::RouterState* st = gpt.router_state(l);
    calls.push_back(st ? st->calls : 0);
    if (st && st->expert_bias.defined()) model[bias_name(l)] = st->expert_bias;
  }
  const json state = {{"format", "moecore-train-state"},
                      {"version", 1},
                      {"iteration", progress.iteration},
                      {"consumed_samples", progress.consumed_samples},
                      {"optimizer_steps", opt.steps},
                      {"seed", seed},
                      {"router_calls", calls},
                      {"expert_model_parallel_size", EP},
                      {"data_parallel_size", g.dp.size()},
                      {"model", model_fingerprint(gpt.config())}};
  req.state_json = state.dump(1);
  if (g.dp.size() == 1) {
    io::checkpoint_save(root, req, keep_last);
    return;
  }
  const bool writes_shard = EP > 1 && g.edp.rank() == 0;
  save_collective(root, req, writes_shard ? g.ep.rank() : -1, EP, shard, keep_last, g.dp);
}

void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const optim::AdamW& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last, const TrainGroups* groups) {
  const OptimizerState st{opt.exp_avg(), opt.exp_avg_sq(), opt.steps_taken()};
  save_training_checkpoint(root, gpt, st, progress, seed, keep_last, groups);
}

namespace {
// Copies rows [first, first + dst.size(0)) of the global [E, ...] tensor `name` into dst, from the file that
// holds it whole (saved at EP 1) or from the EP shards that hold those rows (saved at EP > 1).
void load_expert_rows(Tensor& dst, const io::LoadedCheckpoint& ck, const std::string& whole_file,
                      const std::string& name, int64_t first, int64_t saved_ep, int64_t num_experts) {
  const int64_t n = dst.size(0), per_row = dst.numel() / std::max<int64_t>(n, 1);
  auto copy_rows = [&](const Tensor& src, int64_t src_first, const std::string& file) {
    const int64_t m = src.size(0);
    if (src.dim() != dst.dim() || src.numel() / std::max<int64_t>(m, 1) != per_row)
      MOECORE_FAIL("checkpoint: ", file, " tensor '", name, "' has shape ", src.shape().str(),
                   " which does not hold rows of ", dst.shape().str());
    const int64_t lo = std::max(first, src_first), hi = std::min(first + n, src_first + m);
    for (int64_t r = lo; r < hi; ++r)
      std::memcpy(static_cast<char*>(dst.raw()) + (r - first) * per_row * static_cast<int64_t>(dtype_size(dst.dtype())),
                  static_cast<const char*>(src.raw()) + (r - src_first) * per_row * static_cast<int64_t>(dtype_size(src.dtype())),
                  static_cast<size_t>(per_row) * dtype_size(dst.dtype()));
  };
  if (saved_ep <= 1) {
    auto f = ck.files.find(whole_file);
    if (f == ck.files.end()) MOECORE_FAIL("checkpoint: ", ck.dir, " has no ", whole_file);
    auto it = f->second.tensors.find(name);
    if (it == f->second.tensors.end()) MOECORE_FAIL("checkpoint: ", whole_file, " has no tensor '", name, "'");
    if (it->second.size(0) != num_experts || it->second.dtype() != dst.dtype())
      MOECORE_FAIL("checkpoint: ", whole_file, " tensor '", name, "' is ", it->second.str(), ", expected ",
                   num_experts, " experts of ", dst.str());
    copy_rows(it->second, 0, whole_file);
    return;
  }
  const int64_t per_shard = num_experts / saved_ep;
  for (int64_t j = 0; j < saved_ep; ++j) {
    if ((j + 1) * per_shard <= first || j * per_shard >= first + n) continue;
    const std::string file = expert_shard_file(j, saved_ep);
    auto f = ck.files.find(file);
    if (f == ck.files.end()) MOECORE_FAIL("checkpoint: ", ck.dir, " has no ", file, " (saved at EP ", saved_ep, ")");
    auto it = f->second.tensors.find(name);
    if (it == f->second.tensors.end()) MOECORE_FAIL("checkpoint: ", file, " has no tensor '", name, "'");
    if (it->second.size(0) != per_shard || it->second.dtype() != dst.dtype())
      MOECORE_FAIL("checkpoint: ", file, " tensor '", name, "' is ", it->second.str(), ", expected ", per_shard,
                   " experts of ", dst.str());
    copy_rows(it->second, j * per_shard, file);
  }
}
}  // namespace

TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, OptimizerState& opt,
                                       uint64_t seed) {
  const io::LoadedCheckpoint ck = io::checkpoint_load(dir);
  json state;
  try {
    state = json::parse(ck.state_json);
  } catch (const json::exception& e) {
    MOECORE_FAIL("checkpoint: ", ck.dir, "/state.json is not valid JSON: ", e.what());
  }
  if (state.value("format", "") != "moecore-train-state" || state.value("version", 0) != 1)
    MOECORE_FAIL("checkpoint: ", ck.dir, "/state.json is not a moecore training state (format/version)");
  const json want = model_fingerprint(gpt.config());
  for (const auto& [k, v] : want.items()) {
    if (!state["model"].contains(k) || state["model"][k] != v)
      MOECORE_FAIL("checkpoint: ", ck.dir, " was saved with ", k, " = ",
                   state["model"].contains(k) ? state["model"][k].dump() : std::string("(absent)"),
                   " but the model has ", k, " = ", v.dump());
  }
  if (state.value("seed", uint64_t{0}) != seed)
    std::fprintf(stderr, "checkpoint: warning: %s was saved with --seed %llu, resuming with --seed %llu\n",
                 ck.dir.c_str(), static_cast<unsigned long long>(state.value("seed", uint64_t{0})),
                 static_cast<unsigned long long>(seed));
  for (const char* f : {kModelFile, kOptimizerFile})
    if (!ck.files.count(f)) MOECORE_FAIL("checkpoint: ", ck.dir, " has no ", f);
  const io::SafetensorsFile& model = ck.files.at(kModelFile);
  const io::SafetensorsFile& optim = ck.files.at(kOptimizerFile);
  auto& params = gpt.params();
  if (opt.exp_avg.size() != params.size() || opt.exp_avg_sq.size() != params.size())
    MOECORE_FAIL("checkpoint: the optimizer state has ", opt.exp_avg.size(), " moments for ", params.size(),
                 " parameters");
  const int64_t saved_ep = state.value("expert_model_parallel_size", int64_t{1});
  const int64_t E = gpt.config().moe.num_experts;
  if (saved_ep < 1 || (E > 0 && E % saved_ep != 0))
    MOECORE_FAIL("checkpoint: ", ck.dir, "/state.json has expert_model_parallel_size ", saved_ep, " for ", E,
                 " experts");
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    if (p.expert_parallel) {  // resharding: this rank's experts out of whichever files hold them
      const int64_t first = gpt.ep_rank() * p.value.size(0);
      load_expert_rows(p.value, ck, kModelFile, p.name, first, saved_ep, E);
      load_expert_rows(opt.exp_avg[i], ck, kOptimizerFile, "exp_avg." + p.name, first, saved_ep, E);
      load_expert_rows(opt.exp_avg_sq[i], ck, kOptimizerFile, "exp_avg_sq." + p.name, first, saved_ep, E);
      continue;
    }
    p.value.copy_from(need(model, kModelFile, p.name, p.value));
    opt.exp_avg[i].copy_from(need(optim, kOptimizerFile, "exp_avg." + p.name, opt.exp_avg[i]));
    opt.exp_avg_sq[i].copy_from(need(optim, kOptimizerFile, "exp_avg_sq." + p.name, opt.exp_avg_sq[i]));
  }
  const json& calls = state["router_calls"];
  for (int64_t l = 0; l < gpt.config().num_layers; ++l) {
    moe::RouterState* st = gpt.router_state(l);
    if (!st) continue;
    st->calls = calls.at(static_cast<size_t>(l)).get<int64_t>();
    if (st->expert_bias.defined()) st->expert_bias.copy_from(need(model, kModelFile, bias_name(l), st->expert_bias));
  }
  gpt.refresh_compute_weights();
  gpt.zero_grad();
  opt.steps = state.at("optimizer_steps").get<int64_t>();
  return {state.at("iteration").get<int64_t>(), state.at("consumed_samples").get<int64_t>()};
}

TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt,
                                       uint64_t seed) {
  OptimizerState st{opt.exp_avg(), opt.exp_avg_sq(), 0};  // handles: loading writes through them
  const TrainProgress p = load_training_checkpoint(dir, gpt, st, seed);
  opt.set_steps_taken(st.steps);
  return p;
}

}  // namespace moecore::train
