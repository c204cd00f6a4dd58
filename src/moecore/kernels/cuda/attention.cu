// CUDA causal attention on Megatron's interleaved qkv (attention.cpp): a flash-style forward (32 x 32 tiles, online
// softmax, f32 accumulation, lse saved) and a deterministic backward in two passes without atomics: one block per
// (batch, kv head, 32-key block) owns that block's dK and dV and walks the R query heads of its group and the query
// tiles in a fixed order; one block per (batch, query head, 32-query block) owns dQ and walks the key tiles in order.
// Queries come from q and keys/values from kv (any batch stride); the S queries are the last S of the Sk key
// positions, query i at position Sk - S + i. Dropout masks come from Philox by the CPU's flat index
// ((b*Hq + h)*Sk + Sk - S + i)*Sk + j, so they equal the CPU's bit for bit; p = 0 generates none.
// Layout: 256 threads = 32 rows x 8 threads; a row's 8 threads own interleaved channels d = sub + 8k and reduce dot
// products with three shuffles. Plain f32 FMAs (no tensor cores): correct and deterministic, but expect a few
// TFLOP/s, several times slower than FlashAttention-2/3 on an H100. Head dims up to 256.
// A sliding window narrows every loop to the tiles that hold a visible pair (common/attention_window.h); a sink starts
// a row's running max and sum at (s_h, 1), and its gradient is a fourth, per-head kernel reduced in a fixed order.
#include <cmath>
#include <type_traits>

#include "moecore/kernels/common/attention_window.h"
#include "moecore/kernels/cuda/cuda_util.cuh"

namespace moecore::ops::cuda {
namespace {

constexpr int kTile = 32;  // queries or keys per block and per tile
constexpr int kSub = 8;    // threads per row
constexpr int kAttnThreads = kTile * kSub;
constexpr int kMaxD = 256;

struct AttnDims {
  int64_t B, S, Sk, off, G, R, D, H, W, DP;  // S queries at key positions off..Sk-1; H query heads, W = qkv row width,
                                             // DP = D rounded up to kSub
  int64_t kv_bs, dkv_bs;                     // batch strides of kv and dkv (their rows are W apart)
  float scale;
  int64_t window;      // AttentionOptions::window
  bool has_sink;       // off-by-one or learnable sinks
  const float* sinks;  // [H] learnable sink logits, or null (off-by-one: 0)
  __device__ float sink(int64_t h) const { return sinks ? sinks[h] : 0.0f; }
  __device__ bool visible(int64_t pos, int64_t k) const { return attn_window::visible(pos, k, window); }
  __device__ int64_t q_col(int64_t h) const { return ((h / R) * (R + 2) + h % R) * D; }
  __device__ int64_t k_col(int64_t g) const { return (g * (R + 2) + R) * D; }
  __device__ int64_t v_col(int64_t g) const { return k_col(g) + D; }
  // Dropout index of the query at key position p and key k.
  __device__ uint64_t mask_index(int64_t b, int64_t h, int64_t p, int64_t k) const {
    return static_cast<uint64_t>(((b * H + h) * Sk + p) * Sk + k);
  }
};

__device__ __forceinline__ float sum8(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v;
}

// The keep bits of keys first .. first + 31 of one mask row (bit j: element first + j kept), for the 8 threads of a
// row together: each computes four, then they OR their bits. All lanes must call it.
__device__ __forceinline__ uint32_t keep_bits(const DeviceMask& mk, uint64_t first, int sub) {
  uint32_t bits = 0;
  uint64_t cached = ~uint64_t{0};
  PhiloxWords w{};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = sub * 4 + u;
    const uint64_t i = first + static_cast<uint64_t>(j);
    if (i / 4 != cached) {
      cached = i / 4;
      w = philox_block(mk.key0, mk.key1, cached);
    }
    bits |= (w.w[i % 4] >= mk.threshold ? 1u : 0u) << j;
  }
  bits |= __shfl_xor_sync(0xffffffffu, bits, 4);
  bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
  bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
  return bits;
}

// rows [kTile, DP] f32 of shared memory <- the first D columns of rows first .. first + 31 of the [rows, row_stride]
// matrix at src (zeros past rows and past D).
template <class T>
__device__ void load_tile(float* dst, const T* src, int64_t rows, int64_t row_stride, int64_t first,
                          const AttnDims& L) {
  for (int64_t i = threadIdx.x; i < kTile * L.DP; i += blockDim.x) {
    const int64_t j = i / L.DP, d = i % L.DP, row = first + j;
    dst[i] = row < rows && d < L.D ? ld(src[row * row_stride + d]) : 0.0f;
  }
}

template <class T, int MAXK>
__global__ void __launch_bounds__(kAttnThreads)
    attention_forward_kernel(T* out, float* lse, const T* q, const T* kv, AttnDims L, DeviceMask mk) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * L.DP;
  const int64_t bh = blockIdx.x, b = bh / L.H, h = bh % L.H, g = h / L.R;
  const int64_t q0 = (gridDim.y - 1 - blockIdx.y) * static_cast<int64_t>(kTile);  // longest rows first
  const int r = threadIdx.x / kSub, sub = threadIdx.x % kSub, nk = static_cast<int>(L.DP / kSub);
  const int64_t qi = q0 + r, pos = L.off + qi;  // pos: the query's key position
  const bool valid = qi < L.S;
  float qr[MAXK], o[MAXK];
  const T* qrow = q + (b * L.S + (valid ? qi : 0)) * L.W + L.q_col(h);
  const T* kvb = kv + b * L.kv_bs;
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int64_t d = sub + kSub * k;
    qr[k] = valid && k < nk && d < L.D ? ld(qrow[d]) * L.scale : 0.0f;
    o[k] = 0.0f;
  }
  float m = L.has_sink ? L.sink(h) : -INFINITY, l = L.has_sink ? 1.0f : 0.0f;
  // A tile in a row's future or before its window adds exact zeros to it.
  const int64_t k_first = attn_window::first_key(L.off + q0, L.window) / kTile * kTile;
  for (int64_t k0 = k_first; k0 < L.off + q0 + kTile; k0 += kTile) {
    __syncthreads();
    load_tile(ks, kvb + L.k_col(g), L.Sk, L.W, k0, L);
    load_tile(vs, kvb + L.v_col(g), L.Sk, L.W, k0, L);
    __syncthreads();
    const uint32_t keep = mk.active ? keep_bits(mk, L.mask_index(b, h, pos, k0), sub) : ~0u;
    float s[kTile];
    float mt = -INFINITY;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      float part = 0.0f;
#pragma unroll
      for (int k = 0; k < MAXK; ++k)
        if (k < nk) part += qr[k] * ks[j * L.DP + sub + kSub * k];
      part = sum8(part);
      s[j] = L.visible(pos, k0 + j) ? part : -INFINITY;
      mt = fmaxf(mt, s[j]);
    }
    // A row with no visible key yet keeps m = -inf and takes its exponents against 0.
    const float m_max = fmaxf(m, mt), m_new = m_max == -INFINITY ? 0.0f : m_max, alpha = expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const float p = expf(s[j] - m_new);
      sum += p;
      s[j] = mk.active ? ((keep >> j) & 1u ? p * mk.scale : 0.0f) : p;  // l keeps the undropped sum
    }
    l = l * alpha + sum;
    m = m_max;
#pragma unroll
    for (int k = 0; k < MAXK; ++k) o[k] *= alpha;
#pragma unroll
    for (int j = 0; j < kTile; ++j)
#pragma unroll
      for (int k = 0; k < MAXK; ++k)
        if (k < nk) o[k] += s[j] * vs[j * L.DP + sub + kSub * k];
  }
  if (!valid) return;
  const float inv = 1.0f / l;
  T* orow = out + (b * L.S + qi) * L.H * L.D + h * L.D;
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int64_t d = sub + kSub * k;
    if (k < nk && d < L.D) st(orow[d], o[k] * inv);
  }
  if (sub == 0) lse[(b * L.H + h) * L.S + qi] = m + logf(l);
}

// delta[(b*H + h)*S + q] = sum_d dout * out (one warp per row).
template <class T>
__global__ void attention_delta_kernel(float* delta, const T* dout, const T* out, AttnDims L, int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; row < rows; row += warps) {
    const int64_t b = row / (L.H * L.S), h = row / L.S % L.H, q = row % L.S;
    const int64_t base = (b * L.S + q) * L.H * L.D + h * L.D;
    float acc = 0.0f;
    for (int64_t d = lane; d < L.D; d += 32) acc += ld(dout[base + d]) * ld(out[base + d]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) delta[row] = acc;
  }
}

// dK, dV of 32 keys of kv head g: over the group's query heads in order, then the query tiles from the first that
// sees the block's first key on.
template <class T, int MAXK>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dkv_kernel(T* dkv, const T* q, const T* kv, const T* dout, const float* lse, const float* delta,
                         AttnDims L, DeviceMask mk) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = qs + kTile * L.DP;
  float* lse_s = dos + kTile * L.DP;
  float* delta_s = lse_s + kTile;
  uint32_t* keep_s = reinterpret_cast<uint32_t*>(delta_s + kTile);
  const int64_t bg = blockIdx.x, b = bg / L.G, g = bg % L.G;
  const int64_t k0 = blockIdx.y * static_cast<int64_t>(kTile);
  const int r = threadIdx.x / kSub, sub = threadIdx.x % kSub, nk = static_cast<int>(L.DP / kSub);
  const int64_t j = k0 + r;
  const bool kvalid = j < L.Sk;
  float kr[MAXK], vr[MAXK], dk[MAXK], dv[MAXK];
  const T* krow = kv + b * L.kv_bs + (kvalid ? j : 0) * L.W;
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int64_t d = sub + kSub * k;
    const bool in = kvalid && k < nk && d < L.D;
    kr[k] = in ? ld(krow[L.k_col(g) + d]) * L.scale : 0.0f;
    vr[k] = in ? ld(krow[L.v_col(g) + d]) : 0.0f;
    dk[k] = dv[k] = 0.0f;
  }
  const int64_t HD = L.H * L.D;
  for (int64_t h = g * L.R; h < (g + 1) * L.R; ++h) {
    const int64_t bh = b * L.H + h;
    const int64_t q_end = attn_window::end_position(k0 + kTile - 1, L.window, L.Sk) - L.off;
    for (int64_t q0 = (k0 > L.off ? k0 - L.off : 0) / kTile * kTile; q0 < L.S && q0 < q_end; q0 += kTile) {
      __syncthreads();
      load_tile(qs, q + b * L.S * L.W + L.q_col(h), L.S, L.W, q0, L);
      load_tile(dos, dout + b * L.S * HD + h * L.D, L.S, HD, q0, L);
      if (threadIdx.x < kTile) {
        const int64_t qi = q0 + threadIdx.x;
        lse_s[threadIdx.x] = qi < L.S ? lse[bh * L.S + qi] : 0.0f;
        delta_s[threadIdx.x] = qi < L.S ? delta[bh * L.S + qi] : 0.0f;
      }
      if (mk.active) {  // row r of the tile: query q0 + r against this block's keys
        const uint32_t bits = keep_bits(mk, L.mask_index(b, h, L.off + q0 + r, k0), sub);
        if (sub == 0) keep_s[r] = bits;
      }
      __syncthreads();
      for (int i = 0; i < kTile; ++i) {
        const int64_t qi = q0 + i;
        float sp = 0.0f, dp = 0.0f;
#pragma unroll
        for (int k = 0; k < MAXK; ++k)
          if (k < nk) {
            sp += qs[i * L.DP + sub + kSub * k] * kr[k];
            dp += dos[i * L.DP + sub + kSub * k] * vr[k];
          }
        sp = sum8(sp);
        dp = sum8(dp);
        const bool visible = kvalid && qi < L.S && L.visible(L.off + qi, j);
        const float p = visible ? expf(sp - lse_s[i]) : 0.0f;
        const float f = mk.active ? ((keep_s[i] >> r) & 1u ? mk.scale : 0.0f) : 1.0f;
        const float pd = p * f, ds = p * (dp * f - delta_s[i]) * L.scale;
#pragma unroll
        for (int k = 0; k < MAXK; ++k)
          if (k < nk) {
            dv[k] += pd * dos[i * L.DP + sub + kSub * k];
            dk[k] += ds * qs[i * L.DP + sub + kSub * k];
          }
      }
    }
  }
  if (!kvalid) return;
  T* row = dkv + b * L.dkv_bs + j * L.W;
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int64_t d = sub + kSub * k;
    if (k < nk && d < L.D) {
      st(row[L.k_col(g) + d], dk[k]);
      st(row[L.v_col(g) + d], dv[k]);
    }
  }
}

// dQ of 32 queries of head h: the key tiles up to the diagonal, in order.
template <class T, int MAXK>
__global__ void __launch_bounds__(kAttnThreads)
    attention_dq_kernel(T* dq, const T* q, const T* kv, const T* dout, const float* lse, const float* delta, AttnDims L,
                        DeviceMask mk) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * L.DP;
  const int64_t bh = blockIdx.x, b = bh / L.H, h = bh % L.H, g = h / L.R;
  const int64_t q0 = (gridDim.y - 1 - blockIdx.y) * static_cast<int64_t>(kTile);
  const int r = threadIdx.x / kSub, sub = threadIdx.x % kSub, nk = static_cast<int>(L.DP / kSub);
  const int64_t qi = q0 + r, pos = L.off + qi;  // pos: the query's key position
  const bool valid = qi < L.S;
  float qr[MAXK], dor[MAXK], dqr[MAXK];
  const T* qrow = q + (b * L.S + (valid ? qi : 0)) * L.W + L.q_col(h);
  const T* dorow = dout + (b * L.S + (valid ? qi : 0)) * L.H * L.D + h * L.D;
  const T* kvb = kv + b * L.kv_bs;
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int64_t d = sub + kSub * k;
    const bool in = valid && k < nk && d < L.D;
    qr[k] = in ? ld(qrow[d]) : 0.0f;
    dor[k] = in ? ld(dorow[d]) : 0.0f;
    dqr[k] = 0.0f;
  }
  const float lse_q = valid ? lse[bh * L.S + qi] : 0.0f, delta_q = valid ? delta[bh * L.S + qi] : 0.0f;
  const int64_t k_first = attn_window::first_key(L.off + q0, L.window) / kTile * kTile;
  for (int64_t k0 = k_first; k0 < L.off + q0 + kTile; k0 += kTile) {
    __syncthreads();
    load_tile(ks, kvb + L.k_col(g), L.Sk, L.W, k0, L);
    load_tile(vs, kvb + L.v_col(g), L.Sk, L.W, k0, L);
    __syncthreads();
    const uint32_t keep = mk.active ? keep_bits(mk, L.mask_index(b, h, pos, k0), sub) : ~0u;
    for (int j = 0; j < kTile; ++j) {
      float sp = 0.0f, dp = 0.0f;
#pragma unroll
      for (int k = 0; k < MAXK; ++k)
        if (k < nk) {
          sp += qr[k] * (ks[j * L.DP + sub + kSub * k] * L.scale);
          dp += dor[k] * vs[j * L.DP + sub + kSub * k];
        }
      sp = sum8(sp);
      dp = sum8(dp);
      const bool visible = valid && L.visible(pos, k0 + j);
      const float p = visible ? expf(sp - lse_q) : 0.0f;
      const float f = mk.active ? ((keep >> j) & 1u ? mk.scale : 0.0f) : 1.0f;
      const float ds = p * (dp * f - delta_q) * L.scale;
#pragma unroll
      for (int k = 0; k < MAXK; ++k)
        if (k < nk) dqr[k] += ds * ks[j * L.DP + sub + kSub * k];
    }
  }
  if (!valid) return;
  T* row = dq + (b * L.S + qi) * L.W + L.q_col(h);
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int64_t d = sub + kSub * k;
    if (k < nk && d < L.D) st(row[d], dqr[k]);
  }
}

// dsinks[h] -= sum over (b, i) of exp(s_h - lse) * delta: one block per head, each thread's strided partial sums,
// then a fixed tree (deterministic).
__global__ void __launch_bounds__(kThreads)
    attention_dsinks_kernel(float* dsinks, const float* lse, const float* delta, AttnDims L) {
  __shared__ float part[kThreads];
  const int64_t h = blockIdx.x, n = L.B * L.S;
  float acc = 0.0f;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const int64_t row = (t / L.S * L.H + h) * L.S + t % L.S;
    acc += expf(L.sink(h) - lse[row]) * delta[row];
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) dsinks[h] -= part[0];
}

AttnDims attn_dims(const QkvDims& d, int64_t kv_bs, int64_t dkv_bs, const AttentionOptions& opt) {
  return {d.B,
          d.S,
          d.keys(),
          d.keys() - d.S,
          d.G,
          d.R,
          d.D,
          d.q_heads(),
          d.width(),
          (d.D + kSub - 1) / kSub * kSub,
          kv_bs,
          dkv_bs,
          1.0f / std::sqrt(static_cast<float>(d.D)),
          opt.window,
          opt.has_sink(),
          opt.sinks ? Launch::ptr<const float>(*opt.sinks) : nullptr};
}

// Calls fn(std::integral_constant<int, MAXK>) with the smallest instantiated MAXK covering D.
template <class Fn>
void with_max_k(int64_t DP, Fn&& fn) {
  if (DP <= 64) return fn(std::integral_constant<int, 8>{});
  if (DP <= 128) return fn(std::integral_constant<int, 16>{});
  return fn(std::integral_constant<int, 32>{});
}

template <class Kernel>
void allow_shared(const Launch& l, Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    l.check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
            "cudaFuncSetAttribute (shared memory)");
}

void check_attention_dims(const char* op, const QkvDims& d) {
  MOECORE_CHECK(d.D <= kMaxD, op, " (cuda): head dim D = ", d.D, " exceeds the CUDA kernel's ", kMaxD,
                "; run attention on the CPU or use a smaller head dim");
  MOECORE_CHECK(d.B * d.q_heads() <= 0x7fffffff && (d.keys() + kTile - 1) / kTile <= 65535, op,
                " (cuda): B * heads = ", d.B * d.q_heads(), ", Sk = ", d.keys(), " exceed the grid");
}

}  // namespace

void attention_forward(Tensor& out, Tensor& lse, const Tensor& q, const Tensor& kv, const QkvDims& dims,
                       const Dropout& dropout, const AttentionOptions& opt, const Context& ctx) {
  const Launch l("attention_forward", ctx, {{"out", &out}, {"lse", &lse}, {"q", &q}, {"kv", &kv}});
  if (dims.B == 0 || dims.S == 0) return;
  check_attention_dims("attention_forward", dims);
  const AttnDims L = attn_dims(dims, kv.stride(0), 0, opt);
  const DeviceMask mk = device_mask(dropout);
  const dim3 grid(static_cast<unsigned>(L.B * L.H), static_cast<unsigned>((L.S + kTile - 1) / kTile));
  const size_t smem = 2 * kTile * L.DP * sizeof(float);
  with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    with_max_k(L.DP, [&](auto mk_tag) {
      auto kernel = attention_forward_kernel<T, decltype(mk_tag)::value>;
      allow_shared(l, kernel, smem);
      kernel<<<grid, kAttnThreads, smem, l.stream()>>>(Launch::ptr<T>(out), Launch::ptr<float>(lse),
                                                       Launch::ptr<const T>(q), Launch::ptr<const T>(kv), L, mk);
    });
  });
  l.launched("attention_forward_kernel");
}

void attention_backward(Tensor& dq, Tensor& dkv, Tensor* dsinks, const Tensor& dout, const Tensor& q, const Tensor& kv,
                        const Tensor& out, const Tensor& lse, const QkvDims& dims, const Dropout& dropout,
                        const AttentionOptions& opt, const Context& ctx) {
  const Launch l("attention_backward", ctx,
                 {{"dq", &dq}, {"dkv", &dkv}, {"dout", &dout}, {"q", &q}, {"kv", &kv}, {"out", &out}, {"lse", &lse}});
  if (dims.B == 0 || dims.S == 0) return;
  check_attention_dims("attention_backward", dims);
  const AttnDims L = attn_dims(dims, kv.stride(0), dkv.stride(0), opt);
  const DeviceMask mk = device_mask(dropout);
  const int64_t rows = L.B * L.H * L.S;
  WorkspaceCarver w;
  w.reserve<float>(rows);
  w.allocate(l);
  float* delta = w.take<float>(rows);
  const unsigned nqb = static_cast<unsigned>((L.S + kTile - 1) / kTile),
                 nkb = static_cast<unsigned>((L.Sk + kTile - 1) / kTile);
  const size_t smem_dkv = (2 * kTile * L.DP + 3 * kTile) * sizeof(float), smem_dq = 2 * kTile * L.DP * sizeof(float);
  with_float_type(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    attention_delta_kernel<<<grid_for(rows * 32), kThreads, 0, l.stream()>>>(delta, Launch::ptr<const T>(dout),
                                                                             Launch::ptr<const T>(out), L, rows);
    l.launched("attention_delta_kernel");
    with_max_k(L.DP, [&](auto mk_tag) {
      constexpr int MAXK = decltype(mk_tag)::value;
      auto dkv_kernel = attention_dkv_kernel<T, MAXK>;
      allow_shared(l, dkv_kernel, smem_dkv);
      dkv_kernel<<<dim3(static_cast<unsigned>(L.B * L.G), nkb), kAttnThreads, smem_dkv, l.stream()>>>(
          Launch::ptr<T>(dkv), Launch::ptr<const T>(q), Launch::ptr<const T>(kv), Launch::ptr<const T>(dout),
          Launch::ptr<const float>(lse), delta, L, mk);
      l.launched("attention_dkv_kernel");
      auto dq_kernel = attention_dq_kernel<T, MAXK>;
      allow_shared(l, dq_kernel, smem_dq);
      dq_kernel<<<dim3(static_cast<unsigned>(L.B * L.H), nqb), kAttnThreads, smem_dq, l.stream()>>>(
          Launch::ptr<T>(dq), Launch::ptr<const T>(q), Launch::ptr<const T>(kv), Launch::ptr<const T>(dout),
          Launch::ptr<const float>(lse), delta, L, mk);
      l.launched("attention_dq_kernel");
    });
  });
  if (dsinks) {
    attention_dsinks_kernel<<<static_cast<unsigned>(L.H), kThreads, 0, l.stream()>>>(
        Launch::ptr<float>(*dsinks), Launch::ptr<const float>(lse), delta, L);
    l.launched("attention_dsinks_kernel");
  }
}

}  // namespace moecore::ops::cuda
