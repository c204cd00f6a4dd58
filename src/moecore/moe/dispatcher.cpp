// Token permutation (expert-major, ascending token) and its inverse, and the single-process LocalDispatcher.
// Every pass here is one fused sweep over memory, parallel over rows or tokens; each output element has one
// writer and a fixed summation order, so results do not depend on the thread count.
// CPU only: these loops touch tensor memory directly (a CUDA dispatcher would bring its own kernels).
// Not here: routing (router.h), expert compute (experts.h), communication (the EP dispatchers).
#include "moecore/moe/dispatcher.h"

#include <algorithm>

namespace moecore::moe {
namespace {

template <class Fn>
decltype(auto) with_float(DType t, Fn&& fn) {
  if (t == DType::bf16) return fn(bf16{});
  return fn(float{});
}

void check_cpu(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->device() != Device::cpu)
      MOECORE_FAIL(op, ": the CPU dispatcher got a tensor on another device: ", t->str());
}

void check_float(const char* op, const char* name, const Tensor& t) {
  if (!t.defined() || (t.dtype() != DType::f32 && t.dtype() != DType::bf16))
    MOECORE_FAIL(op, ": ", name, " must be an f32 or bf16 tensor, got ", t.defined() ? t.str() : "undefined");
}

// dst[row] = src[row_token[row]] for row < R, converting the element type; with probs, also
// pp[row] = probs[row_token[row], expert of row] in the same sweep (the expert found by bisecting offsets).
template <class TD, class TS>
void gather_rows(TD* dst, int64_t dst_ld, const TS* src, int64_t src_ld, int64_t H, const DispatchPlan& plan,
                 float* pp = nullptr, const float* probs = nullptr) {
  const int32_t* row_token = plan.row_token.data<int32_t>();
  const int64_t R = plan.rows(), E = plan.E;
  const int64_t* off = plan.expert_offset.data();
#pragma omp parallel for schedule(static) if (R * H > (1 << 15))
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = row_token[r];
    const TS* s = src + t * src_ld;
    TD* d = dst + r * dst_ld;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) from_float(d[j], to_float(s[j]));
    if (pp) {
      const int64_t e = std::upper_bound(off, off + E + 1, r) - off - 1;
      pp[r] = probs[t * E + e];
    }
  }
}

void check_plan(const char* op, const DispatchPlan& plan) {
  if (static_cast<int64_t>(plan.expert_offset.size()) != plan.E + 1 || !plan.row_token.defined() ||
      !plan.token_rows.defined())
    MOECORE_FAIL(op, ": the dispatch plan is not built (call dispatch_plan_build first)");
}

}  // namespace

int64_t dispatch_max_rows(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity, int64_t alignment) {
  if (T < 0 || E <= 0 || K <= 0 || K > E)
    MOECORE_FAIL("dispatch_max_rows: need T >= 0 and 0 < K <= E, got T ", T, ", E ", E, ", K ", K);
  // A token meets an expert at most once, so no expert holds more than T rows.
  int64_t rows = T * K;
  if (capacity > 0) {
    const int64_t per_expert = std::min(capacity, T);
    rows = pad_to_capacity ? E * per_expert : std::min(rows, E * per_expert);
  }
  if (alignment > 1) rows += E * (alignment - 1);
  return rows;
}

DispatchBuffers dispatch_buffers_alloc(int64_t T, int64_t H, int64_t E, int64_t max_rows, DType x_dtype) {
  if (x_dtype != DType::f32 && x_dtype != DType::bf16)
    MOECORE_FAIL("dispatch_buffers_alloc: x dtype must be f32 or bf16, got ", dtype_name(x_dtype));
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  DispatchBuffers b;
  b.plan.T = T;
  b.plan.E = E;
  b.plan.tokens_per_expert.assign(E, 0);
  b.plan.expert_offset.assign(E + 1, 0);
  b.plan.row_token = Tensor::empty({max_rows}, DType::i32, act);
  b.plan.token_rows = Tensor::empty({T, E}, DType::i32, act);
  b.permuted_x = Tensor::empty({max_rows, H}, x_dtype, act);
  b.permuted_probs = Tensor::empty({max_rows}, DType::f32, act);
  b.expert_out = Tensor::empty({max_rows, H}, x_dtype, work);  // forward scratch, not kept for backward
  b.dpermuted = Tensor::empty({max_rows, H}, x_dtype, work);
  b.dexpert_in = Tensor::empty({max_rows, H}, DType::f32, work);
  b.dpermuted_probs = Tensor::empty({max_rows}, DType::f32, work);
  return b;
}

DispatcherKind parse_dispatcher_kind(const std::string& s) {
  if (s == "alltoall") return DispatcherKind::alltoall;
  if (s == "allgather") return DispatcherKind::allgather;
  MOECORE_FAIL("--moe-token-dispatcher-type: '", s, "' is not supported (use alltoall or allgather)");
}

const char* dispatcher_kind_name(DispatcherKind k) {
  switch (k) {
    case DispatcherKind::local:
      return "local";
    case DispatcherKind::alltoall:
      return "alltoall";
    case DispatcherKind::allgather:
      return "allgather";
  }
  return "?";
}

int64_t dispatch_max_rows_ep(int64_t T, int64_t E, int64_t K, int64_t capacity, bool pad_to_capacity, int64_t alignment,
                             int64_t ep) {
  if (ep <= 0 || E % ep != 0)
    MOECORE_FAIL("dispatch_max_rows_ep: the number of experts (", E,
                 ") must be divisible by the expert-parallel size (", ep, ")");
  if (ep == 1) return dispatch_max_rows(T, E, K, capacity, pad_to_capacity, alignment);
  if (alignment > 1)
    MOECORE_FAIL("dispatch_max_rows_ep: router padding (alignment ", alignment,
                 ") is not supported with expert parallelism yet");
  const int64_t El = E / ep;
  // Rows one source rank sends to one destination: a token meets each of the El experts at most once.
  int64_t per_source = dispatch_max_rows(T, E, K, 0, false, 0);
  per_source = std::min(per_source, T * std::min(K, El));
  if (capacity > 0) {
    const int64_t per_expert = std::min(capacity, T);
    per_source = pad_to_capacity ? El * per_expert : std::min(per_source, El * per_expert);
  }
  return ep * per_source;
}

DispatchBuffers dispatch_buffers_alloc_ep(DispatcherKind kind, int64_t T, int64_t H, int64_t E, int64_t ep,
                                          int64_t max_send, int64_t max_rows, DType x_dtype) {
  if (kind == DispatcherKind::local || ep == 1) return dispatch_buffers_alloc(T, H, E, max_rows, x_dtype);
  if (ep <= 0 || E % ep != 0)
    MOECORE_FAIL("dispatch buffers: the number of experts (", E, ") must be divisible by the expert-parallel size (",
                 ep, ")");
  const int64_t El = E / ep;
  const auto act = MemCategory::activations, work = MemCategory::workspace;
  // The expert side: El local experts; the token side of the plan depends on the kind.
  const int64_t plan_tokens = kind == DispatcherKind::allgather ? ep * T : 0;
  DispatchBuffers b = dispatch_buffers_alloc(plan_tokens, H, El, max_rows, x_dtype);
  EpBuffers& p = b.ep;
  p.ep = ep;
  p.local_experts = El;
  if (kind == DispatcherKind::alltoall) {
    b.plan.row_token = Tensor();  // the expert side needs only the counts
    b.plan.token_rows = Tensor();
    p.send_plan.T = T;
    p.send_plan.E = E;
    p.send_plan.row_token = Tensor::empty({max_send}, DType::i32, act);
    p.send_plan.token_rows = Tensor::empty({T, E}, DType::i32, act);
    p.counts.assign(static_cast<size_t>(E), 0);
    p.send_rows.assign(static_cast<size_t>(ep), 0);
    p.recv_rows.assign(static_cast<size_t>(ep), 0);
    p.el_blocks.assign(static_cast<size_t>(ep), El);
    p.recv_off.assign(static_cast<size_t>(E), 0);
    p.exp_off.assign(static_cast<size_t>(E), 0);
    p.send_x = Tensor::empty({max_send, H}, x_dtype, work);
    p.send_f = Tensor::empty({max_send, H}, DType::f32, work);
    p.send_p = Tensor::empty({max_send}, DType::f32, work);
    p.stage_x = Tensor::empty({max_rows, H}, x_dtype, work);
    p.stage_f = Tensor::empty({max_rows, H}, DType::f32, work);
    p.stage_p = Tensor::empty({max_rows}, DType::f32, work);
  } else {
    p.gmap = Tensor::empty({ep * T, E}, DType::boolean, act);
    p.lmap = Tensor::empty({ep * T, El}, DType::boolean, act);
    p.lprobs = Tensor::empty({ep * T, El}, DType::f32, act);
    p.gx = Tensor::empty({ep * T, H}, x_dtype, work);
    p.gprobs = Tensor::empty({ep * T, E}, DType::f32, work);
    p.gy = Tensor::empty({ep * T, H}, DType::f32, work);
    p.gdprobs = Tensor::empty({ep * T, E}, DType::f32, work);
    p.ty = Tensor::empty({T, H}, DType::f32, work);
  }
  return b;
}

std::vector<Tensor*> dispatch_scratch_tensors(DispatchBuffers& b) {
  EpBuffers& p = b.ep;
  return {&b.expert_out, &b.dpermuted, &b.dexpert_in, &b.dpermuted_probs, &p.send_x, &p.send_f,  &p.send_p, &p.stage_x,
          &p.stage_f,    &p.stage_p,   &p.gx,         &p.gprobs,          &p.gy,     &p.gdprobs, &p.ty};
}

// Serial on purpose: two sweeps over a [T, E] bool map are ~0.1% of the layer, and the token-major sweep
// hands out rows per expert in ascending token order without any cross-thread bookkeeping.
void dispatch_plan_build(DispatchPlan& plan, const Tensor& map, const ops::Context& ctx) {
  check_cpu("dispatch_plan_build", {&map});
  if (map.dtype() != DType::boolean || map.dim() != 2 || !map.is_contiguous())
    MOECORE_FAIL("dispatch_plan_build: map must be a contiguous [T, E] bool tensor, got ", map.str());
  const int64_t T = map.size(0), E = map.size(1);
  const bool* m = map.data<bool>();
  plan.T = T;
  plan.E = E;
  plan.tokens_per_expert.assign(E, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) plan.tokens_per_expert[e] += m[t * E + e];
  plan.expert_offset.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) plan.expert_offset[e + 1] = plan.expert_offset[e] + plan.tokens_per_expert[e];
  const int64_t R = plan.rows();
  if (!plan.token_rows.defined() || !(plan.token_rows.shape() == Shape{T, E}))
    plan.token_rows = Tensor::empty({T, E}, DType::i32, MemCategory::activations);
  if (!plan.row_token.defined()) plan.row_token = Tensor::empty({R}, DType::i32, MemCategory::activations);
  if (R > plan.row_token.numel())
    MOECORE_FAIL("dispatch_plan_build: the routing map has ", R, " routed pairs but the dispatch buffers hold ",
                 plan.row_token.numel(), " rows; size them with dispatch_max_rows for this T, E, K and capacity");
  int32_t* tr = plan.token_rows.data<int32_t>();
  int32_t* rt = plan.row_token.data<int32_t>();
  std::vector<int64_t>& cursor = plan.tokens_per_expert;  // reused as the next free row, restored below
  for (int64_t e = 0; e < E; ++e) cursor[e] = plan.expert_offset[e];
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      if (m[t * E + e]) {
        const int64_t row = cursor[e]++;
        tr[t * E + e] = static_cast<int32_t>(row);
        rt[row] = static_cast<int32_t>(t);
      } else {
        tr[t * E + e] = -1;
      }
    }
  }
  for (int64_t e = 0; e < E; ++e) cursor[e] -= plan.expert_offset[e];
}

void permute_tokens(Tensor& permuted_x, Tensor& permuted_probs, const Tensor& x, const Tensor& probs,
                    const DispatchPlan& plan, const ops::Context& ctx) {
  check_cpu("permute_tokens", {&permuted_x, &permuted_probs, &x, &probs});
  check_plan("permute_tokens", plan);
  check_float("permute_tokens", "x", x);
  check_float("permute_tokens", "permuted_x", permuted_x);
  const int64_t R = plan.rows(), T = plan.T, E = plan.E;
  if (x.dim() != 2 || x.size(0) != T || x.stride(1) != 1 || permuted_x.dim() != 2 || permuted_x.size(0) < R ||
      permuted_x.size(1) != x.size(1) || permuted_x.stride(1) != 1)
    MOECORE_FAIL("permute_tokens: need x [T=", T, ", H] and permuted_x [>= ", R, ", H] with unit last strides, got x ",
                 x.str(), ", permuted_x ", permuted_x.str());
  if (probs.dtype() != DType::f32 || !(probs.shape() == Shape{T, E}) || !probs.is_contiguous() ||
      permuted_probs.dtype() != DType::f32 || permuted_probs.dim() != 1 || permuted_probs.size(0) < R ||
      !permuted_probs.is_contiguous())
    MOECORE_FAIL("permute_tokens: need probs [", T, ", ", E, "] f32 and permuted_probs [>= ", R, "] f32, got probs ",
                 probs.str(), ", permuted_probs ", permuted_probs.str());
  with_float(permuted_x.dtype(), [&](auto td) {
    with_float(x.dtype(), [&](auto ts) {
      using TD = decltype(td);
      using TS = decltype(ts);
      gather_rows(static_cast<TD*>(permuted_x.raw()), permuted_x.stride(0), static_cast<const TS*>(x.raw()),
                  x.stride(0), x.size(1), plan, permuted_probs.data<float>(), probs.data<float>());
    });
  });
}

void unpermute_tokens(Tensor& y, const Tensor& rows, const DispatchPlan& plan, bool accumulate,
                      const ops::Context& ctx) {
  check_cpu("unpermute_tokens", {&y, &rows});
  check_plan("unpermute_tokens", plan);
  check_float("unpermute_tokens", "rows", rows);
  const int64_t T = plan.T, E = plan.E, R = plan.rows();
  if (y.dtype() != DType::f32 || y.dim() != 2 || y.size(0) != T || y.stride(1) != 1 || rows.dim() != 2 ||
      rows.size(0) < R || rows.size(1) != y.size(1) || rows.stride(1) != 1)
    MOECORE_FAIL("unpermute_tokens: need y [T=", T, ", H] f32 and rows [>= ", R, ", H] with unit last strides, got y ",
                 y.str(), ", rows ", rows.str());
  const int64_t H = y.size(1), ldy = y.stride(0), ldr = rows.stride(0);
  const int32_t* tr = plan.token_rows.data<int32_t>();
  float* yp = y.data<float>();
  with_float(rows.dtype(), [&](auto t) {
    using T_ = decltype(t);
    const T_* rp = static_cast<const T_*>(rows.raw());
#pragma omp parallel for schedule(static) if (T * H > (1 << 15))
    for (int64_t tok = 0; tok < T; ++tok) {
      float* yt = yp + tok * ldy;
      bool first = !accumulate;
      for (int64_t e = 0; e < E; ++e) {
        const int32_t r = tr[tok * E + e];
        if (r < 0) continue;
        const T_* src = rp + r * ldr;
        if (first) {
#pragma omp simd
          for (int64_t j = 0; j < H; ++j) yt[j] = to_float(src[j]);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < H; ++j) yt[j] += to_float(src[j]);
        }
        first = false;
      }
      if (first) std::fill(yt, yt + H, 0.0f);
    }
  });
}

// ---- LocalDispatcher ----------------------------------------------------------------------------------

void LocalDispatcher::dispatch_prepare(DispatchBuffers& buf, const Tensor& x, const Tensor& probs, const Tensor& map,
                                       const ops::Context& ctx) {
  dispatch_plan_build(buf.plan, map, ctx);
  permute_tokens(buf.permuted_x, buf.permuted_probs, x, probs, buf.plan, ctx);
}

// With one process the rows never leave: the unpermute-sum (the all-to-all dispatcher's last local step)
// writes the output directly.
void LocalDispatcher::combine_prepare(DispatchBuffers&, const ops::Context&) {}

void LocalDispatcher::combine_finish(DispatchBuffers& buf, Tensor& y, const ops::Context& ctx) {
  unpermute_tokens(y, buf.expert_out.slice(0, 0, buf.plan.rows()), buf.plan, false, ctx);
}

void gather_token_rows(Tensor& rows, const Tensor& src, const DispatchPlan& plan, const ops::Context&) {
  check_cpu("gather_token_rows", {&src, &rows});
  check_plan("gather_token_rows", plan);
  check_float("gather_token_rows", "rows", rows);
  if (src.dtype() != DType::f32 || src.dim() != 2 || src.size(0) != plan.T || src.stride(1) != 1 || rows.dim() != 2 ||
      src.size(1) != rows.size(1) || rows.size(0) < plan.rows() || rows.stride(1) != 1)
    MOECORE_FAIL("gather_token_rows: need src [T=", plan.T, ", H] f32 matching rows ", rows.str(), ", got ", src.str());
  with_float(rows.dtype(), [&](auto td) {
    using TD = decltype(td);
    gather_rows(static_cast<TD*>(rows.raw()), rows.stride(0), src.data<float>(), src.stride(0), src.size(1), plan);
  });
}

void LocalDispatcher::combine_backward(DispatchBuffers& buf, const Tensor& dy, const ops::Context& ctx) {
  gather_token_rows(buf.dpermuted, dy, buf.plan, ctx);
}

void unpermute_backward(Tensor& dx, Tensor& dprobs, const Tensor& drows, const Tensor& dprob_rows,
                        const DispatchPlan& plan, const ops::Context& ctx) {
  check_cpu("unpermute_backward", {&dprobs, &dprob_rows});
  const int64_t T = plan.T, E = plan.E;
  if (dprobs.dtype() != DType::f32 || !(dprobs.shape() == Shape{T, E}) || !dprobs.is_contiguous() ||
      dprob_rows.dtype() != DType::f32 || dprob_rows.numel() < plan.rows())
    MOECORE_FAIL("unpermute_backward: need dprobs, a contiguous [", T, ", ", E, "] f32 tensor, and f32 values for ",
                 plan.rows(), " rows; got ", dprobs.str(), " and ", dprob_rows.str());
  unpermute_tokens(dx, drows, plan, true, ctx);
  const int32_t* tr = plan.token_rows.data<int32_t>();
  const float* v = dprob_rows.data<float>();
  float* dp = dprobs.data<float>();
  for (int64_t i = 0; i < T * E; ++i) dp[i] = tr[i] >= 0 ? v[tr[i]] : 0.0f;
}

void LocalDispatcher::dispatch_backward(DispatchBuffers& buf, Tensor& dx, Tensor& dprobs, const ops::Context& ctx) {
  unpermute_backward(dx, dprobs, buf.dexpert_in, buf.dpermuted_probs, buf.plan, ctx);
}

}  // namespace moecore::moe
