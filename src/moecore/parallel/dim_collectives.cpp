// comm.h, part 5: all_gather_into and reduce_scatter_from, the gather and the reduce-scatter along a
// non-leading dim of sequence- and tensor-parallel regions. Built on the backend's all-gather and all-to-all
// through the group's contiguous workspace, with the rank-ordered sum of collectives.cpp.
#include <cstring>
#include <vector>

#include "moecore/core/backend_hooks.h"
#include "moecore/core/error.h"
#include "moecore/parallel/call.h"

namespace moecore {
namespace detail {
namespace {

// The view of a tensor around `dim`: outer (dims before), len (dim itself), inner (dims after), in elements.
struct Around {
  int64_t outer = 1, len = 0, inner = 1;
};

int64_t shape_hash(const Tensor& t) {
  std::vector<int64_t> words;
  for (int i = 0; i < t.dim(); ++i) words.push_back(t.size(i));
  return hash_words(words);
}

// Checks out and in agree except along dim, where big = P × small; returns small's view around dim.
Around check_shapes(Call& c, const Tensor& big, const Tensor& small, int& dim, const char* big_name,
                    const char* small_name) {
  const int nd = small.dim();
  if (nd == 0) c.fail(str_cat("the ", small_name, " tensor is a scalar; it needs the dim to split"));
  if (dim < -nd || dim >= nd)
    c.fail(str_cat("dim ", dim, " is out of range for the ", small_name, " tensor ", small.str()));
  if (dim < 0) dim += nd;
  Around a;
  bool ok = big.dim() == nd;
  for (int i = 0; ok && i < nd; ++i) {
    ok = big.size(i) == (i == dim ? small.size(i) * c.g.size() : small.size(i));
    if (i < dim) a.outer *= small.size(i);
    if (i > dim) a.inner *= small.size(i);
  }
  if (!ok)
    c.fail(str_cat("the ", big_name, " tensor ", big.str(), " must be the ", small_name, " tensor ", small.str(),
                   " with dim ", dim, " multiplied by the group size ", c.g.size()));
  a.len = small.size(dim);
  return a;
}

}  // namespace
}  // namespace detail

void all_gather_into(const Tensor& out, const Tensor& in, int dim, const ProcessGroup& g) {
  const DeviceAccess access;  // a collective reads and writes device memory, as NCCL does
  detail::check_tensor(out, "all_gather_into", g, "output");
  detail::check_tensor(in, "all_gather_into", g, "input");
  detail::check_same_dtype(out, in, "all_gather_into", g);
  detail::Call c(g, "all_gather_into");
  const detail::Around a = detail::check_shapes(c, out, in, dim, "output", "input");
  const int64_t n = in.numel(), es = static_cast<int64_t>(dtype_size(in.dtype()));
  detail::check_disjoint(c, out.raw(), out.numel(), in.raw(), n, in.dtype());
  if (c.single()) {
    if (n > 0) local_copy(out.raw(), in.raw(), n * es);
    return;
  }
  detail::debug_check(c, {static_cast<int64_t>(detail::OpId::all_gather_into), static_cast<int64_t>(in.dtype()), n, dim,
                          detail::shape_hash(out), 0});
  const int p = g.size();
  auto* dst = static_cast<std::byte*>(out.raw());
  // One leading block per rank: out is already the gathered layout.
  auto* stage = a.outer == 1 ? dst : static_cast<std::byte*>(detail::scratch(c.st, p * n * es));
  c.guarded([&] { detail::backend_all_gather(stage, in.raw(), n, in.dtype(), *c.st.comm, c.info); });
  if (a.outer == 1) return;
  const int64_t chunk = a.len * a.inner * es;  // bytes of one rank's slab within one outer index
  for (int r = 0; r < p; ++r)
    for (int64_t o = 0; o < a.outer; ++o)
      std::memcpy(dst + (o * p + r) * chunk, stage + r * n * es + o * chunk, static_cast<size_t>(chunk));
}

void reduce_scatter_from(const Tensor& out, const Tensor& in, int dim, const ProcessGroup& g) {
  const DeviceAccess access;
  detail::check_tensor(out, "reduce_scatter_from", g, "output");
  detail::check_tensor(in, "reduce_scatter_from", g, "input");
  detail::check_same_dtype(out, in, "reduce_scatter_from", g);
  detail::Call c(g, "reduce_scatter_from");
  detail::check_reducible(c, in.dtype());
  const detail::Around a = detail::check_shapes(c, in, out, dim, "input", "output");
  const int64_t n = out.numel(), es = static_cast<int64_t>(dtype_size(in.dtype()));
  detail::check_disjoint(c, out.raw(), n, in.raw(), in.numel(), in.dtype());
  if (c.single()) {
    if (n > 0) local_copy(out.raw(), in.raw(), n * es);
    return;
  }
  detail::debug_check(c, {static_cast<int64_t>(detail::OpId::reduce_scatter_from), static_cast<int64_t>(in.dtype()), n,
                          dim, detail::shape_hash(in), 0});
  const int p = g.size();
  auto* ws = static_cast<std::byte*>(detail::scratch(c.st, 2 * p * n * es));
  std::byte* parts = ws;  // [p, n]: every rank's block for this rank
  auto* src = static_cast<const std::byte*>(in.raw());
  const std::byte* blocks = src;  // [p, n]: block q goes to rank q
  if (a.outer > 1) {
    std::byte* stage = ws + p * n * es;
    const int64_t chunk = a.len * a.inner * es;
    for (int r = 0; r < p; ++r)
      for (int64_t o = 0; o < a.outer; ++o)
        std::memcpy(stage + r * n * es + o * chunk, src + (o * p + r) * chunk, static_cast<size_t>(chunk));
    blocks = stage;
  }
  int64_t* w = detail::counts_ws(c.st, p);
  for (int r = 0; r < p; ++r) w[r] = n, w[p + r] = r * n;
  c.guarded([&] { detail::backend_all_to_all_v(parts, w, w + p, blocks, w, w + p, in.dtype(), *c.st.comm, c.info); });
  detail::sum_rank_order(in.dtype(), out.raw(), parts, p, n);
}

}  // namespace moecore
