// Context-parallel attention: all-gather of the keys and values, two chunk calls of the attention op, reduce-scatter of
// dK/dV (context_parallel.h).
#include "moecore/nn/context_parallel.h"

#include "moecore/core/error.h"
#include "moecore/core/rng.h"

namespace moecore::nn {

int64_t context_parallel_position(int64_t s, int64_t S, int rank, int size) {
  const int64_t c = S / (2 * size);
  const int64_t chunk = s < c ? rank : 2 * size - 1 - rank;
  return chunk * c + s % c;
}

void plan_context_parallel_workspace(ContextParallelWorkspace& w, const ops::QkvDims& local, int size, DType compute,
                                     BufferPlan& p) {
  if (size <= 1) return;
  const int64_t T = local.B * local.S, Tall = T * size, c = local.S / 2, W = local.width();
  const int64_t O = local.q_heads() * local.D, K = 2 * local.G * local.D;
  p.empty(w.kv, {T, K}, compute);
  p.empty(w.rows, {Tall, K}, compute);
  p.empty(w.full, {Tall, W}, compute);
  p.empty(w.dkv, {Tall, W}, compute);
  p.empty(w.block, {c, K}, DType::f32);
  p.empty(w.acc, {Tall, K}, DType::f32);
  p.empty(w.local, {T, K}, DType::f32);
  p.empty(w.q, {local.B * c, W}, compute);
  p.empty(w.dq, {T, W}, compute);
  p.empty(w.out, {local.B * c, O}, compute);
  p.empty(w.dout, {local.B * c, O}, compute);
}

namespace {

// The geometry of one call: P ranks, B sequences of S positions, S_local = S / P, chunks of c rows.
struct Chunks {
  int P, r;
  int64_t B, Sl, c, S;
  Chunks(int64_t B_, int64_t S_local, int rank, int size)
      : P(size), r(rank), B(B_), Sl(S_local), c(S_local / 2), S(S_local * size) {}
  Chunks(const ops::QkvDims& d, const ProcessGroup& g) : Chunks(d.B, d.S, g.rank(), g.size()) {}
  int64_t global_chunk(int rank, int k) const { return k == 0 ? rank : 2 * P - 1 - rank; }
  // The keys chunk k of this rank sees: the positions up to its end.
  int64_t keys(int k) const { return (global_chunk(r, k) + 1) * c; }
  // Row of (rank j, sequence b, local chunk k) in rank order ([P][B][S_local]) and in position order ([B][S]).
  int64_t rank_row(int j, int64_t b, int k) const { return (j * B + b) * Sl + k * c; }
  int64_t position_row(int j, int64_t b, int k) const { return b * S + global_chunk(j, k) * c; }
  // fn(rank-order row, position-order row) for every block of c rows.
  template <class Fn>
  void for_each_block(Fn&& fn) const {
    for (int j = 0; j < P; ++j)
      for (int64_t b = 0; b < B; ++b)
        for (int k = 0; k < 2; ++k) fn(rank_row(j, b, k), position_row(j, b, k));
  }
  ops::QkvDims dims(const ops::QkvDims& local, int k) const {
    ops::QkvDims d = local;
    d.S = c;
    d.Sk = keys(k);
    return d;
  }
};

Tensor rows_of(const Tensor& t, int64_t first, int64_t n) {
  return t.slice(0, first, first + n);
}

// Chunk k's mask: a key of its own derived from the layer's (the two calls' mask indices would overlap).
ops::Dropout chunk_dropout(const ops::Dropout& d, int k) {
  ops::Dropout out = d;
  if (!d.active()) return out;
  const auto x = philox4x32_10({static_cast<uint32_t>(k), 0x63703a63u, 0, 0}, d.key);  // "cp:c"
  out.key = {x[0], x[1]};
  return out;
}

// The key and value slots (R and R + 1 of every group) of rows [*, W] as packed [rows, 2*G*D] rows, and back.
Tensor packed_rows(const Tensor& packed, const ops::QkvDims& d) {
  return packed.view({packed.numel() / d.D, d.D});
}
ops::QkvDims rows_dims(const ops::QkvDims& d, int64_t rows) {
  return {1, rows, d.G, d.R, d.D};
}

// The group's keys and values gathered into ws.full's key and value slots in position order.
void gather_positions(const Tensor& qkv_rows, const ops::QkvDims& dims, const Chunks& ch, ContextParallelWorkspace& ws,
                      const ProcessGroup& g, const ops::Context& ctx) {
  const int64_t T = ch.B * ch.Sl;
  Tensor kv = packed_rows(ws.kv, dims);
  ops::qkv_slots_gather(kv, qkv_rows, rows_dims(dims, T), dims.R, 2, ctx);
  all_gather(ws.rows, ws.kv, g);
  ch.for_each_block([&](int64_t rr, int64_t pr) {
    Tensor dst = rows_of(ws.full, pr, ch.c);
    ops::qkv_slots_scatter(dst, packed_rows(rows_of(ws.rows, rr, ch.c), dims), rows_dims(dims, ch.c), dims.R, 2, ctx);
  });
}

// dst [B * c, cols] <- the rows of local chunk k of src [B * S_local, cols] (or back with to_local).
void chunk_rows(const Tensor& chunk, const Tensor& local, const Chunks& ch, int k, bool to_local) {
  for (int64_t b = 0; b < ch.B; ++b) {
    Tensor a = rows_of(chunk, b * ch.c, ch.c), l = rows_of(local, b * ch.Sl + k * ch.c, ch.c);
    if (to_local)
      l.copy_from(a);
    else
      a.copy_from(l);
  }
}

Tensor lse_of(const Tensor& lse, const Chunks& ch, int64_t heads, int k) {
  const int64_t n = ch.B * heads * ch.c;
  return lse.view({2 * n}).slice(0, k * n, (k + 1) * n).view({ch.B, heads, ch.c});
}

}  // namespace

void context_parallel_to_positions(const Tensor& out, const Tensor& gathered, int64_t B, int64_t S, int size) {
  if (!(out.shape() == gathered.shape()) || out.dim() != 2 || out.size(0) != B * S || !out.is_contiguous() ||
      !gathered.is_contiguous())
    MOECORE_FAIL("context_parallel_to_positions: out ", out.str(), " and gathered ", gathered.str(),
                 " must both be contiguous [B*S, cols] with B*S = ", B * S);
  const Chunks ch(B, S / size, 0, size);
  ch.for_each_block([&](int64_t rr, int64_t pr) { rows_of(out, pr, ch.c).copy_from(rows_of(gathered, rr, ch.c)); });
}

void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const ops::QkvDims& dims, const ops::Dropout& drop,
                       const ops::AttentionOptions& opt, const ProcessGroup* cp, ContextParallelWorkspace& ws,
                       const ops::Context& ctx) {
  if (!cp || cp->size() == 1) return ops::attention_forward(out, lse, qkv, dims, drop, opt, ctx);
  const Chunks ch(dims, *cp);
  const int64_t W = dims.width(), O = dims.q_heads() * dims.D;
  const Tensor qkv_rows = qkv.view({ch.B * ch.Sl, W}), out_rows = out.view({ch.B * ch.Sl, O});
  gather_positions(qkv_rows, dims, ch, ws, *cp, ctx);
  const Tensor full = ws.full.view({ch.B, ch.S, W});
  for (int k = 0; k < 2; ++k) {
    const ops::QkvDims d = ch.dims(dims, k);
    chunk_rows(ws.q, qkv_rows, ch, k, false);
    Tensor o = ws.out.view({ch.B, ch.c, O}), l = lse_of(lse, ch, dims.q_heads(), k);
    ops::attention_forward(o, l, ws.q.view({ch.B, ch.c, W}), full.slice(1, 0, d.Sk), d, chunk_dropout(drop, k), opt,
                           ctx);
    chunk_rows(ws.out, out_rows, ch, k, true);
  }
}

void attention_backward(Tensor& dqkv, Tensor* dsinks, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const ops::QkvDims& dims, const ops::Dropout& drop,
                        const ops::AttentionOptions& opt, const ProcessGroup* cp, ContextParallelWorkspace& ws,
                        const ops::Context& ctx) {
  if (!cp || cp->size() == 1) return ops::attention_backward(dqkv, dsinks, dout, qkv, out, lse, dims, drop, opt, ctx);
  const Chunks ch(dims, *cp);
  const int64_t W = dims.width(), O = dims.q_heads() * dims.D, T = ch.B * ch.Sl;
  const Tensor qkv_rows = qkv.view({T, W});
  gather_positions(qkv_rows, dims, ch, ws, *cp, ctx);  // again: the keys and values are not kept between the passes
  const Tensor full = ws.full.view({ch.B, ch.S, W});
  ws.acc.zero_();
  for (int k = 0; k < 2; ++k) {
    const ops::QkvDims d = ch.dims(dims, k);
    chunk_rows(ws.q, qkv_rows, ch, k, false);
    chunk_rows(ws.out, out.view({T, O}), ch, k, false);
    chunk_rows(ws.dout, dout.view({T, O}), ch, k, false);
    Tensor dq = rows_of(ws.dq, k * ch.B * ch.c, ch.B * ch.c).view({ch.B, ch.c, W});
    Tensor dkv = ws.dkv.view({ch.B, ch.S, W}).slice(1, 0, d.Sk);
    ops::attention_backward(dq, dkv, dsinks, ws.dout.view({ch.B, ch.c, O}), ws.q.view({ch.B, ch.c, W}),
                            full.slice(1, 0, d.Sk), ws.out.view({ch.B, ch.c, O}), lse_of(lse, ch, dims.q_heads(), k), d,
                            chunk_dropout(drop, k), opt, ctx);
    // The blocks of keys this chunk saw (positions below d.Sk, whole blocks: d.Sk is a multiple of c), packed to f32
    // and added into their owners' rows.
    ch.for_each_block([&](int64_t rr, int64_t pr) {
      if (pr % ch.S >= d.Sk) return;
      Tensor blk = packed_rows(ws.block, dims);
      ops::qkv_slots_gather(blk, rows_of(ws.dkv, pr, ch.c), rows_dims(dims, ch.c), dims.R, 2, ctx);
      Tensor a = rows_of(ws.acc, rr, ch.c);
      ops::add(a, a, ws.block, ctx);
    });
  }
  // Every rank's dK/dV of the rows this rank owns, summed in rank order; its chunks' query gradients, then the keys'
  // and values' into their slots (the kernel wrote the query slots of ws.dq only).
  reduce_scatter_sum(ws.local, ws.acc, *cp);
  Tensor dqkv_rows = dqkv.view({T, W});
  for (int k = 0; k < 2; ++k)
    for (int64_t b = 0; b < ch.B; ++b)
      rows_of(dqkv_rows, b * ch.Sl + k * ch.c, ch.c).copy_from(rows_of(ws.dq, (k * ch.B + b) * ch.c, ch.c));
  ops::qkv_slots_scatter(dqkv_rows, packed_rows(ws.local, dims), rows_dims(dims, T), dims.R, 2, ctx);
}

}  // namespace moecore::nn
