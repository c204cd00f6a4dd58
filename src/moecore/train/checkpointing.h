// Training state <-> checkpoint directories (io/checkpoint.h): the model's f32 master weights, the router
// states (expert bias, noise-stream positions), the optimizer moments and step count with the LR-scheduler
// state, and the data position. Everything needed for a bit-identical resume; nothing else (activations are
// recomputed). Megatron's partial saves and loads (--no-save-optim, --no-load-rng, --finetune, ...) select parts.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/enum_names.h"
#include "moecore/io/checkpoint.h"
#include "moecore/model/gpt.h"
#include "moecore/optim/adamw.h"
#include "moecore/optim/muon.h"
#include "moecore/train/grad_scaler.h"
#include "moecore/train/train_groups.h"

namespace moecore::train {

struct TrainProgress {
  int64_t iteration = 0;         // optimizer steps completed
  int64_t consumed_samples = 0;  // sequences consumed by training (iteration * global batch)
};

// The optimizer state a checkpoint holds for this rank's parameters (aligned with gpt.params(), shaped like
// them), full for every parameter this rank holds (a distributed optimizer gathers its shards first): each slot is one
// kind of state under Megatron's key -- AdamW's exp_avg and exp_avg_sq, Muon's momentum_buffer -- with a tensor per
// parameter, undefined where the parameter's optimizer keeps no such state (Muon's matrices have no moments, the
// parameters of its scalar optimizer no momentum). Files name a state tensor "<key>.<parameter name>".
struct OptimizerState {
  struct Slot {
    std::string key;
    std::vector<Tensor> per_param;
  };
  optim::OptimizerKind optimizer = optim::OptimizerKind::adam;  // state.json "optimizer"
  // Muon's other parameters' optimizer (state.json "muon_scalar_optimizer" when lion: their one moment, exp_avg).
  optim::ScalarOptimizer scalar = optim::ScalarOptimizer::adam;
  std::vector<Slot> slots;
  int64_t steps = 0;
  // AdamW's state: the two moments of every parameter.
  static OptimizerState adam(std::vector<Tensor> exp_avg, std::vector<Tensor> exp_avg_sq, int64_t steps);
  // The slot under key (null when absent).
  Slot* slot(std::string_view key);
};
// The state keys that `optimizer` (with Muon's scalar optimizer) keeps for a parameter (name, dimensions, routed expert
// stack): what a checkpoint of such a run holds for it.
std::vector<std::string> optimizer_state_keys(optim::OptimizerKind optimizer, optim::ScalarOptimizer scalar,
                                              const std::string& name, int ndim, bool expert_parallel);

// Megatron's OptimizerParamScheduler state (its state_dict keys, in state.json "opt_param_scheduler"), counted
// in optimizer steps where Megatron counts samples. Weight decay has no schedule here (AdamWConfig holds it).
struct OptParamSchedulerState {
  float max_lr = 0;                // --lr
  float min_lr = 0;                // --min-lr
  double lr_warmup_steps = 0;      // --lr-warmup-iters (fractional from --lr-warmup-fraction)
  int64_t lr_decay_steps = 0;      // end of the decay: --lr-decay-iters, or --train-iters when that is 0
  std::string lr_decay_style;      // --lr-decay-style, as the file spells it (enum_name of trainer.h's LrDecayStyle)
  int64_t wsd_decay_steps = 0;     // --lr-wsd-decay-iters (compared only for WSD)
  std::string lr_wsd_decay_style;  // --lr-wsd-decay-style (compared only for WSD; WsdDecayStyle's spelling)
  int64_t num_steps = 0;           // steps the schedule has advanced: the iteration, unless it restarted
};

// The values a resumed run continues with (Megatron's OptimizerParamScheduler.load_state_dict):
// override_opt_param_scheduler: the run's values, no check; use_checkpoint_opt_param_scheduler: the saved
// values; neither: each saved value must equal the run's, else Error "OptimizerParamScheduler: class input value
// X and checkpoint value Y for <name> (<flag>) do not match ...". num_steps is the saved one except with
// override, where the schedule position is the iteration (Megatron resets num_steps to the consumed samples).
// `dir` only names the checkpoint in the error.
OptParamSchedulerState opt_param_scheduler_resolve(const OptParamSchedulerState& run,
                                                   const OptParamSchedulerState& saved, int64_t iteration,
                                                   bool override_opt_param_scheduler,
                                                   bool use_checkpoint_opt_param_scheduler, const std::string& dir);

// The parts a save writes besides the weights, the expert biases and the progress.
struct CheckpointSaveOptions {
  bool save_optim = true;  // false (--no-save-optim): no moments, step count or scheduler state
  bool save_rng = true;    // false (--no-save-rng): no router noise-stream positions
  std::optional<OptParamSchedulerState> scheduler;  // saved with the optimizer state when given
  std::optional<GradScalerState> grad_scaler;       // the dynamic loss scaler's, saved with the optimizer state
  std::string hf_config_json;  // the Hugging Face config.json the model came from (kept for export), or ""
};

// The parts a load restores. Without the optimizer state the moments are zeroed and the step count is 0 (as a
// fresh optimizer); without the rng state every router noise stream restarts at position 0 (as a fresh run:
// moecore's randomness is counter-based Philox keyed by --seed and a name, so the streams' positions are
// the only rng state a run has).
// Megatron's --dist-ckpt-strictness (core/dist_checkpointing/validation.py StrictHandling). Megatron's words: a
// "missing" key is a tensor of the checkpoint the model does not take, an "unexpected" key a tensor the model asks
// for that the checkpoint lacks. Unexpected keys: an Error under assume_ok_unexpected (Megatron's load strategy
// raises), raise_unexpected and raise_all; the other modes load the rest and leave each such tensor as it is (the
// parameter at its initial value, its moments zero), named in one warning line. Missing keys: an Error with raise_all;
// otherwise they are not loaded, and named in one warning line. Where Megatron would say nothing (assume_ok_*,
// return_*, ignore_all) moecore still warns: a dropped or uninitialised-from-checkpoint tensor is never silent.
enum class CkptStrictness : uint8_t {
  assume_ok_unexpected,  // Megatron's default
  log_unexpected,
  log_all,
  raise_unexpected,
  raise_all,
  return_unexpected,
  return_all,
  ignore_all
};
// Megatron's spellings (enum_parse, enum_name of core/enum_names.h).
inline constexpr EnumName<CkptStrictness> kCkptStrictnessNames[] = {
    {CkptStrictness::assume_ok_unexpected, "assume_ok_unexpected"},
    {CkptStrictness::log_unexpected, "log_unexpected"},
    {CkptStrictness::log_all, "log_all"},
    {CkptStrictness::raise_unexpected, "raise_unexpected"},
    {CkptStrictness::raise_all, "raise_all"},
    {CkptStrictness::return_unexpected, "return_unexpected"},
    {CkptStrictness::return_all, "return_all"},
    {CkptStrictness::ignore_all, "ignore_all"}};
constexpr std::span<const EnumName<CkptStrictness>> enum_names(CkptStrictness) {
  return kCkptStrictnessNames;
}
// Whether a load under `s` goes on without the tensors the checkpoint lacks (Megatron's unexpected keys).
bool loads_on_unexpected(CkptStrictness s);

struct CheckpointLoadOptions {
  bool load_optim = true;  // false (--no-load-optim): moments, step count and scheduler state not read
  bool load_rng = true;    // false (--no-load-rng): router noise streams restart at 0; no --seed warning
  bool finetune = false;   // --finetune: weights only; iteration and consumed samples 0 (no optim, no rng)
  CkptStrictness strictness = CkptStrictness::assume_ok_unexpected;  // --dist-ckpt-strictness
  bool notes = true;     // the note on stderr about a --finetune from another model (--logging-level: INFO)
  bool warnings = true;  // the warning on stderr about another --seed (--logging-level: WARNING)
};

// What a load restored.
struct LoadedTrainingState {
  TrainProgress progress;                           // {0, 0} with finetune
  bool optimizer_loaded = false;                    // moments and step count read
  bool rng_loaded = false;                          // router noise-stream positions read
  std::optional<OptParamSchedulerState> scheduler;  // saved scheduler, when the optimizer was read and had one
  std::optional<GradScalerState> grad_scaler;       // saved loss scaler, when the optimizer was read and had one
};

// Writes <root>/iter_<iteration>/ committed atomically; keeps the newest keep_last checkpoints (0: all).
// Files: model.safetensors (parameters by Megatron name, expert biases), optimizer.safetensors (moments),
// state.json (progress, router noise positions, scheduler state, the model fingerprint, the expert-parallel
// size). With expert parallelism (EP > 1) the routed experts live in experts-ep<r>-of-<EP>.safetensors
// instead, each written by the EP rank r that holds them (its expert-data-parallel rank 0), with their moments;
// rank 0 of dp commits. Collective over groups->dp when given (every rank calls it). With save_optim false,
// opt may be empty (no moments) and no optimizer.safetensors, optimizer_steps or opt_param_scheduler is written;
// with save_rng false state.json has no router_calls.
void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const OptimizerState& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last,
                              const TrainGroups* groups = nullptr, const CheckpointSaveOptions& options = {});
void save_training_checkpoint(const std::string& root, const model::GptModel& gpt, const optim::AdamW& opt,
                              const TrainProgress& progress, uint64_t seed, int keep_last,
                              const TrainGroups* groups = nullptr, const CheckpointSaveOptions& options = {});

// ---- A save in two halves (asynchronous saves, async_save.h) ----------------------------------------------------
// save_training_checkpoint is checkpoint_save_begin, then writing `files` into `staging_dir`
// (io::checkpoint_staging_write), then checkpoint_save_finish. An asynchronous save copies `files` into host memory and
// has them written in the background, and finishes at a later step boundary.
struct CheckpointSaveInFlight {
  std::string root;
  int64_t iteration = 0;
  int keep_last = 0;
  bool writes = false;             // on the first pipeline stage, whose ranks write every stage's parts and commit
  std::string token, staging_dir;  // the shared staging directory <root>/iter_N.tmp-<token> (writers)
  // What this rank writes: file name -> tensors (CPU; the model's own tensors where no copy was needed, so they change
  // with the next step). The committer (rank 0 of the stage) writes model.safetensors and optimizer.safetensors, and
  // with EP > 1 each expert file's writer its file.
  std::map<std::string, std::map<std::string, Tensor>> files;
  int64_t shard_index = -1, num_shards = 1;  // the expert file this rank writes (-1: none), of EP
  io::CheckpointWriteRequest request;        // the committer's state.json and same_model (files: none)
};
// Collective as save_training_checkpoint: gathers the parts (tensor-parallel shards, pipeline stages) and creates the
// staging directory. Throws Error on every rank when the directory cannot be made.
CheckpointSaveInFlight checkpoint_save_begin(const std::string& root, const model::GptModel& gpt,
                                             const OptimizerState& opt, const TrainProgress& progress, uint64_t seed,
                                             int keep_last, const TrainGroups* groups,
                                             const CheckpointSaveOptions& options);
// Collective over every rank: `written` holds this rank's files (name -> size and CRC32C), or `error` its failure.
// When every rank wrote its files, the committer publishes and commits them (io/checkpoint.h: rename, COMMIT, tracker,
// retention); otherwise the staging directory is removed and every rank throws Error (the rank that failed with its
// own message: the file, the byte offset and the errno's text). Nothing is committed then.
void checkpoint_save_finish(const CheckpointSaveInFlight& save,
                            const std::map<std::string, io::CheckpointFileInfo>& written, const std::string& error,
                            const TrainGroups* groups);

// Loads the parts `options` selects of a committed checkpoint directory into gpt and the optimizer state (whose
// tensors must exist with this rank's shapes). Before anything is copied, every file is verified against COMMIT
// (size, CRC32C), state.json is parsed strictly and its iteration must equal COMMIT's, and every tensor read
// must have the dtype and the full shape of its destination (expert tensors: [E, ...] saved at EP 1, [E/EP, ...]
// per shard; the moments: the optimizer's dtype): a failed load leaves gpt and opt untouched. Resharding: a checkpoint
// saved at any EP loads at any other EP dividing the number of experts (each rank copies its experts' rows out of
// whichever shards hold them). Throws Error naming the file, tensor or field and the reason; a part the checkpoint was
// saved without
// (--no-save-optim, --no-save-rng) names the flag that loads without it (--no-load-optim / --no-load-rng, or
// --finetune).
LoadedTrainingState load_training_state(const std::string& dir, model::GptModel& gpt, OptimizerState& opt,
                                        uint64_t seed, const CheckpointLoadOptions& options);
LoadedTrainingState load_training_state(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt, uint64_t seed,
                                        const CheckpointLoadOptions& options);

// A full resume (every part): load_training_state with default options, returning the progress.
TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, OptimizerState& opt,
                                       uint64_t seed);
TrainProgress load_training_checkpoint(const std::string& dir, model::GptModel& gpt, optim::AdamW& opt, uint64_t seed);

// ---- For converters (moecore convert) --------------------------------------------------------------
inline constexpr const char* kCheckpointModelFile = "model.safetensors";
// The name of layer l's router expert bias in model.safetensors.
std::string checkpoint_expert_bias_name(int64_t layer);
// FP8 delayed scaling's quantizer state of a linear ("decoder.layers.3.mlp.linear_fc1") in model.safetensors:
// [gemms, 3, 1 + amax history] f32 (nn/fp8_delayed.h; an expert linear: one row per global expert), named
// kFp8StatePrefix + the linear's name.
inline constexpr const char* kFp8StatePrefix = "fp8_state.";
std::string checkpoint_fp8_state_name(const std::string& linear);
// The file of EP rank r's routed experts in a checkpoint saved at expert-parallel size ep > 1.
std::string checkpoint_expert_file(int64_t ep_rank, int64_t ep);
// state.json of a weights-only checkpoint at iteration 0 (as saved with --no-save-optim --no-save-rng: it loads
// with --finetune, or --no-load-optim --no-load-rng), for a model whose experts are in ep files.
std::string weights_only_state_json(const model::ModelConfig& cfg, int64_t ep, const std::string& hf_config_json);
// Throws Error naming the directory and the field when state.json is not a training state or its model
// fingerprint (layers, sizes, experts, ...) differs from cfg's.
void check_checkpoint_model(const std::string& state_json, const model::ModelConfig& cfg, const std::string& dir);
// The model the checkpoint was trained as (state.json "model_config", model/config_record.h); nullopt for a
// checkpoint saved before it was recorded. Throws Error naming dir when the record is damaged.
// `base` gives the fields the record does not hold (training-only settings).
std::optional<model::ModelConfig> checkpoint_recorded_model(const std::string& state_json, const std::string& dir,
                                                            const model::ModelConfig& base);
// Fields that change the model's function (top-k, RoPE base, norm epsilon, ...) must equal the recorded ones: Error
// listing each difference, unless `finetune` (--finetune: a new run from the weights), which prints them as a note on
// stderr when `notes`.
void check_checkpoint_function(const std::string& state_json, const model::ModelConfig& cfg, const std::string& dir,
                               bool finetune, bool notes = true);
// "" when state.json's model fingerprint is cfg's; else the first difference ("hidden_size = 64 but the model has
// hidden_size = 32"). Throws Error (naming dir) when state.json is not a training state.
std::string checkpoint_model_difference(const std::string& state_json, const model::ModelConfig& cfg,
                                        const std::string& dir);
// A --save root holding a committed checkpoint of another model (or one whose state.json cannot be read) is an
// Error naming it and the difference: saving there would mix the two (retention spares other models' checkpoints,
// but one tracker names the newest of either). Checked before the first step unless the user allows it.
void check_save_directory(const std::string& root, const model::ModelConfig& cfg);

// state.json of a training checkpoint, every field type- and range-checked (a hostile or damaged file is an
// Error naming <dir>/state.json and the field, never a crash or a silently wrong value).
struct TrainStateJson {
  int64_t iteration = 0;                   // >= 0; must equal COMMIT's (load_training_state checks)
  int64_t consumed_samples = 0;            // >= 0
  uint64_t seed = 0;                       // --seed of the run that saved it
  int64_t expert_model_parallel_size = 1;  // >= 1
  std::optional<int64_t> optimizer_steps;  // >= 0; absent: saved with --no-save-optim
  optim::OptimizerKind optimizer = optim::OptimizerKind::adam;   // "optimizer" (absent: adam, as before Muon)
  optim::ScalarOptimizer scalar = optim::ScalarOptimizer::adam;  // "muon_scalar_optimizer" (absent: adam)
  std::optional<OptParamSchedulerState> scheduler;               // "opt_param_scheduler", when saved
  std::optional<GradScalerState> grad_scaler;        // "grad_scaler" (the dynamic loss scaler's), when saved
  std::optional<std::vector<int64_t>> router_calls;  // per layer, >= 0; absent: saved with --no-save-rng
  std::string fp8;  // "fp8": "--fp8-format F --fp8-recipe R" of an FP8 run (absent: "", trained without FP8)
};
TrainStateJson train_state_parse(std::string_view state_json, const std::string& dir);

// A hash of every master weight's bytes (resume tests and log lines).
uint64_t parameter_hash(const model::GptModel& gpt);

}  // namespace moecore::train
