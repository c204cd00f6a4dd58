// FP8 training's linear layers (Megatron's --fp8-format / --fp8-recipe with Transformer Engine's modules;
// docs/fp8-spec.md §2-3): which operand of which GEMM a recipe quantises how, and the three GEMMs of a linear layer
// -- fprop, dgrad, wgrad -- that every module (nn/, moe/) runs through, plain or FP8 (kernels/ops_fp8.h).
//
// Per GEMM (operands in the GEMM's [rows, reduction] layout, blocks along the reduction):
//   fprop  y = x W^T    x: the input quantizer       W: the weight quantizer
//   dgrad  dx = dy W    dy: the grad-output quantizer W: the weight quantizer (its columnwise copy)
//   wgrad  dW = dy^T x  dy: the grad-output quantizer x: the input quantizer (its columnwise copy)
// Recipes: delayed -- a scale per quantizer slot from the amax history of earlier steps (the state: nn/fp8_delayed.h);
// tensorwise -- one current scale per tensor (per expert in grouped GEMMs); blockwise -- power-of-two scales per 1 x
// 128 of activations and gradients, per 128 x 128 of weights; mxfp8 -- E8M0 scales per 1 x 32 of every operand. Format
// e4m3: every operand E4M3; hybrid: the gradients E5M2.
// Not here: the flags and their validation (apps/), which layers run FP8 (model/: --first-last-layers-bf16).
#pragma once
#include <cstdint>
#include <memory>
#include <string_view>

#include "moecore/core/enum_names.h"
#include "moecore/kernels/ops_fp8.h"

namespace moecore::nn {

enum class Fp8Format : uint8_t { e4m3, hybrid };
inline constexpr EnumName<Fp8Format> kFp8FormatNames[] = {{Fp8Format::e4m3, "e4m3"}, {Fp8Format::hybrid, "hybrid"}};
constexpr std::span<const EnumName<Fp8Format>> enum_names(Fp8Format) {
  return kFp8FormatNames;
}
enum class Fp8Recipe : uint8_t { delayed, tensorwise, blockwise, mxfp8 };
inline constexpr EnumName<Fp8Recipe> kFp8RecipeNames[] = {{Fp8Recipe::delayed, "delayed"},
                                                          {Fp8Recipe::tensorwise, "tensorwise"},
                                                          {Fp8Recipe::blockwise, "blockwise"},
                                                          {Fp8Recipe::mxfp8, "mxfp8"}};
constexpr std::span<const EnumName<Fp8Recipe>> enum_names(Fp8Recipe) {
  return kFp8RecipeNames;
}

enum class Fp8AmaxAlgo : uint8_t { most_recent, max };
inline constexpr EnumName<Fp8AmaxAlgo> kFp8AmaxAlgoNames[] = {{Fp8AmaxAlgo::most_recent, "most_recent"},
                                                              {Fp8AmaxAlgo::max, "max"}};
constexpr std::span<const EnumName<Fp8AmaxAlgo>> enum_names(Fp8AmaxAlgo) {
  return kFp8AmaxAlgoNames;
}

// A model's FP8 settings (Megatron's flags and defaults). Off unless --fp8-format is given.
struct Fp8Config {
  bool on = false;                          // --fp8-format given
  Fp8Format format = Fp8Format::e4m3;       // --fp8-format e4m3 | hybrid
  Fp8Recipe recipe = Fp8Recipe::delayed;    // --fp8-recipe (Megatron's default: delayed)
  bool first_last_layers_bf16 = false;      // --first-last-layers-bf16
  int64_t num_layers_at_start_in_bf16 = 1;  // --num-layers-at-start-in-bf16
  int64_t num_layers_at_end_in_bf16 = 1;    // --num-layers-at-end-in-bf16
  bool output_proj = false;                 // --fp8-output-proj (mxfp8): the output layer's GEMMs in FP8 too
  // Delayed scaling's (Megatron's defaults; Transformer Engine's own are a history of 1024 and max):
  int64_t margin = 0;                                        // --fp8-margin: scale = fp8_max * 2^-margin / amax
  int64_t amax_history_len = 1;                              // --fp8-amax-history-len
  Fp8AmaxAlgo amax_compute_algo = Fp8AmaxAlgo::most_recent;  // --fp8-amax-compute-algo: the newest amax, or the max
  // Whether decoder layer l (0-based) of num_layers runs FP8 (Megatron's is_first_last_bf16_layer; MTP layers always
  // do, as Megatron gives them the model's FP8 context).
  bool layer_runs_fp8(int64_t l, int64_t num_layers) const;
};

class Fp8Delayed;  // nn/fp8_delayed.h

// A model's FP8 training, what its linears point at: the recipe and, with delayed scaling, every quantizer's state.
class Fp8Training {
 public:
  explicit Fp8Training(const Fp8Config& c);
  ~Fp8Training();
  Fp8Training(const Fp8Training&) = delete;
  Fp8Training& operator=(const Fp8Training&) = delete;
  const Fp8Config& config() const { return cfg_; }
  Fp8Delayed* delayed() { return delayed_.get(); }  // null unless --fp8-recipe delayed
  const Fp8Delayed* delayed() const { return delayed_.get(); }

 private:
  Fp8Config cfg_;
  std::unique_ptr<Fp8Delayed> delayed_;
};

// One linear layer: its name (the parameter prefix of its layer, "decoder.layers.3.", and Megatron's module name,
// "mlp.linear_fc1"; it names errors and delayed scaling's state) and its FP8 training (null: plain GEMMs). An expert
// linear names the local experts that share it (their GEMMs are grouped, or one per expert: `expert` says which).
struct Linear {
  Fp8Training* fp8 = nullptr;
  std::string_view layer{};
  const char* name = "";
  int64_t experts = 0;  // the local experts of an expert linear (0: not one)
  int64_t expert = 0;   // the expert of one sequential expert GEMM
  Linear of_expert(int64_t e) const {
    Linear l = *this;
    l.expert = e;
    return l;
  }
};

// y = alpha x W^T + beta y; dx = alpha dy W + beta dx; dW = alpha dy^T x + beta dW. x [T, in], W [out, in], y [T, out].
void linear_fprop(Tensor& y, const Tensor& x, const Tensor& w, float alpha, float beta, const Linear& l,
                  const ops::Context& ctx);
void linear_dgrad(Tensor& dx, const Tensor& dy, const Tensor& w, float alpha, float beta, const Linear& l,
                  const ops::Context& ctx);
void linear_wgrad(Tensor& dw, const Tensor& dy, const Tensor& x, float alpha, float beta, const Linear& l,
                  const ops::Context& ctx);
// The grouped ones (experts: group g owns group_rows[g] consecutive rows, W [G, out, in]; ops::gemm_grouped):
// y = x W[g]^T, dx = dy W[g] (both written), dW[g] += dy^T x.
void grouped_fprop(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& group_rows, const Linear& l,
                   const ops::Context& ctx);
void grouped_dgrad(Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& group_rows, const Linear& l,
                   const ops::Context& ctx);
void grouped_wgrad(Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& group_rows, const Linear& l,
                   const ops::Context& ctx);

}  // namespace moecore::nn
