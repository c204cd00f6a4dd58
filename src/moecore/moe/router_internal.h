// Private helpers shared by router.cpp, router_topk.cpp and router_losses.cpp: score functions, the
// deterministic top-k, per-thread scratch, entry checks, and the stage functions each file defines.
// Only router*.cpp include this. Stages are templates on the router dtype R (float or double),
// instantiated for both in the file that defines them.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moecore/moe/router.h"

namespace moecore::moe::router_detail {

// Below this many [T, E] elements a router pass runs on the calling thread.
inline constexpr int64_t kParallelWork = 1 << 14;

// Grow-only buffer owned by the calling thread (OpenMP threads persist, so after the first step no
// call allocates). Slot separates buffers that are live at the same time.
template <class T, int Slot>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <class R>
inline R sigmoid(R z) {
  if (z >= R(0)) return R(1) / (R(1) + std::exp(-z));
  const R e = std::exp(z);
  return e / (R(1) + e);
}
template <class R>
inline R softplus(R z) {
  return std::max(z, R(0)) + std::log1p(std::exp(-std::fabs(z)));
}
// The sigmoid-family score f(z) and its derivative given f (sqrtsoftplus' = sigmoid / (2 f), -> 0 as f -> 0).
template <class R>
inline R score_fn(ScoreFunction f, R z) {
  return f == ScoreFunction::sigmoid ? sigmoid(z) : std::sqrt(softplus(z));
}
template <class R>
inline R score_fn_grad(ScoreFunction f, R z, R fz) {
  if (f == ScoreFunction::sigmoid) return fz * (R(1) - fz);
  return fz > R(0) ? sigmoid(z) / (R(2) * fz) : R(0);
}

template <class R>
inline void softmax_row(R* out, const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, z[i]);
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(z[i] - mx));
  for (int64_t i = 0; i < n; ++i) out[i] /= sum;
}
template <class R>
inline R logsumexp_row(const R* z, int64_t n) {
  R mx = z[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, z[i]);
  R sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(z[i] - mx);
  return mx + std::log(sum);
}

// The k largest of v[0, n) whose allowed[i] != 0 (all when allowed is null), written to idx in
// descending order. Ties go to the lower index: an element enters only if strictly larger than one
// already held, and is placed after equal ones.
template <class R>
inline void topk(int32_t* idx, const R* v, int64_t n, int64_t k, const uint8_t* allowed = nullptr) {
  int64_t held = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (allowed && !allowed[i]) continue;
    if (held == k && !(v[i] > v[idx[k - 1]])) continue;
    int64_t p = held < k ? held : k - 1;
    while (p > 0 && v[idx[p - 1]] < v[i]) {
      idx[p] = idx[p - 1];
      --p;
    }
    idx[p] = static_cast<int32_t>(i);
    held = std::min(held + 1, k);
  }
}

// Entry checks: every failure names the op, the rule and all arguments with shapes and dtypes.
class ArgCheck {
 public:
  using Arg = std::pair<const char*, const Tensor*>;
  // A fixed array, not a vector: the checks run every step and must not allocate.
  ArgCheck(const char* op, std::initializer_list<Arg> args) : op_(op) {
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
  // name must be defined, on the CPU, contiguous, of shape s and dtype t.
  void tensor(const char* name, const Tensor& x, const Shape& s, DType t) const {
    if (!x.defined()) fail(name, " is undefined (expected ", s.str(), " ", dtype_name(t), ")");
    if (x.device() != Device::cpu) fail(name, " is not on the CPU (the router has only the CPU backend)");
    if (!(x.shape() == s)) fail(name, " must have shape ", s.str(), ", got ", x.shape().str());
    if (x.dtype() != t) fail(name, " must be ", dtype_name(t), ", got ", dtype_name(x.dtype()));
    if (!x.is_contiguous()) fail(name, " must be contiguous");
  }

 private:
  static constexpr int kMaxArgs = 8;
  const char* op_;
  std::array<Arg, kMaxArgs> args_{};
  int n_ = 0;
};

// Checks every cache tensor the config needs (op names the caller).
void check_cache(const ArgCheck& chk, const RouterCache& c, const RouterDims& d, const MoeConfig& cfg, DType x_dtype);
bool router_needs_work(const MoeConfig& cfg, DType x_dtype);

// ---- router_topk.cpp ----
// From cache.logits: scores, topk_idx, topk_w; sparse weights (scaled, before dropping) into cache.dlogits
// (R, used as forward workspace) and the selection into map.
template <class R>
void route_tokens(RouterCache& c, Tensor& map, const RouterState& st, const RouterDims& d, const MoeConfig& cfg,
                  bool training);
// Capacity dropping from the sparse weights in cache.dlogits: writes probs (f32), map and topk_kept;
// returns the number of dropped (token, expert) pairs.
template <class R>
int64_t route_capacity(Tensor& probs, Tensor& map, RouterCache& c, const RouterDims& d, const MoeConfig& cfg);
// Per expert column, flips the first (-n_e) mod A zero entries to true.
void pad_routing_map(Tensor& map, int64_t T, int64_t E, int64_t A);
// out[e] += number of true map[t, e] over tokens t that are not padding (padding may be null).
void map_column_counts(int64_t* out, const Tensor& map, const bool* padding, int64_t T, int64_t E);
// cache.dlogits = d(sum probs * dprobs)/d logits + aux_grad_scale * cache.dlogits_loss.
template <class R>
void route_backward(RouterCache& c, const Tensor& dprobs, const RouterDims& d, const MoeConfig& cfg,
                    float aux_grad_scale);

// ---- router_losses.cpp ----
// Training only: z-loss and the aux losses from cache.logits; fills stats' loss fields, cache.dlogits_loss
// and the global_aux_loss accumulators. Uses cache.dlogits as workspace.
template <class R>
void router_losses(RouterStats& stats, RouterState& st, RouterCache& c, const bool* padding, const RouterDims& d,
                   const MoeConfig& cfg);

}  // namespace moecore::moe::router_detail
