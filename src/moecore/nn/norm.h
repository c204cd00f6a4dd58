// The model's normalization, RMSNorm or LayerNorm, behind one forward/backward pair. LayerNorm is the
// variant with a bias; RMSNorm has none (and leaves `mean` unused).
#pragma once
#include "moecore/kernels/ops.h"

namespace moecore::nn {

// y [N, H] f32|bf16|f16; mean, rstd [N] f32 saved; x [N, H] f32; w [H] f32; b [H] f32 or undefined (RMSNorm).
void norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b, float eps,
                  const ops::Context& ctx);
// dx written (or += when accumulate_dx); dw, db += (db ignored for RMSNorm).
void norm_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                   const Tensor& b, const Tensor& mean, const Tensor& rstd, bool accumulate_dx,
                   const ops::Context& ctx);

}  // namespace moecore::nn
