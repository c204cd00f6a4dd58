// Token dispatch: the permutation of token copies into expert-major order and its inverse, behind the stage
// interface every dispatcher implements (STYLE.md): dispatch_prepare (local) -> dispatch (communication)
// -> [experts] -> combine_prepare (local) -> combine (communication) -> combine_finish, and the same stages
// in reverse for backward. LocalDispatcher serves one process; all-to-all and all-gather dispatchers
// implement the same interface over process groups.
//
// Permutation contract (Megatron §5.1): rows are grouped by expert (ascending), and within an expert by
// ascending source token. For routed pair (t, e): row = token_rows[t, e]; row_token[row] = t.
//   permuted_x[row] = x[row_token[row]]            permuted_probs[row] = probs[t, e]
//   y[t] = sum over e ascending with token_rows[t, e] >= 0 of expert_out[token_rows[t, e]]   (f32 sum, one rounding)
// Probabilities are not applied by the combine: experts multiply them after the activation.
#pragma once
#include <vector>

#include "moecore/kernels/ops.h"

namespace moecore::moe {

struct DispatchPlan {
  int64_t T = 0, E = 0;
  std::vector<int64_t> tokens_per_expert;  // [E] rows per expert
  std::vector<int64_t> expert_offset;      // [E + 1] first row of each expert
  Tensor row_token;                        // [max_rows] i32: source token of each row (first rows() valid)
  Tensor token_rows;                       // [T, E] i32: row of (t, e), -1 when not routed
  int64_t rows() const { return expert_offset.empty() ? 0 : expert_offset.back(); }
};

// Buffers of one layer's dispatch, sized once for the largest row count the config allows.
struct DispatchBuffers {
  DispatchPlan plan;
  Tensor permuted_x;      // [max_rows, H] dtype of x
  Tensor permuted_probs;  // [max_rows] f32
  Tensor expert_out;      // [max_rows, H] dtype of x: written by the experts
  Tensor dpermuted;       // [max_rows, H] dtype of x: backward (dy gathered to rows)
  Tensor dexpert_in;      // [max_rows, H] f32: backward (experts' input gradient)
  Tensor dpermuted_probs; // [max_rows] f32: backward
};
// max_rows: T*K dropless; E*capacity with pad-to-capacity; plus E*(alignment-1) with router padding.
int64_t dispatch_max_rows(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity,
                          int64_t alignment);
DispatchBuffers dispatch_buffers_alloc(int64_t T, int64_t H, int64_t E, int64_t max_rows, DType x_dtype);

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  // Forward. x [T, H], probs [T, E] f32, map [T, E] bool. After dispatch, buf.permuted_* hold this rank's
  // expert inputs and buf.plan.tokens_per_expert the rows per (local) expert.
  virtual void dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                                const ops::Context& ctx) = 0;
  virtual void dispatch(DispatchBuffers& buf, const ops::Context& ctx) = 0;
  // After the experts wrote buf.expert_out; combine_finish writes y [T, H] f32 with the per-token sum.
  virtual void combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) = 0;
  virtual void combine(DispatchBuffers& buf, const ops::Context& ctx) = 0;
  virtual void combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) = 0;

  // Backward of the combine: dy [T, H] f32 gathered into buf.dpermuted (the dtype of x).
  virtual void combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) = 0;
  // Backward of the dispatch: dx [T, H] f32 += the sum of buf.dexpert_in over each token's rows;
  // dprobs [T, E] f32 is written (buf.dpermuted_probs scattered back, 0 where not routed).
  virtual void dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) = 0;
};

// One process: communication stages are no-ops; permute and unpermute are single fused passes.
class LocalDispatcher final : public Dispatcher {
 public:
  void dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                        const ops::Context& ctx) override;
  void dispatch(DispatchBuffers&, const ops::Context&) override {}
  void combine_prepare(DispatchBuffers& buf, const ops::Context& ctx) override;  // nothing to do locally
  void combine(DispatchBuffers&, const ops::Context&) override {}
  void combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) override;
  void combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) override;
  void dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) override;
};

// The building blocks, also used by other dispatchers and by tests.
void dispatch_plan_build(DispatchPlan& plan, const Tensor& map, const ops::Context& ctx);
// permuted_x [R, H] = x rows; permuted_probs [R] = probs entries, per the plan (one fused pass).
void permute_tokens(Tensor& permuted_x, Tensor& permuted_probs, const Tensor& x, const Tensor& probs,
                    const DispatchPlan& plan, const ops::Context& ctx);
// y [T, H] f32 = per-token sum of rows (accumulate=false) or y += (accumulate=true); rows any float dtype.
void unpermute_tokens(Tensor& y, const Tensor& rows, const DispatchPlan& plan, bool accumulate,
                      const ops::Context& ctx);

}  // namespace moecore::moe
