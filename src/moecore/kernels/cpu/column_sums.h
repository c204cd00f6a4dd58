// Private helper of the CPU backend: deterministic column sums over contiguous row segments (bias
// gradients). Each segment's rows are cut into chunks of kRows; a chunk sums its rows in row order in
// double, then a segment's chunks are added in chunk order. The cuts depend on the shapes only, so the
// result does not depend on the thread count. No tensor code here.
#pragma once
#include <algorithm>
#include <cstdint>

#include "moecore/kernels/cpu/cpu_util.h"

namespace moecore::ops::cpu {

// out[g*W + w] = f32(out[g*W + w] + sum over rows r of segment g of term(r, w)), segment g the rows
// [offsets[g], offsets[g+1]). term(r, c0, c1, acc) adds row r's terms of columns c0..c1-1 to acc[0..c1-c0)
// and may write row r's outputs on the way: every (row, column) is visited exactly once.
template <class Term>
void segment_column_sums(float* out, const int64_t* offsets, int64_t G, int64_t W, Term&& term) {
  constexpr int64_t kRows = 256, kCols = 256;
  int64_t nchunks = 0;
  for (int64_t g = 0; g < G; ++g) nchunks += (offsets[g + 1] - offsets[g] + kRows - 1) / kRows;
  int64_t* chunk_group = scratch<int64_t, 7>(static_cast<size_t>(nchunks + G + 1));
  int64_t* first_chunk = chunk_group + nchunks;  // [G + 1]
  first_chunk[0] = 0;
  for (int64_t g = 0, c = 0; g < G; ++g) {
    for (int64_t r = offsets[g]; r < offsets[g + 1]; r += kRows) chunk_group[c++] = g;
    first_chunk[g + 1] = c;
  }
  double* partial = scratch<double, 7>(static_cast<size_t>(nchunks * W));
  const int64_t nb = (W + kCols - 1) / kCols, rows = offsets[G] - offsets[0];
#pragma omp parallel for collapse(2) schedule(static) if (rows * W > kParallelWork)
  for (int64_t c = 0; c < nchunks; ++c) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = chunk_group[c], c0 = b * kCols, c1 = std::min(W, c0 + kCols);
      const int64_t r0 = offsets[g] + (c - first_chunk[g]) * kRows, r1 = std::min(offsets[g + 1], r0 + kRows);
      double* acc = partial + c * W + c0;
      std::fill(acc, acc + (c1 - c0), 0.0);
      for (int64_t r = r0; r < r1; ++r) term(r, c0, c1, acc);
    }
  }
#pragma omp parallel for schedule(static) if (G * W > kParallelWork)
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t w = 0; w < W; ++w) {
      double s = out[g * W + w];
      for (int64_t c = first_chunk[g]; c < first_chunk[g + 1]; ++c) s += partial[c * W + w];
      out[g * W + w] = static_cast<float>(s);
    }
  }
}

}  // namespace moecore::ops::cpu
