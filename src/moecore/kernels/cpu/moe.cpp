// CPU kernels of the MoE token permutation (plan, permute, unpermute, the all-to-all chunk sort) and of the
// expert-row steps (probability scaling, the shared expert's gate). Counts, offsets and indices are tensors:
// these kernels read them, the host never does. Every output element has one writer and a fixed summation
// order, so results do not depend on the thread count. On a cuda context each op dispatches to kernels/cuda/moe.cu
// after the checks that read no tensor data (the data checks below the dispatch are the CPU's own).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops {
namespace {

constexpr int64_t kParallelRows = 1 << 15;  // elements below which a pass stays on the calling thread

// A 2-D f32|bf16|f16 operand with a unit last stride.
void check_rows_operand(const cpu::Checker& ck, const char* name) {
  const Tensor& t = ck.get(name);
  ck.rank(name, 2);
  ck.float_dtype(name);
  if (t.numel() > 0 && t.stride(1) != 1) ck.fail(name, " needs a unit last stride");
}

void check_vector(const cpu::Checker& ck, const char* name, DType dtype, int64_t n) {
  ck.dtype(name, dtype);
  ck.shape(name, Shape{n});
  ck.contiguous(name);
}

// dst[r] = src[row_token[r]] for r < R, converting the element type; with probs, also
// pp[r] = probs[row_token[r], expert of r] in the same sweep (the expert found by bisecting offsets).
template <class TD, class TS>
void gather_rows(TD* dst, int64_t dst_ld, const TS* src, int64_t src_ld, int64_t H, const int32_t* row_token,
                 const int64_t* off, int64_t E, float* pp, const float* probs) {
  const int64_t R = off[E];
#pragma omp parallel for schedule(static) if (R * H > kParallelRows)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = row_token[r];
    const TS* s = src + t * src_ld;
    TD* d = dst + r * dst_ld;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) cpu::st(d[j], cpu::ld(s[j]));
    if (pp) {
      const int64_t e = std::upper_bound(off, off + E + 1, r) - off - 1;
      pp[r] = probs[t * E + e];
    }
  }
}

// The rows covered by group_rows (their sum), read by the kernel.
int64_t covered_rows(const cpu::Checker& ck, int64_t R) {
  const int64_t G = ck.get("group_rows").numel();
  const std::vector<int64_t>& n = cpu::group_counts(ck, G, R);
  int64_t sum = 0;
  for (int64_t v : n) sum += v;
  return sum;
}

inline float sigmoid(float z) {
  return 1.0f / (1.0f + std::exp(-z));
}

}  // namespace

// Serial on purpose: two sweeps over a [T, E] bool map are ~0.1% of the layer, and the token-major sweep
// hands out rows per expert in ascending token order without any cross-thread bookkeeping.
void moe_plan(Tensor& counts, Tensor& offsets, Tensor& token_rows, Tensor& row_token, const Tensor& map,
              const Context& ctx) {
  const cpu::Checker ck("moe_plan", ctx,
                        {{"counts", &counts},
                         {"offsets", &offsets},
                         {"token_rows", &token_rows},
                         {"row_token", &row_token},
                         {"map", &map}},
                        cpu::Backends::cpu_and_cuda);
  ck.dtype("map", DType::boolean);
  ck.rank("map", 2);
  ck.contiguous("map");
  const int64_t T = map.size(0), E = map.size(1);
  check_vector(ck, "counts", DType::i64, E);
  check_vector(ck, "offsets", DType::i64, E + 1);
  ck.dtype("token_rows", DType::i32);
  ck.shape("token_rows", Shape{T, E});
  ck.contiguous("token_rows");
  ck.dtype("row_token", DType::i32);
  ck.rank("row_token", 1);
  ck.contiguous("row_token");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_plan(counts, offsets, token_rows, row_token, map, ctx);
  const bool* m = map.data<bool>();
  int64_t* n = counts.data<int64_t>();
  int64_t* off = offsets.data<int64_t>();
  std::fill(n, n + E, int64_t{0});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) n[e] += m[t * E + e];
  off[0] = 0;
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + n[e];
  const int64_t R = off[E], M = row_token.numel();
  if (R > M)
    ck.fail("the routing map has ", R, " routed pairs but row_token holds ", M,
            " rows; size the dispatch buffers with dispatch_max_rows for this T, E, K and capacity");
  int32_t* tr = token_rows.data<int32_t>();
  int32_t* rt = row_token.data<int32_t>();
  int64_t* cursor = cpu::scratch<int64_t, 7>(static_cast<size_t>(E));
  std::copy(off, off + E, cursor);
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
  std::fill(rt + R, rt + M, int32_t{-1});
}

void moe_permute(Tensor& rows, Tensor& row_probs, const Tensor& x, const Tensor& probs, const Tensor& row_token,
                 const Tensor& offsets, const Context& ctx) {
  const bool with_probs = probs.defined() || row_probs.defined();
  const cpu::Checker ck =
      with_probs ? cpu::Checker("moe_permute", ctx,
                                {{"rows", &rows},
                                 {"row_probs", &row_probs},
                                 {"x", &x},
                                 {"probs", &probs},
                                 {"row_token", &row_token},
                                 {"offsets", &offsets}},
                                cpu::Backends::cpu_and_cuda)
                 : cpu::Checker("moe_permute", ctx,
                                {{"rows", &rows}, {"x", &x}, {"row_token", &row_token}, {"offsets", &offsets}},
                                cpu::Backends::cpu_and_cuda);
  check_rows_operand(ck, "rows");
  check_rows_operand(ck, "x");
  const int64_t T = x.size(0), H = x.size(1), M = rows.size(0);
  if (rows.size(1) != H) ck.fail("rows and x must have the same width");
  ck.dtype("offsets", DType::i64);
  ck.rank("offsets", 1);
  ck.contiguous("offsets");
  const int64_t E = offsets.numel() - 1;
  if (E < 1) ck.fail("offsets needs E + 1 >= 2 entries");
  check_vector(ck, "row_token", DType::i32, M);
  if (with_probs) {
    ck.dtype("probs", DType::f32);
    ck.shape("probs", Shape{T, E});
    ck.contiguous("probs");
    check_vector(ck, "row_probs", DType::f32, M);
  }
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_permute(rows, row_probs, x, probs, row_token, offsets, ctx);
  const int64_t* off = offsets.data<int64_t>();
  if (off[E] > M) ck.fail("offsets end at ", off[E], " rows but rows holds ", M);
  float* pp = with_probs ? row_probs.data<float>() : nullptr;
  const float* prob = with_probs ? probs.data<float>() : nullptr;
  const int32_t* rt = row_token.data<int32_t>();
  cpu::with_float_type(rows.dtype(), [&](auto td) {
    cpu::with_float_type(x.dtype(), [&](auto ts) {
      using TD = decltype(td);
      using TS = decltype(ts);
      gather_rows(static_cast<TD*>(rows.raw()), rows.stride(0), static_cast<const TS*>(x.raw()), x.stride(0), H, rt,
                  off, E, pp, prob);
    });
  });
}

void moe_unpermute(Tensor& y, const Tensor& rows, const Tensor& token_rows, bool accumulate, const Context& ctx) {
  const cpu::Checker ck("moe_unpermute", ctx, {{"y", &y}, {"rows", &rows}, {"token_rows", &token_rows}},
                        cpu::Backends::cpu_and_cuda);
  check_rows_operand(ck, "y");
  ck.dtype("y", DType::f32);
  check_rows_operand(ck, "rows");
  ck.dtype("token_rows", DType::i32);
  ck.rank("token_rows", 2);
  ck.contiguous("token_rows");
  const int64_t T = y.size(0), H = y.size(1), E = token_rows.size(1), M = rows.size(0);
  if (token_rows.size(0) != T || rows.size(1) != H) ck.fail("need y [T, H], rows [M, H] and token_rows [T, E]");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_unpermute(y, rows, token_rows, accumulate, ctx);
  const int32_t* tr = token_rows.data<int32_t>();
  for (int64_t i = 0; i < T * E; ++i)
    if (tr[i] >= M) ck.fail("token_rows names row ", tr[i], " but rows holds ", M);
  const int64_t ldy = y.stride(0), ldr = rows.stride(0);
  float* yp = y.data<float>();
  cpu::with_float_type(rows.dtype(), [&](auto t) {
    using T_ = decltype(t);
    const T_* rp = static_cast<const T_*>(rows.raw());
#pragma omp parallel for schedule(static) if (T * H > kParallelRows)
    for (int64_t tok = 0; tok < T; ++tok) {
      float* yt = yp + tok * ldy;
      bool first = !accumulate;
      for (int64_t e = 0; e < E; ++e) {
        const int32_t r = tr[tok * E + e];
        if (r < 0) continue;
        const T_* src = rp + r * ldr;
        if (first) {
#pragma omp simd
          for (int64_t j = 0; j < H; ++j) yt[j] = cpu::ld(src[j]);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < H; ++j) yt[j] += cpu::ld(src[j]);
        }
        first = false;
      }
      if (first) std::fill(yt, yt + H, 0.0f);
    }
  });
}

void moe_unpermute_probs(Tensor& out, const Tensor& values, const Tensor& token_rows, const Context& ctx) {
  const cpu::Checker ck("moe_unpermute_probs", ctx, {{"out", &out}, {"values", &values}, {"token_rows", &token_rows}},
                        cpu::Backends::cpu_and_cuda);
  ck.dtype("out", DType::f32);
  ck.rank("out", 2);
  if (out.numel() > 0 && out.stride(1) != 1) ck.fail("out needs a unit last stride");
  ck.dtype("values", DType::f32);
  ck.rank("values", 1);
  ck.contiguous("values");
  ck.dtype("token_rows", DType::i32);
  ck.shape("token_rows", out.shape());
  ck.contiguous("token_rows");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_unpermute_probs(out, values, token_rows, ctx);
  const int64_t T = out.size(0), E = out.size(1), M = values.numel(), ld = out.stride(0);
  const int32_t* tr = token_rows.data<int32_t>();
  const float* v = values.data<float>();
  float* o = out.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      const int32_t r = tr[t * E + e];
      if (r >= M) ck.fail("token_rows names row ", r, " but values holds ", M);
      o[t * ld + e] = r >= 0 ? v[r] : 0.0f;
    }
}

void moe_sort_chunks(Tensor& out, const Tensor& in, const Tensor& chunk_counts, int64_t P, int64_t El, bool inverse,
                     const Context& ctx) {
  const cpu::Checker ck("moe_sort_chunks", ctx, {{"out", &out}, {"in", &in}, {"chunk_counts", &chunk_counts}},
                        cpu::Backends::cpu_and_cuda);
  if (P < 1 || El < 1) ck.fail("need P >= 1 and El >= 1, got P ", P, ", El ", El);
  ck.same_dtype("out", "in");
  ck.contiguous("out");
  ck.contiguous("in");
  check_vector(ck, "chunk_counts", DType::i64, P * El);
  if (out.dim() < 1 || in.dim() != out.dim()) ck.fail("out and in need the same rank >= 1");
  const int64_t row_elems = out.dim() == 1 ? 1 : out.stride(0);
  if ((in.dim() == 1 ? 1 : in.stride(0)) != row_elems) ck.fail("out and in rows differ in width");
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_sort_chunks(out, in, chunk_counts, P, El, inverse, ctx);
  const int64_t* n = chunk_counts.data<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < P * El; ++i) {
    if (n[i] < 0) ck.fail("chunk_counts[", i, "] = ", n[i], " is negative");
    total += n[i];
  }
  if (total > out.size(0) || total > in.size(0))
    ck.fail("the chunks hold ", total, " rows, more than out (", out.size(0), ") or in (", in.size(0), ")");
  const int64_t row_bytes = row_elems * static_cast<int64_t>(dtype_size(out.dtype()));
  // Chunk (s, le) starts at recv_off[s*El+le] in the receive layout and at exp_off[s*El+le] in the expert one.
  int64_t* recv_off = cpu::scratch<int64_t, 8>(static_cast<size_t>(P * El));
  int64_t* exp_off = cpu::scratch<int64_t, 9>(static_cast<size_t>(P * El));
  int64_t o = 0;
  for (int64_t i = 0; i < P * El; ++i) {
    recv_off[i] = o;
    o += n[i];
  }
  o = 0;
  for (int64_t le = 0; le < El; ++le)
    for (int64_t s = 0; s < P; ++s) {
      exp_off[s * El + le] = o;
      o += n[s * El + le];
    }
  char* dst = static_cast<char*>(out.raw());
  const char* src = static_cast<const char*>(in.raw());
  for (int64_t i = 0; i < P * El; ++i) {
    if (n[i] == 0) continue;
    const int64_t from = inverse ? exp_off[i] : recv_off[i], to = inverse ? recv_off[i] : exp_off[i];
    std::memcpy(dst + to * row_bytes, src + from * row_bytes, static_cast<size_t>(n[i] * row_bytes));
  }
}

void moe_chunk_counts(Tensor& counts, Tensor& offsets, const Tensor& chunk_counts, int64_t P, const Context& ctx) {
  const cpu::Checker ck("moe_chunk_counts", ctx,
                        {{"counts", &counts}, {"offsets", &offsets}, {"chunk_counts", &chunk_counts}},
                        cpu::Backends::cpu_and_cuda);
  const int64_t El = counts.numel();
  if (P < 1 || El < 1) ck.fail("need P >= 1 and El >= 1");
  check_vector(ck, "counts", DType::i64, El);
  check_vector(ck, "offsets", DType::i64, El + 1);
  check_vector(ck, "chunk_counts", DType::i64, P * El);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_chunk_counts(counts, offsets, chunk_counts, P, ctx);
  const int64_t* c = chunk_counts.data<int64_t>();
  int64_t* n = counts.data<int64_t>();
  int64_t* off = offsets.data<int64_t>();
  off[0] = 0;
  for (int64_t le = 0; le < El; ++le) {
    n[le] = 0;
    for (int64_t s = 0; s < P; ++s) n[le] += c[s * El + le];
    off[le + 1] = off[le] + n[le];
  }
}

void moe_scale_rows(Tensor& a, const Tensor& act, const Tensor& p, const Tensor& group_rows, const Context& ctx) {
  const cpu::Checker ck("moe_scale_rows", ctx, {{"a", &a}, {"act", &act}, {"p", &p}, {"group_rows", &group_rows}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("a", 2);
  ck.float_dtype("a");
  ck.same_dtype("act", "a");
  ck.same_shape("act", "a");
  ck.contiguous("a");
  ck.contiguous("act");
  const int64_t M = a.size(0), F = a.size(1);
  check_vector(ck, "p", DType::f32, M);
  cpu::check_group_rows(ck, group_rows.numel());
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_scale_rows(a, act, p, group_rows, ctx);
  const int64_t R = covered_rows(ck, M);
  const float* pp = p.data<float>();
  // a is computed from the stored (rounded) act, so that backward's recompute of a for the fc2 weight
  // gradient is bit-identical to the forward's a.
  cpu::with_float_type(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* ap = a.data<T>();
    const T* xp = act.data<T>();
#pragma omp parallel for schedule(static) if (R * F > kParallelRows)
    for (int64_t r = 0; r < R; ++r) {
      const float pr = pp[r];
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) cpu::st(ap[r * F + j], cpu::ld(xp[r * F + j]) * pr);
    }
  });
}

void moe_scale_rows_backward(Tensor& dp, Tensor& da, Tensor& a, const Tensor& act, const Tensor& p,
                             const Tensor& group_rows, bool accumulate, const Context& ctx) {
  const cpu::Checker ck("moe_scale_rows_backward", ctx,
                        {{"dp", &dp}, {"da", &da}, {"a", &a}, {"act", &act}, {"p", &p}, {"group_rows", &group_rows}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("a", 2);
  ck.float_dtype("a");
  for (const char* name : {"da", "act"}) {
    ck.same_dtype(name, "a");
    ck.same_shape(name, "a");
    ck.contiguous(name);
  }
  ck.contiguous("a");
  const int64_t M = a.size(0), F = a.size(1);
  check_vector(ck, "p", DType::f32, M);
  check_vector(ck, "dp", DType::f32, M);
  cpu::check_group_rows(ck, group_rows.numel());
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::moe_scale_rows_backward(dp, da, a, act, p, group_rows, accumulate, ctx);
  const int64_t R = covered_rows(ck, M);
  const float* pp = p.data<float>();
  float* dpp = dp.data<float>();
  cpu::with_float_type(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* dap = da.data<T>();
    T* ap = a.data<T>();
    const T* xp = act.data<T>();
#pragma omp parallel for schedule(static) if (R * F > kParallelRows)
    for (int64_t r = 0; r < R; ++r) {
      const float pr = pp[r];
      T* dar = dap + r * F;
      T* ar = ap + r * F;
      const T* actr = xp + r * F;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < F; ++j) {
        const float v = cpu::ld(actr[j]), g = cpu::ld(dar[j]);
        dot += v * g;
        cpu::st(dar[j], g * pr);
        cpu::st(ar[j], v * pr);
      }
      dpp[r] = accumulate ? dpp[r] + dot : dot;
    }
  });
}

void moe_shared_gate_forward(Tensor& y, Tensor& s, const Tensor& x, const Tensor& g, const Tensor& out,
                             const Context& ctx) {
  const cpu::Checker ck("moe_shared_gate_forward", ctx, {{"y", &y}, {"s", &s}, {"x", &x}, {"g", &g}, {"out", &out}},
                        cpu::Backends::cpu_and_cuda);
  ck.rank("x", 2);
  ck.float_dtype("x");
  ck.contiguous("x");
  const int64_t N = x.size(0), H = x.size(1);
  for (const char* name : {"y", "out"}) {
    ck.dtype(name, DType::f32);
    ck.shape(name, x.shape());
    ck.contiguous(name);
  }
  check_vector(ck, "s", DType::f32, N);
  check_vector(ck, "g", DType::f32, H);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_shared_gate_forward(y, s, x, g, out, ctx);
  float* yp = y.data<float>();
  float* sp = s.data<float>();
  const float* gp = g.data<float>();
  const float* op = out.data<float>();
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data<T>();
#pragma omp parallel for schedule(static) if (N * H > kParallelRows)
    for (int64_t t = 0; t < N; ++t) {
      const T* xt = xp + t * H;
      float z = 0.0f;
#pragma omp simd reduction(+ : z)
      for (int64_t j = 0; j < H; ++j) z += cpu::ld(xt[j]) * gp[j];
      const float st = sigmoid(z);
      sp[t] = st;
      float* yt = yp + t * H;
      const float* ot = op + t * H;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) yt[j] += st * ot[j];
    }
  });
}

void moe_shared_gate_backward(Tensor& dout, Tensor& dx, Tensor& dg, const Tensor& dy, const Tensor& x, const Tensor& g,
                              const Tensor& out, const Tensor& s, const Context& ctx) {
  const cpu::Checker ck(
      "moe_shared_gate_backward", ctx,
      {{"dout", &dout}, {"dx", &dx}, {"dg", &dg}, {"dy", &dy}, {"x", &x}, {"g", &g}, {"out", &out}, {"s", &s}},
      cpu::Backends::cpu_and_cuda);
  ck.rank("x", 2);
  ck.float_dtype("x");
  ck.contiguous("x");
  const int64_t N = x.size(0), H = x.size(1);
  ck.same_dtype("dout", "x");
  ck.same_shape("dout", "x");
  ck.contiguous("dout");
  for (const char* name : {"dx", "dy", "out"}) {
    ck.dtype(name, DType::f32);
    ck.shape(name, x.shape());
    ck.contiguous(name);
  }
  check_vector(ck, "s", DType::f32, N);
  check_vector(ck, "g", DType::f32, H);
  check_vector(ck, "dg", DType::f32, H);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::moe_shared_gate_backward(dout, dx, dg, dy, x, g, out, s, ctx);
  float* dz = cpu::scratch<float, 10>(static_cast<size_t>(N));
  const float* dyp = dy.data<float>();
  const float* op = out.data<float>();
  const float* sp = s.data<float>();
  const float* gp = g.data<float>();
  float* dxp = dx.data<float>();
  float* dgp = dg.data<float>();
  cpu::with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* dcp = dout.data<T>();
    const T* xp = x.data<T>();
    // Per token: dout[t] = dy[t] * s; dz[t] = (dy[t] . out[t]) * s (1 - s); dx[t] += dz[t] * g.
#pragma omp parallel for schedule(static) if (N * H > kParallelRows)
    for (int64_t t = 0; t < N; ++t) {
      const float* dyt = dyp + t * H;
      const float* ot = op + t * H;
      const float st = sp[t];
      float ds = 0.0f;
#pragma omp simd reduction(+ : ds)
      for (int64_t j = 0; j < H; ++j) ds += dyt[j] * ot[j];
      const float dzt = ds * st * (1.0f - st);
      dz[t] = dzt;
      T* dct = dcp + t * H;
      float* dxt = dxp + t * H;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) {
        cpu::st(dct[j], dyt[j] * st);
        dxt[j] += dzt * gp[j];
      }
    }
    // dg[j] += sum_t dz[t] * x[t, j], in token order per column block (deterministic for any thread count).
    constexpr int64_t kBlock = 256;
    const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (N * H > kParallelRows)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j0 = b * kBlock, j1 = std::min(H, j0 + kBlock);
      float acc[kBlock] = {};
      for (int64_t t = 0; t < N; ++t) {
        const T* xt = xp + t * H;
        const float d = dz[t];
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) acc[j - j0] += d * cpu::ld(xt[j]);
      }
      for (int64_t j = j0; j < j1; ++j) dgp[j] += acc[j - j0];
    }
  });
}

}  // namespace moecore::ops
