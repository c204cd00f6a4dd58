// The parameters one rank holds, allocated and initialised from the parameter table (param_specs.h): this pipeline
// stage's part of it, the routed experts' [E/EP, ...] shards, the tensor-parallel TensorShards, and each parameter's
// compute copy. Initial values depend on (seed, name, global element index) alone, so every layout starts from the
// same global model. Entries keep their table order and their addresses (the vector is sized once): modules bind to
// them (DecoderLayer::bind), the optimizer, checkpoints and HF import/export walk them.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "moecore/core/param.h"
#include "moecore/model/parallel_layout.h"
#include "moecore/model/param_specs.h"

namespace moecore::model {

class ParamStore {
 public:
  ParamStore() = default;
  ParamStore(const ModelConfig& cfg, const ModelParallel& par, uint64_t seed, Device device);
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  const ParamSpec& spec(size_t i) const { return specs_[i]; }  // params()[i]'s row of the table
  size_t size() const { return params_.size(); }
  Param* find(const std::string& name);             // nullptr when this rank holds none of that name
  Param* find(ParamRole role, int64_t layer = -1);  // likewise, by role and layer
  Param& at(const std::string& name);               // throws Error when absent
  int64_t num_parameters() const;                   // elements this rank holds
  // The entries [first, end) whose spec satisfies `in` ({0, 0} when none); an Error when they are not contiguous.
  std::pair<size_t, size_t> range(const std::function<bool(const ParamSpec&)>& in) const;
  // The word embeddings' index when both the first and the last pipeline stage hold them (their gradient is the sum
  // of both stages'), else -1.
  int64_t pipeline_shared() const { return pipeline_shared_; }
  // The initial values of elements [lo, lo + dst.numel()) of params()[i]'s (flattened) tensor, as the constructor draws
  // them: for a parameter born without memory (Megatron-FSDP's units, ModelParallel::fsdp_params), its shards'.
  void initial_values(size_t i, int64_t lo, Tensor& dst) const;

 private:
  std::vector<ParamSpec> specs_;
  std::vector<Param> params_;
  int64_t pipeline_shared_ = -1;
  uint64_t seed_ = 0;
  int ep_rank_ = 0, ep_size_ = 1;
};

}  // namespace moecore::model
