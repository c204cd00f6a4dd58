// Context-parallel attention: all-gather of the q/k/v rows, two chunk calls of the attention op, reduce-scatter of
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
  const int64_t O = local.q_heads() * local.D;
  p.empty(w.rows, {Tall, W}, compute);
  p.empty(w.full, {Tall, W}, compute);
  p.empty(w.acc, {Tall, W}, DType::f32);
  p.empty(w.local, {T, W}, DType::f32);
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
  Chunks(const ops::QkvDims& d, const ProcessGroup& g)
      : P(g.size()), r(g.rank()), B(d.B), Sl(d.S), c(d.S / 2), S(d.S * g.size()) {}
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

// The group's rows of qkv [T, W] gathered into ws.full in position order (ws.rows: rank order).
void gather_positions(const Tensor& qkv_rows, const Chunks& ch, ContextParallelWorkspace& ws, const ProcessGroup& g) {
  all_gather(ws.rows, qkv_rows, g);
  ch.for_each_block([&](int64_t rr, int64_t pr) { rows_of(ws.full, pr, ch.c).copy_from(rows_of(ws.rows, rr, ch.c)); });
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

void attention_forward(Tensor& out, Tensor& lse, const Tensor& qkv, const ops::QkvDims& dims, const ops::Dropout& drop,
                       const ProcessGroup* cp, ContextParallelWorkspace& ws, const ops::Context& ctx) {
  if (!cp || cp->size() == 1) return ops::attention_forward(out, lse, qkv, dims, drop, ctx);
  const Chunks ch(dims, *cp);
  const int64_t W = dims.width(), O = dims.q_heads() * dims.D;
  const Tensor qkv_rows = qkv.view({ch.B * ch.Sl, W}), out_rows = out.view({ch.B * ch.Sl, O});
  gather_positions(qkv_rows, ch, ws, *cp);
  const Tensor full = ws.full.view({ch.B, ch.S, W});
  for (int k = 0; k < 2; ++k) {
    const ops::QkvDims d = ch.dims(dims, k);
    chunk_rows(ws.q, qkv_rows, ch, k, false);
    Tensor o = ws.out.view({ch.B, ch.c, O}), l = lse_of(lse, ch, dims.q_heads(), k);
    ops::attention_forward(o, l, ws.q.view({ch.B, ch.c, W}), full.slice(1, 0, d.Sk), d, chunk_dropout(drop, k), ctx);
    chunk_rows(ws.out, out_rows, ch, k, true);
  }
}

void attention_backward(Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const ops::QkvDims& dims, const ops::Dropout& drop, const ProcessGroup* cp,
                        ContextParallelWorkspace& ws, const ops::Context& ctx) {
  if (!cp || cp->size() == 1) return ops::attention_backward(dqkv, dout, qkv, out, lse, dims, drop, ctx);
  const Chunks ch(dims, *cp);
  const int64_t W = dims.width(), O = dims.q_heads() * dims.D, T = ch.B * ch.Sl;
  const Tensor qkv_rows = qkv.view({T, W});
  gather_positions(qkv_rows, ch, ws, *cp);  // again: the keys and values are not kept between the passes
  const Tensor full = ws.full.view({ch.B, ch.S, W});
  ws.acc.zero_();
  ws.dq.zero_();  // the kernel writes the query slots only; the rest must add nothing below
  for (int k = 0; k < 2; ++k) {
    const ops::QkvDims d = ch.dims(dims, k);
    chunk_rows(ws.q, qkv_rows, ch, k, false);
    chunk_rows(ws.out, out.view({T, O}), ch, k, false);
    chunk_rows(ws.dout, dout.view({T, O}), ch, k, false);
    ws.rows.zero_();  // this chunk's dK/dV, position order; keys past the chunk's end get none
    Tensor dq = rows_of(ws.dq, k * ch.B * ch.c, ch.B * ch.c).view({ch.B, ch.c, W});
    Tensor dkv = ws.rows.view({ch.B, ch.S, W}).slice(1, 0, d.Sk);
    ops::attention_backward(dq, dkv, ws.dout.view({ch.B, ch.c, O}), ws.q.view({ch.B, ch.c, W}), full.slice(1, 0, d.Sk),
                            ws.out.view({ch.B, ch.c, O}), lse_of(lse, ch, dims.q_heads(), k), d, chunk_dropout(drop, k),
                            ctx);
    ch.for_each_block([&](int64_t rr, int64_t pr) {
      Tensor a = rows_of(ws.acc, rr, ch.c);
      ops::add(a, a, rows_of(ws.rows, pr, ch.c), ctx);
    });
  }
  // Every rank's dK/dV of the rows rank r owns, summed in rank order; then the query gradients of its chunks.
  reduce_scatter_sum(ws.local, ws.acc, *cp);
  const Tensor dqkv_rows = dqkv.view({T, W});
  for (int k = 0; k < 2; ++k)
    for (int64_t b = 0; b < ch.B; ++b) {
      const int64_t at = b * ch.Sl + k * ch.c;
      Tensor dst = rows_of(dqkv_rows, at, ch.c);
      ops::add(dst, rows_of(ws.local, at, ch.c), rows_of(ws.dq, (k * ch.B + b) * ch.c, ch.c), ctx);
    }
}

}  // namespace moecore::nn
