// Private helpers shared by router.cpp and router_losses.cpp: the router's entry checks (every tensor on the
// context's device, of the shape and dtype the config needs) and the loss stage. Only router*.cpp include this.
// The computations themselves are ops (kernels/ops_router.h); nothing here reads tensor data.
#pragma once
#include <array>
#include <initializer_list>
#include <string>
#include <utility>

#include "moecore/moe/router.h"

namespace moecore::moe::router_detail {

// Rows of cache.work: a chunk of x widened to f32, or of dlogits @ W.
inline constexpr int64_t kWorkRows = 1024;

// Entry checks: every failure names the op, the rule and all arguments with shapes and dtypes.
class ArgCheck {
 public:
  using Arg = std::pair<const char*, const Tensor*>;
  // A fixed array, not a vector: the checks run every step and must not allocate.
  ArgCheck(const char* op, Device device, std::initializer_list<Arg> args) : op_(op), device_(device) {
    for (const Arg& a : args)
      if (n_ < kMaxArgs) args_[n_++] = a;
  }
  template <class... A>
  [[noreturn]] void fail(A&&... msg) const {
    std::string all;
    for (int i = 0; i < n_; ++i) {
      const Arg& a = args_[i];
      all += all.empty() ? "" : ", ";
      all += std::string(a.first) + " " + (a.second->defined() ? a.second->str() : "undefined");
    }
    MOECORE_FAIL(op_, ": ", std::forward<A>(msg)..., "; arguments: ", all);
  }
  // name must be defined, on the router's device, contiguous, of shape s and dtype t.
  void tensor(const char* name, const Tensor& x, const Shape& s, DType t) const {
    if (!x.defined()) fail(name, " is undefined (expected ", s.str(), " ", dtype_name(t), ")");
    if (x.device() != device_)
      fail(name, " is on ", device_name(x.device()), " but the router runs on ", device_name(device_),
           " (ctx.device): move it with Tensor::to_device or allocate it there");
    if (!(x.shape() == s)) fail(name, " must have shape ", s.str(), ", got ", x.shape().str());
    if (x.dtype() != t) fail(name, " must be ", dtype_name(t), ", got ", dtype_name(x.dtype()));
    if (!x.is_contiguous()) fail(name, " must be contiguous");
  }

 private:
  static constexpr int kMaxArgs = 8;
  const char* op_;
  Device device_;
  std::array<Arg, kMaxArgs> args_{};
  int n_ = 0;
};

// Checks every cache tensor the config needs (op names the caller).
void check_cache(const ArgCheck& chk, const RouterCache& c, const RouterDims& d, const MoeConfig& cfg, DType x_dtype);
bool router_needs_work(const MoeConfig& cfg, DType x_dtype);
// The coefficients of the configured losses.
ops::RouterLossCoeffs router_loss_coeffs(const MoeConfig& cfg);

// ---- router_losses.cpp ----
// Training only: z-loss and the aux losses from cache.logits; fills stats.losses, cache.dlogits_loss and the
// global_aux_loss accumulators (all-reducing this micro-batch's counts over d.global_aux_group between two ops).
// Uses cache.dlogits as workspace.
void router_losses(RouterStats& stats, RouterState& st, RouterCache& c, const Tensor& padding, const RouterDims& d,
                   const MoeConfig& cfg, const ops::Context& ctx);

}  // namespace moecore::moe::router_detail
