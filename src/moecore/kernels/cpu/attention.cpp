// CPU causal attention on Megatron's interleaved qkv (ops.h): a flash-attention forward (Dao 2022) with an
// online softmax over 64 x 64 blocks, and a backward that recomputes P block by block from the saved lse.
// Queries and keys/values come from two tensors; the S queries are the last S of the Sk key positions (Sk = S:
// self-attention), so key blocks start at key 0 and query row i sits at position off + i, off = Sk - S.
// Dropout on P regenerates its mask per block from (key, element index) (dropout_mask.h); p = 0 runs none
// of that code. Results are deterministic: every sum runs in an order fixed by the shapes, never by
// threads or timing. On a cuda context both ops dispatch to kernels/cuda/attention.cu after the checks.
// A sliding window (AttentionOptions::window) skips key blocks outside every row's window and masks the rest
// (common/attention_window.h); a sink starts each row's running max and sum at (s_h, 1).
// Not here: rotary embeddings (rope.cpp), non-causal or padding masks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moecore/kernels/attention_scratch.h"
#include "moecore/kernels/common/attention_window.h"
#include "moecore/kernels/cpu/attention_blocks.h"
#include "moecore/kernels/cpu/cpu_util.h"
#include "moecore/kernels/cpu/dropout_mask.h"
#include "moecore/kernels/ops.h"

namespace moecore::ops {
namespace {

// Out of line: inlined into the backward's large task loop, GCC inlines the micro-tiles too and runs them ~5% slower.
template <bool TA>
[[gnu::noinline]] void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                                  int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  cpu::attn::block_gemm<TA>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}
using cpu::attn::kBk;
using cpu::attn::kBq;
using cpu::attn::kNR;
using cpu::attn::round_up;

// Sizes shared by the forward and backward passes. Packed tiles are f32 with the head dim padded to Dp
// and keys padded to Skp, both with zeros, so block GEMMs see only whole micro-tiles.
struct Layout {
  int64_t B, S, Sk, off, G, R, D, H, W;  // S queries at key positions off..Sk-1; H query heads, W = qkv row width
  int64_t kv_bs, dkv_bs;                 // batch strides of kv and dkv (their rows are W apart)
  int64_t Dp, Skp, nqb, nkb;             // padded head dim, padded key count, query and key block counts
  float scale;                           // 1 / sqrt(D)
  int64_t window = -1;                   // AttentionOptions::window
  bool has_sink = false;                 // off-by-one or learnable sinks
  const float* sinks = nullptr;          // [H] learnable sink logits, or null (off-by-one: 0)
  Layout(const QkvDims& d, int64_t kv_batch_stride, int64_t dkv_batch_stride = 0)
      : B(d.B),
        S(d.S),
        Sk(d.keys()),
        off(d.keys() - d.S),
        G(d.G),
        R(d.R),
        D(d.D),
        H(d.q_heads()),
        W(d.width()),
        kv_bs(kv_batch_stride),
        dkv_bs(dkv_batch_stride),
        Dp(round_up(d.D, kNR)),
        Skp(round_up(d.keys(), kBk)),
        nqb((d.S + kBq - 1) / kBq),
        nkb((d.keys() + kBk - 1) / kBk),
        scale(1.0f / std::sqrt(static_cast<float>(d.D))) {}
  void set_options(const AttentionOptions& opt) {
    window = opt.window;
    has_sink = opt.has_sink();
    sinks = opt.sinks ? opt.sinks->data<float>() : nullptr;
  }
  float sink(int64_t h) const { return sinks ? sinks[h] : 0.0f; }
  // One past the last query row that sees some key of k0 .. k0 + kn - 1.
  int64_t rows_end(int64_t k0, int64_t kn) const {
    return std::min(S, attn_window::end_position(k0 + kn - 1, window, Sk) - off);
  }
  int64_t q_col(int64_t h) const { return ((h / R) * (R + 2) + h % R) * D; }
  int64_t k_col(int64_t g) const { return (g * (R + 2) + R) * D; }
  int64_t v_col(int64_t g) const { return k_col(g) + D; }
  // Dropout index of (batch b, query head h, query position p = off + row, key k): ((b*H + h)*Sk + p)*Sk + k.
  uint64_t mask_index(int64_t b, int64_t h, int64_t p, int64_t k) const {
    return static_cast<uint64_t>(((b * H + h) * Sk + p) * Sk + k);
  }
  // The first row of the first query block that sees key k: the block holding the query at position k (block 0
  // when k <= off).
  int64_t first_row(int64_t k) const { return std::max<int64_t>(0, k - off) / kBq * kBq; }
};

// Keep factors of the visible keys k0 .. min(k0 + kn, p + 1) - 1 of the query at position p into f[0..kBk); 0
// elsewhere, so that a factor is always finite where P is 0.
void dropout_row(float* f, const cpu::DropoutMask& mask, const Layout& L, int64_t b, int64_t h, int64_t p, int64_t k0,
                 int64_t kn) {
  const int64_t nvis = std::clamp<int64_t>(p - k0 + 1, 0, kn);
  mask.factors(f, L.mask_index(b, h, p, k0), nvis);
  std::fill(f + nvis, f + kBk, 0.0f);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class T>
void load_row(float* dst, const T* src, int64_t D, int64_t Dp, float factor) {
  for (int64_t d = 0; d < D; ++d) dst[d] = cpu::ld(src[d]) * factor;
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.0f;
}

template <class T>
void store_row(T* dst, const float* src, int64_t D, float factor) {
  for (int64_t d = 0; d < D; ++d) cpu::st(dst[d], src[d] * factor);
}

// Columns k0 + j > p0 + r of a score block are in the future of its row r, the query at position p0 + r.
void mask_future(float* s, int64_t rows, int64_t p0, int64_t k0) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = std::max<int64_t>(0, p0 + r - k0 + 1); j < kBk; ++j) s[r * kBk + j] = kNegInf;
  }
}

// Columns k0 + j < p0 + r - window of a score block are before the window of its row r.
void mask_past(float* s, int64_t rows, int64_t p0, int64_t k0, int64_t window) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t end = std::min<int64_t>(kBk, p0 + r - window - k0);
    for (int64_t j = 0; j < end; ++j) s[r * kBk + j] = kNegInf;
  }
}

// Turns a score block into P in place and rescales the running output rows; m, l are the running row max
// and row sum of exp(score - m) (online softmax). A row whose keys so far are all outside its window keeps m = -inf
// (exponents taken against 0), so its first visible block starts it afresh.
void online_softmax(float* s, float* o, float* m, float* l, int64_t rows, int64_t Dp) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * kBk;
    const float m_max = std::max(m[r], cpu::attn::row_max(sr, kBk));
    const float m_new = m_max == kNegInf ? 0.0f : m_max;
    const float alpha = cpu::exp_f32(m[r] - m_new);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < kBk; ++j) {
      const float p = cpu::exp_f32(sr[j] - m_new);
      sr[j] = p;
      sum += p;
    }
    l[r] = l[r] * alpha + sum;
    m[r] = m_max;
    if (alpha != 1.0f) {
      float* orow = o + r * Dp;
#pragma omp simd
      for (int64_t d = 0; d < Dp; ++d) orow[d] *= alpha;
    }
  }
}

// Packs one (batch, key block) for every kv head: K^T as one contiguous [Dp, kBk] tile per key block (a
// plain [Dp, Skp] K^T has a 4 KiB row stride at Sk = 1024, which maps a block's rows onto a few L1 sets) and
// V rows [kBk, Dp]. Rows outermost so kv is read front to back.
template <class T>
void pack_kv_block(float* kt_all, float* v_all, const T* kv, const Layout& L, int64_t b, int64_t kb) {
  const int64_t k0 = kb * kBk, kn = std::min(kBk, L.Sk - k0), head_elems = L.Dp * L.Skp;
  float* kt0 = kt_all + b * L.G * head_elems + kb * L.Dp * kBk;
  float* v0 = v_all + b * L.G * head_elems + k0 * L.Dp;
  if (kn < kBk || L.D < L.Dp) {
    for (int64_t g = 0; g < L.G; ++g) {
      std::fill(kt0 + g * head_elems, kt0 + g * head_elems + L.Dp * kBk, 0.0f);
      std::fill(v0 + g * head_elems + kn * L.Dp, v0 + g * head_elems + kBk * L.Dp, 0.0f);
    }
  }
  for (int64_t j = 0; j < kn; ++j) {
    const T* row = kv + b * L.kv_bs + (k0 + j) * L.W;
    for (int64_t g = 0; g < L.G; ++g) {
      load_row(v0 + g * head_elems + j * L.Dp, row + L.v_col(g), L.D, L.Dp, 1.0f);
      float* kt = kt0 + g * head_elems + j;
      for (int64_t d = 0; d < L.D; ++d) kt[d * kBk] = cpu::ld(row[L.k_col(g) + d]);
    }
  }
}

// One (batch, query head, query block) of the forward: scan key blocks up to the diagonal. Rows are independent:
// a key block wholly in a row's future adds exact zeros, so each row's bits do not depend on the blocking.
template <class T>
void forward_block(T* out, float* lse, const T* qs, const float* kt, const float* v, float* buf, const Layout& L,
                   const cpu::DropoutMask* mask, int64_t b, int64_t h, int64_t i) {
  // p0: the key position of row q0.
  const int64_t q0 = i * kBq, qn = std::min(kBq, L.S - q0), p0 = q0 + L.off;
  float* q = buf;             // [qn, Dp], pre-scaled by 1/sqrt(D)
  float* s = q + kBq * L.Dp;  // [qn, kBk] scores, then P
  float* o = s + kBq * kBk;   // [qn, Dp] unnormalised output
  float* m = o + kBq * L.Dp;
  float* l = m + kBq;
  for (int64_t r = 0; r < qn; ++r) {
    load_row(q + r * L.Dp, qs + (b * L.S + q0 + r) * L.W + L.q_col(h), L.D, L.Dp, L.scale);
    std::fill(o + r * L.Dp, o + (r + 1) * L.Dp, 0.0f);
    m[r] = L.has_sink ? L.sink(h) : kNegInf;  // the sink as a first column of the row, exp(s_h - m) = 1
    l[r] = L.has_sink ? 1.0f : 0.0f;
  }
  for (int64_t k0 = attn_window::first_key(p0, L.window) / kBk * kBk; k0 < p0 + qn; k0 += kBk) {
    block_gemm<false>(qn, kBk, L.Dp, q, L.Dp, kt + k0 * L.Dp, kBk, s, kBk, false);
    if (k0 + kBk - 1 > p0) mask_future(s, qn, p0, k0);
    if (attn_window::clips(p0 + qn - 1, k0, L.window)) mask_past(s, qn, p0, k0, L.window);
    online_softmax(s, o, m, l, qn, L.Dp);
    if (mask) {  // l keeps the undropped sum: only what flows into the output is dropped
      alignas(64) float f[kBk];
      for (int64_t r = 0; r < qn; ++r) {
        dropout_row(f, *mask, L, b, h, p0 + r, k0, std::min(kBk, L.Sk - k0));
#pragma omp simd
        for (int64_t j = 0; j < kBk; ++j) s[r * kBk + j] *= f[j];
      }
    }
    block_gemm<false>(qn, L.Dp, std::min(kBk, L.Sk - k0), s, kBk, v + k0 * L.Dp, L.Dp, o, L.Dp, true);
  }
  for (int64_t r = 0; r < qn; ++r) {
    store_row(out + (b * L.S + q0 + r) * L.H * L.D + h * L.D, o + r * L.Dp, L.D, 1.0f / l[r]);
    lse[(b * L.H + h) * L.S + q0 + r] = m[r] + std::log(l[r]);
  }
}

template <class T>
void forward_impl(T* out, float* lse, const T* q, const T* kv, const Layout& L, const cpu::DropoutMask* mask) {
  const int64_t BG = L.B * L.G, head_elems = L.Dp * L.Skp;
  float* kt_all = cpu::scratch<float, 0>(static_cast<size_t>(2 * BG * head_elems));
  float* v_all = kt_all + BG * head_elems;
#pragma omp parallel for schedule(static)
  for (int64_t bk = 0; bk < L.B * L.nkb; ++bk) pack_kv_block(kt_all, v_all, kv, L, bk / L.nkb, bk % L.nkb);
  const int64_t BH = L.B * L.H, ntasks = BH * L.nqb;
#pragma omp parallel
  {
    float* buf = cpu::scratch<float, 1>(static_cast<size_t>(2 * kBq * L.Dp + kBq * kBk + 2 * kBq));
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < ntasks; ++t) {
      // Last query blocks first: under causality they scan the most keys, so the tail of the schedule
      // is made of short tasks.
      const int64_t i = L.nqb - 1 - t / BH, bh = t % BH, b = bh / L.H, h = bh % L.H;
      const int64_t bg = b * L.G + h / L.R;
      forward_block(out, lse, q, kt_all + bg * head_elems, v_all + bg * head_elems, buf, L, mask, b, h, i);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------------
// A task owns one (batch, kv head, chunk of key blocks): it alone writes that chunk's dK and dV, summing
// over the R query heads of its group in a fixed order. dQ sums over key blocks: each chunk accumulates
// its share in key order into its own buffer, and the buffers are added in chunk order afterwards. The
// chunking depends on the shapes only, so results do not depend on the number of threads.
constexpr int64_t kTargetTasks = 8;

struct Chunks {
  std::vector<int64_t> bounds;      // key-block boundaries, count() + 1 entries
  std::vector<int64_t> q0;          // first query row a chunk's keys are visible to (block aligned)
  std::vector<int64_t> row_offset;  // start of chunk c's rows q0[c]..S-1 in a head's dQ buffer; back() = total
  std::vector<int64_t> order;       // chunks by decreasing work, scheduled first so the tail is short
  int64_t count() const { return static_cast<int64_t>(bounds.size()) - 1; }
};

// Cuts key blocks into chunks of about equal causal work (key block j is seen by the query blocks from
// first_row(j*kBk) on), rounding each cut to the nearer block boundary.
Chunks key_chunks(const Layout& L) {
  const int64_t want = std::clamp<int64_t>((kTargetTasks + L.B * L.G - 1) / (L.B * L.G), 1, L.nkb);
  std::vector<int64_t> cum(L.nkb + 1, 0);
  for (int64_t j = 0; j < L.nkb; ++j) cum[j + 1] = cum[j] + L.nqb - L.first_row(j * kBk) / kBq;
  Chunks ch;
  ch.bounds = {0};
  for (int64_t c = 1; c < want; ++c) {
    const double target = static_cast<double>(c) * static_cast<double>(cum.back()) / static_cast<double>(want);
    int64_t x = std::lower_bound(cum.begin(), cum.end(), target) - cum.begin();
    if (x > 0 && target - cum[x - 1] < cum[x] - target) --x;
    if (x > ch.bounds.back() && x < L.nkb) ch.bounds.push_back(x);
  }
  ch.bounds.push_back(L.nkb);
  ch.row_offset = {0};
  for (int64_t c = 0; c < ch.count(); ++c) {
    ch.q0.push_back(L.first_row(ch.bounds[c] * kBk));
    ch.row_offset.push_back(ch.row_offset.back() + L.S - ch.q0.back());
    ch.order.push_back(c);
  }
  std::stable_sort(ch.order.begin(), ch.order.end(), [&](int64_t a, int64_t b) {
    return cum[ch.bounds[a + 1]] - cum[ch.bounds[a]] > cum[ch.bounds[b + 1]] - cum[ch.bounds[b]];
  });
  return ch;
}

// f32 copies shared by all tasks: query and dout rows per head, delta = rowsum(dO * O) (Dao 2022's D_i),
// and every chunk's dQ accumulator. About (2 + rows / S) times the f32 size of dQ; rows = S unless
// B * G < kTargetTasks, and at most ~5.6 S (8 chunks). Kept by cpu::scratch for the next step.
struct BwdPacked {
  float *q, *dout;  // [B*H, S, Dp]
  float* delta;     // [B*H, S]
  float* dq;        // [B*H, rows, Dp], rows = Chunks::row_offset.back()
  int64_t rows;
  static size_t floats(const Layout& L, int64_t rows) {
    return static_cast<size_t>(L.B * L.H * (2 * L.S * L.Dp + L.S + rows * L.Dp));
  }
  BwdPacked(float* f, const Layout& L, int64_t dq_rows) : rows(dq_rows) {
    const int64_t n = L.B * L.H * L.S * L.Dp;
    q = f, dout = q + n, delta = dout + n, dq = delta + L.B * L.H * L.S;
  }
};

// Per-thread tiles of one key block: K [kBk, Dp], scale * K^T and V^T [Dp, kBk], dK and dV [kBk, Dp],
// P, dS and the dropout factors [kBq, kBk].
struct BwdTile {
  float *k, *kt, *vt, *dk, *dv, *p, *ds, *f;
  static size_t floats(const Layout& L) { return static_cast<size_t>(5 * kBk * L.Dp + 3 * kBq * kBk); }
  BwdTile(float* buf, const Layout& L) {
    k = buf, kt = k + kBk * L.Dp, vt = kt + kBk * L.Dp, dk = vt + kBk * L.Dp, dv = dk + kBk * L.Dp;
    p = dv + kBk * L.Dp, ds = p + kBq * kBk, f = ds + kBq * kBk;
  }
};

// Rows of one head lie a whole qkv row apart (kilobytes) and hardware prefetchers stop at page
// boundaries, so the key-block packing asks for rows a few iterations ahead itself.
constexpr int64_t kPrefetchRows = 8;

template <class T>
void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i);
}

// Rows s0..s1 of batch b, all heads; rows outermost so q, dout and out are read front to back.
template <class T>
void pack_query_rows(const BwdPacked& pk, const T* q, const T* dout, const T* out, const Layout& L, int64_t b,
                     int64_t s0, int64_t s1) {
  const int64_t HD = L.H * L.D;
  for (int64_t s = s0; s < s1; ++s) {
    const T* go = dout + (b * L.S + s) * HD;
    const T* o = out + (b * L.S + s) * HD;
    for (int64_t h = 0; h < L.H; ++h) {
      const int64_t row = (b * L.H + h) * L.S + s;
      load_row(pk.q + row * L.Dp, q + (b * L.S + s) * L.W + L.q_col(h), L.D, L.Dp, 1.0f);
      load_row(pk.dout + row * L.Dp, go + h * L.D, L.D, L.Dp, 1.0f);
      float delta = 0.0f;
      for (int64_t d = 0; d < L.D; ++d) delta += cpu::ld(go[h * L.D + d]) * cpu::ld(o[h * L.D + d]);
      pk.delta[row] = delta;
    }
  }
}

// K, scale * K^T and V^T of key rows k0..k0+kn of kv head g, zero padded.
template <class T>
void pack_key_block(BwdTile& t, const T* kv, const Layout& L, int64_t b, int64_t g, int64_t k0, int64_t kn) {
  std::fill(t.k, t.k + kBk * L.Dp, 0.0f);
  std::fill(t.kt, t.kt + 2 * kBk * L.Dp, 0.0f);  // kt and vt are adjacent
  for (int64_t j = 0; j < kn; ++j) {
    const T* row = kv + b * L.kv_bs + (k0 + j) * L.W;
    if (j + kPrefetchRows < kn) prefetch(row + kPrefetchRows * L.W + L.k_col(g), 2 * L.D);
    load_row(t.k + j * L.Dp, row + L.k_col(g), L.D, L.Dp, 1.0f);
    for (int64_t d = 0; d < L.D; ++d) {
      t.kt[d * kBk + j] = t.k[j * L.Dp + d] * L.scale;
      t.vt[d * kBk + j] = cpu::ld(row[L.v_col(g) + d]);
    }
  }
}

// P and dS = P * (dP - delta) * scale of one (query block, key block) pair, from scores in t.p and dP in
// t.ds; p0 is the position of the block's first query. Future keys get P = 0, which also covers the
// zero-padded keys past Sk.
void softmax_grad_block(BwdTile& t, int64_t qn, int64_t p0, int64_t k0, const float* lse, const float* delta,
                        float scale, int64_t window) {
  for (int64_t r = 0; r < qn; ++r) {
    float* pr = t.p + r * kBk;
    float* dsr = t.ds + r * kBk;
    const float lr = lse[r], dr = delta[r];
    const int64_t q = p0 + r, lo = window < 0 ? std::numeric_limits<int64_t>::min() : q - window;
#pragma omp simd
    for (int64_t j = 0; j < kBk; ++j) {
      const float p = cpu::select_f32(k0 + j > q || k0 + j < lo, 0.0f, cpu::exp_f32(pr[j] - lr));
      pr[j] = p;
      dsr[j] = p * (dsr[j] - dr) * scale;
    }
  }
}

// The same with dropout factors f in t.f: P becomes Pd = P * f (what dV needs) and
// dS = P * (dP * f - delta) * scale.
void softmax_grad_block_dropout(BwdTile& t, int64_t qn, int64_t p0, int64_t k0, const float* lse, const float* delta,
                                float scale, int64_t window) {
  for (int64_t r = 0; r < qn; ++r) {
    float* pr = t.p + r * kBk;
    float* dsr = t.ds + r * kBk;
    const float* fr = t.f + r * kBk;
    const float lr = lse[r], dr = delta[r];
    const int64_t q = p0 + r, lo = window < 0 ? std::numeric_limits<int64_t>::min() : q - window;
#pragma omp simd
    for (int64_t j = 0; j < kBk; ++j) {
      const float p = cpu::select_f32(k0 + j > q || k0 + j < lo, 0.0f, cpu::exp_f32(pr[j] - lr));
      pr[j] = p * fr[j];
      dsr[j] = p * (dsr[j] * fr[j] - dr) * scale;
    }
  }
}

template <class T>
void backward_task(T* dq, T* dkv, const T* kv, const float* lse, const BwdPacked& pk, const Layout& L, const Chunks& ch,
                   const cpu::DropoutMask* mask, BwdTile& t, int64_t b, int64_t g, int64_t c) {
  const int64_t k_begin = ch.bounds[c] * kBk, k_end = std::min(ch.bounds[c + 1] * kBk, L.Sk), q0 = ch.q0[c];
  if (L.window >= 0)
    for (int64_t h = g * L.R; h < (g + 1) * L.R; ++h) {
      float* rows = pk.dq + ((b * L.H + h) * pk.rows + ch.row_offset[c]) * L.Dp;
      std::fill(rows, rows + (L.S - q0) * L.Dp, 0.0f);
    }
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kBk) {
    const int64_t kn = std::min(kBk, L.Sk - k0);
    pack_key_block(t, kv, L, b, g, k0, kn);
    std::fill(t.dk, t.dk + 2 * kBk * L.Dp, 0.0f);  // dk and dv are adjacent
    for (int64_t h = g * L.R; h < (g + 1) * L.R; ++h) {
      const int64_t bh = b * L.H + h;
      for (int64_t i0 = L.first_row(k0), i_end = L.rows_end(k0, kn); i0 < i_end; i0 += kBq) {
        const int64_t qn = std::min(kBq, L.S - i0), row = bh * L.S + i0;
        const float* qi = pk.q + row * L.Dp;
        const float* doi = pk.dout + row * L.Dp;
        float* dqi = pk.dq + (bh * pk.rows + ch.row_offset[c] + i0 - q0) * L.Dp;
        block_gemm<false>(qn, kBk, L.Dp, qi, L.Dp, t.kt, kBk, t.p, kBk, false);    // S = Q K^T * scale
        block_gemm<false>(qn, kBk, L.Dp, doi, L.Dp, t.vt, kBk, t.ds, kBk, false);  // dP = dO V^T
        if (mask) {
          for (int64_t r = 0; r < qn; ++r) dropout_row(t.f + r * kBk, *mask, L, b, h, L.off + i0 + r, k0, kn);
          softmax_grad_block_dropout(t, qn, L.off + i0, k0, lse + row, pk.delta + row, L.scale, L.window);
        } else {
          softmax_grad_block(t, qn, L.off + i0, k0, lse + row, pk.delta + row, L.scale, L.window);
        }
        block_gemm<true>(kn, L.Dp, qn, t.p, kBk, doi, L.Dp, t.dv, L.Dp, true);  // dV += Pd^T dO
        block_gemm<true>(kn, L.Dp, qn, t.ds, kBk, qi, L.Dp, t.dk, L.Dp, true);  // dK += dS^T Q
        // dQ += dS K; without a window the chunk's first key block reaches all of its query rows and initialises
        // them (with one, the rows were zeroed above).
        block_gemm<false>(qn, L.Dp, kn, t.ds, kBk, t.k, L.Dp, dqi, L.Dp, L.window >= 0 || k0 != k_begin);
      }
    }
    for (int64_t j = 0; j < kn; ++j) {
      T* row = dkv + b * L.dkv_bs + (k0 + j) * L.W;
      store_row(row + L.k_col(g), t.dk + j * L.Dp, L.D, 1.0f);
      store_row(row + L.v_col(g), t.dv + j * L.Dp, L.D, 1.0f);
    }
  }
  if (ch.count() > 1) return;
  for (int64_t h = g * L.R; h < (g + 1) * L.R; ++h)
    for (int64_t s = 0; s < L.S; ++s)
      store_row(dq + (b * L.S + s) * L.W + L.q_col(h), pk.dq + ((b * L.H + h) * pk.rows + s) * L.Dp, L.D, 1.0f);
}

// dQ = sum of the chunks' buffers in chunk order; chunk c holds rows q0[c]..S-1.
template <class T>
void reduce_dq(T* dq, const BwdPacked& pk, const Layout& L, const Chunks& ch) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bh = 0; bh < L.B * L.H; ++bh) {
    for (int64_t s = 0; s < L.S; ++s) {
      float acc[512];
      for (int64_t d0 = 0; d0 < L.D; d0 += 512) {
        const int64_t dn = std::min<int64_t>(512, L.D - d0);
        std::fill(acc, acc + dn, 0.0f);
        for (int64_t c = 0; c < ch.count() && ch.q0[c] <= s; ++c) {
          const float* src = pk.dq + (bh * pk.rows + ch.row_offset[c] + s - ch.q0[c]) * L.Dp + d0;
          for (int64_t d = 0; d < dn; ++d) acc[d] += src[d];
        }
        const int64_t b = bh / L.H, h = bh % L.H;
        store_row(dq + (b * L.S + s) * L.W + L.q_col(h) + d0, acc, dn, 1.0f);
      }
    }
  }
}

// dsinks[h] -= sum over (b, i) of exp(s_h - lse) * delta, in (b, i) order per head.
void sink_grads(float* dsinks, const float* lse, const BwdPacked& pk, const Layout& L) {
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < L.H; ++h) {
    float acc = 0.0f;
    for (int64_t b = 0; b < L.B; ++b) {
      const int64_t row0 = (b * L.H + h) * L.S;
      for (int64_t i = 0; i < L.S; ++i) acc += std::exp(L.sink(h) - lse[row0 + i]) * pk.delta[row0 + i];
    }
    dsinks[h] -= acc;
  }
}

template <class T>
void backward_impl(T* dq, T* dkv, float* dsinks, const T* dout, const T* q, const T* kv, const T* out, const float* lse,
                   const Layout& L, const cpu::DropoutMask* mask) {
  const Chunks ch = key_chunks(L);
  const BwdPacked pk(cpu::scratch<float, 0>(BwdPacked::floats(L, ch.row_offset.back())), L, ch.row_offset.back());
  const int64_t BG = L.B * L.G, ntasks = BG * ch.count(), nrb = (L.S + kBq - 1) / kBq;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t bs = 0; bs < L.B * nrb; ++bs) {
      const int64_t b = bs / nrb, s0 = bs % nrb * kBq;
      pack_query_rows(pk, q, dout, out, L, b, s0, std::min(s0 + kBq, L.S));
    }
    BwdTile tile(cpu::scratch<float, 1>(BwdTile::floats(L)), L);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < ntasks; ++task) {
      const int64_t c = ch.order[task / BG], bg = task % BG;
      backward_task(dq, dkv, kv, lse, pk, L, ch, mask, tile, bg / L.G, bg % L.G, c);
    }
  }
  if (ch.count() > 1) reduce_dq(dq, pk, L, ch);
  if (dsinks) sink_grads(dsinks, lse, pk, L);
}

std::string dims_text(const QkvDims& d) {
  return "B=" + std::to_string(d.B) + " S=" + std::to_string(d.S) + " Sk=" + std::to_string(d.Sk) +
         " G=" + std::to_string(d.G) + " R=" + std::to_string(d.R) + " D=" + std::to_string(d.D);
}

void check_dims(const cpu::Checker& ck, const QkvDims& d) {
  if (d.B < 0 || d.S < 0 || d.G < 1 || d.R < 1 || d.D < 2 || d.D % 2 != 0)
    ck.fail("dims must have B, S >= 0, G, R >= 1 and an even D >= 2; got ", dims_text(d));
  if (d.keys() < d.S)
    ck.fail("dims.Sk (", d.Sk, ") must be 0 or at least S (", d.S, "): the queries are the last S of Sk keys; got ",
            dims_text(d));
}

// q, out, dout, dq: [B, S, cols] of the activation dtype, contiguous; the message spells out where the width comes
// from.
void check_rows(const cpu::Checker& ck, const char* name, const QkvDims& d, int64_t cols, const char* what) {
  const Tensor& t = ck.get(name);
  if (!(t.shape() == Shape{d.B, d.S, cols}))
    ck.fail(name, " must have shape [B, S, ", what, "] = ", Shape{d.B, d.S, cols}.str(), " for dims ", dims_text(d),
            ", got ", t.shape().str());
  ck.contiguous(name);
}

// kv, dkv: [B, Sk, W] with unit stride in the last dim and rows W apart; any batch stride (a dim-1 slice).
void check_keys(const cpu::Checker& ck, const char* name, const QkvDims& d) {
  const Tensor& t = ck.get(name);
  const Shape want{d.B, d.keys(), d.width()};
  if (!(t.shape() == want))
    ck.fail(name, " must have shape [B, Sk, G*(R+2)*D] = ", want.str(), " for dims ", dims_text(d), ", got ",
            t.shape().str());
  if (t.stride(2) != 1 || t.stride(1) != d.width())
    ck.fail(name, " must have unit stride in its last dim and rows ", d.width(), " elements apart, got strides [",
            t.stride(0), ", ", t.stride(1), ", ", t.stride(2), "]");
}

// The window is >= -1; sinks (and dsinks, only with sinks) are [Hq] f32 contiguous.
void check_options(const char* op, const Context& ctx, const QkvDims& d, const AttentionOptions& opt,
                   const Tensor* dsinks) {
  if (opt.window < -1) MOECORE_FAIL(op, ": options.window must be -1 (none) or >= 0, got ", opt.window);
  if (opt.sinks && opt.off_by_one)
    MOECORE_FAIL(op, ": options.sinks and options.off_by_one are exclusive (off-by-one has no sink parameter)");
  if (dsinks && !opt.sinks) MOECORE_FAIL(op, ": dsinks needs learnable sinks (options.sinks)");
  if (!opt.sinks) return;
  const cpu::Checker ck(op, ctx, {{"sinks", opt.sinks}, {"dsinks", dsinks ? dsinks : opt.sinks}},
                        cpu::Backends::cpu_and_cuda);
  for (const char* name : {"sinks", "dsinks"}) {
    ck.dtype(name, DType::f32);
    ck.shape(name, Shape{d.q_heads()});
    ck.contiguous(name);
  }
}

// Whether the memory spans of a and b (first to last element, the gaps of strided views included) intersect.
bool overlap(const Tensor& a, const Tensor& b) {
  auto span = [](const Tensor& t) {
    int64_t last = 0;
    for (int i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    const auto first = reinterpret_cast<uintptr_t>(cpu::address_of(t));
    return std::pair{first, first + static_cast<uintptr_t>((last + 1) * dtype_size(t.dtype()))};
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace

void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& kv, const QkvDims& dims,
                       const Dropout& dropout, const AttentionOptions& opt, const Context& ctx) {
  const cpu::Checker ck("attention_forward", ctx, {{"out", &out}, {"lse", &lse}, {"q", &q}, {"kv", &kv}},
                        cpu::Backends::cpu_and_cuda);
  check_dims(ck, dims);
  check_options("attention_forward", ctx, dims, opt, nullptr);
  cpu::check_dropout(ck, dropout);
  ck.float_dtype("q");
  for (const char* name : {"kv", "out"}) ck.same_dtype(name, "q");
  ck.dtype("lse", DType::f32);
  check_rows(ck, "q", dims, dims.width(), "G*(R+2)*D");
  check_keys(ck, "kv", dims);
  check_rows(ck, "out", dims, dims.q_heads() * dims.D, "G*R*D");
  ck.shape("lse", Shape{dims.B, dims.q_heads(), dims.S});
  ck.contiguous("lse");
  if (dims.B == 0 || dims.S == 0) return;
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda) return cuda::attention_forward(out, lse, q, kv, dims, dropout, opt, ctx);
  Layout L(dims, kv.stride(0));
  L.set_options(opt);
  std::optional<cpu::DropoutMask> mask;
  if (dropout.active()) mask.emplace(dropout);
  cpu::with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    forward_impl(out.data<T>(), lse.data<float>(), q.data<T>(), kv.data<T>(), L, mask ? &*mask : nullptr);
  });
}

void attention_backward(Tensor& dq, Tensor& dkv, Tensor* dsinks, const Tensor& dout, const Tensor& q, const Tensor& kv,
                        const Tensor& out, const Tensor& lse, const QkvDims& dims, const Dropout& dropout,
                        const AttentionOptions& opt, const Context& ctx) {
  const cpu::Checker ck(
      "attention_backward", ctx,
      {{"dq", &dq}, {"dkv", &dkv}, {"dout", &dout}, {"q", &q}, {"kv", &kv}, {"out", &out}, {"lse", &lse}},
      cpu::Backends::cpu_and_cuda);
  check_dims(ck, dims);
  check_options("attention_backward", ctx, dims, opt, dsinks);
  cpu::check_dropout(ck, dropout);
  ck.float_dtype("q");
  for (const char* name : {"dq", "dkv", "dout", "kv", "out"}) ck.same_dtype(name, "q");
  ck.dtype("lse", DType::f32);
  check_rows(ck, "q", dims, dims.width(), "G*(R+2)*D");
  check_rows(ck, "dq", dims, dims.width(), "G*(R+2)*D");
  check_keys(ck, "kv", dims);
  check_keys(ck, "dkv", dims);
  check_rows(ck, "out", dims, dims.q_heads() * dims.D, "G*R*D");
  check_rows(ck, "dout", dims, dims.q_heads() * dims.D, "G*R*D");
  ck.shape("lse", Shape{dims.B, dims.q_heads(), dims.S});
  ck.contiguous("lse");
  if (dims.B == 0 || dims.S == 0) return;
  for (const char* written : {"dq", "dkv"})
    for (const char* read : {"q", "kv", "dout"})
      if (overlap(ck.get(written), ck.get(read))) ck.fail(written, " must not share memory with ", read);
  if constexpr (cpu::kCudaKernels)
    if (ctx.device == Device::cuda)
      return cuda::attention_backward(dq, dkv, dsinks, dout, q, kv, out, lse, dims, dropout, opt, ctx);
  Layout L(dims, kv.stride(0), dkv.stride(0));
  L.set_options(opt);
  std::optional<cpu::DropoutMask> mask;
  if (dropout.active()) mask.emplace(dropout);
  cpu::with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    backward_impl(dq.data<T>(), dkv.data<T>(), dsinks ? dsinks->data<float>() : nullptr, dout.data<T>(), q.data<T>(),
                  kv.data<T>(), out.data<T>(), lse.data<float>(), L, mask ? &*mask : nullptr);
  });
}

int64_t attention_host_scratch_bytes(const QkvDims& dims) {
  const Layout L(dims, 0);
  const int64_t forward = 2 * L.B * L.G * L.Dp * L.Skp;  // forward_impl's kt_all and v_all
  const int64_t backward = static_cast<int64_t>(BwdPacked::floats(L, key_chunks(L).row_offset.back()));
  return static_cast<int64_t>(sizeof(float)) * (backward > forward ? forward + backward : forward);
}

}  // namespace moecore::ops
