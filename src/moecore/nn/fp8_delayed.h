// Delayed scaling (--fp8-recipe delayed, Megatron's default recipe; docs/fp8-spec.md §3.1): Transformer Engine's state
// of every quantizer of one model. Each FP8 linear has, per GEMM (an expert linear: per local expert), three quantizer
// slots -- its input and its weight (forward) and its output gradient (backward) -- each with a scale (initially 1)
// and an amax history of --fp8-amax-history-len rows (row 0 the accumulator of the current pass, rows 1.. the past
// amaxes, oldest first). A quantisation uses its slot's scale and maxes max |x| into row 0. After every training
// forward of a micro-batch (the forward slots) and every backward (the backward slots) the model reduces row 0 over
// the amax group (MAX over TP x DP x CP: every rank of a pipeline stage, an expert slot by its local index as in
// Megatron) and updates each slot (common/fp8.h's delayed_update: roll, scale = fp8_max * 2^-margin / amax; an amax of
// 0 changes nothing). With Megatron's defaults (a history of 1, most_recent) micro-batch m is quantised with
// fp8_max / amax(micro-batch m - 1).
// What a backward quantises with is its forward's: the weight is quantised once per step, on its first training
// forward (Transformer Engine's is_first_microbatch), and every GEMM of the step uses that scale (later forwards record
// no weight amax); each training forward saves its input scales in the activation slot it runs in, for the wgrad GEMMs
// (the columnwise copy of the same FP8 input) and for a recompute, which quantises with them and records nothing.
// Evaluations quantise with the current scales and record their amaxes, which wait in row 0 for the next training
// update. Checkpoints hold every slot (records / restore); a changed history length keeps rows [0, L) and pads zeros.
// Linears are known from their first GEMM on (their state is created then, or taken from a restored checkpoint).
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/kernels/ops_fp8.h"
#include "moecore/nn/fp8.h"

namespace moecore::nn {

class Fp8Delayed {
 public:
  enum class Pass : uint8_t { eval, forward, backward };
  enum class Gemm : uint8_t { fprop, dgrad, wgrad };
  explicit Fp8Delayed(const Fp8Config& c);

  // The model, before each of its passes: a training forward or backward through activation slot `slot` (of the chunk
  // it runs), or an evaluation (no gradients). A fprop in a backward is a recompute.
  void begin(Pass p, int64_t slot = 0);
  // After the weights changed (an optimizer step, a load): each linear's next training forward quantises its weight
  // again, with the weight slots' scales of then.
  void new_step();

  // The operands of one GEMM of linear l in the current pass (given scales, the amaxes to record). groups: the GEMMs
  // of the call (a grouped expert linear's local experts; 1 otherwise, l.expert naming a sequential one). The spans
  // point into this state: valid until its next call.
  ops::Fp8Gemm operands(Gemm g, const Linear& l, int64_t groups);

  // Row 0 of every forward (input, weight) or backward (output gradient) slot, the linears in name order: what the
  // model MAX-reduces over the amax group.
  std::vector<float> amaxes(bool forward) const;
  // Sets those rows to `reduced` (amaxes' layout) and updates every such slot.
  void update(bool forward, std::span<const float> reduced);

  // Checkpoints: per linear (the full name), its slots as [gemms, 3, 1 + history] floats -- input, weight, output
  // gradient; each the scale, then history rows 0 .. history-1 -- and its local experts (0: not an expert linear).
  // Linears restored but not run yet are included as restored. (Host values: train/ makes the checkpoint's tensors.)
  struct Record {
    int64_t experts = 0;
    int64_t gemms = 1, history = 1;
    std::vector<float> slots;
  };
  std::map<std::string, Record> records() const;
  // Replaces the whole state by a checkpoint's records (this rank's GEMMs: an expert linear's local experts), each
  // applied when its linear first runs (any history length); a linear without one starts afresh.
  void restore(std::map<std::string, Record> records);

 private:
  struct Quantizers {
    int64_t gemms = 1, experts = 0;
    std::vector<float> scale[3];    // per slot kind (input, weight, output gradient): [gemms]
    std::vector<float> history[3];  // [L, gemms]: row 0 the accumulator
    std::vector<float> weight;      // [gemms]: the step's weight scales
    std::vector<uint8_t> weight_set;
    std::vector<float> saved;  // [slots, gemms]: each activation slot's forward input scales
    std::vector<uint8_t> saved_set;
  };
  // The linears by their full name (layer prefix + module name), found from the two parts without joining them.
  struct Key {
    std::string_view layer, name;
  };
  struct KeyLess {
    using is_transparent = void;
    bool operator()(const std::string& x, const std::string& y) const;
    bool operator()(const std::string& x, const Key& y) const;
    bool operator()(const Key& x, const std::string& y) const;
    static int compare(std::string_view s, const Key& k);  // s against layer + name
  };
  Quantizers& find(const Linear& l, int64_t groups);
  void fill(Quantizers& q, const Record& record, const std::string& name) const;

  Fp8Config cfg_;
  int64_t L_;
  Pass pass_ = Pass::eval;
  int64_t slot_ = 0;
  std::map<std::string, Quantizers, KeyLess> linears_;
  std::map<std::string, Record> restored_;  // records not applied yet
};

}  // namespace moecore::nn
