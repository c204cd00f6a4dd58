#include "moecore/nn/norm.h"

namespace moecore::nn {

void norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b, float eps,
                  const ops::Context& ctx) {
  if (b.defined())
    ops::layernorm_forward(y, mean, rstd, x, w, b, eps, ctx);
  else
    ops::rmsnorm_forward(y, rstd, x, w, eps, ctx);
}

void norm_backward(Tensor& dx, Tensor& dw, Tensor& db, const Tensor& dy, const Tensor& x, const Tensor& w,
                   const Tensor& b, const Tensor& mean, const Tensor& rstd, bool accumulate_dx,
                   const ops::Context& ctx) {
  if (b.defined())
    ops::layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, accumulate_dx, ctx);
  else
    ops::rmsnorm_backward(dx, dw, dy, x, w, rstd, accumulate_dx, ctx);
}

}  // namespace moecore::nn
