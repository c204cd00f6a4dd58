// Megatron's MultiTokenPredictionBlock on the last pipeline stage: depth k = j + 1 takes the input ids and labels
// rolled once more (vacated last position: id 0, label masked) and computes
//   h_k = final_norm_k(layer_k(eh_proj_k([enorm_k(emb(ids_k)); hnorm_k(h_{k-1})])))
// with h_0 the decoder's output after the final norm; depth k's logits come from the shared output layer. Here: the
// depths' own parameters (bound by role), their buffers and their own arithmetic (the rolls, the norms and eh_proj,
// forward and backward). The model runs the pieces it shares with the decoder in between: the embedding, the
// transformer layer (a DecoderLayer, index num_layers + j) and the loss head.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>
#include <vector>

#include "moecore/core/param.h"
#include "moecore/kernels/ops.h"
#include "moecore/model/param_store.h"
#include "moecore/nn/dense_layer.h"

namespace moecore::model {

struct MtpDepth {
  Param *enorm = nullptr, *enorm_b = nullptr, *hnorm = nullptr, *hnorm_b = nullptr, *eh = nullptr;
  Param *fnorm = nullptr, *fnorm_b = nullptr;  // (biases: LayerNorm only)
  Tensor ids, labels;                          // [T] i32: rolled input ids and labels (this rank's positions)
  Tensor ids_h, labels_h;                      // [B * seq_length] i32 host: the whole batch's, rolled on the host
  Tensor e, hin, x, y;  // [N, H] f32: embedding, h_{k-1}, layer input (eh_proj output), layer output
  Tensor eh_in;         // [N, 2H] compute: [enorm(e) | hnorm(h_{k-1})], eh_proj's input (one linear, as Megatron's)
  Tensor h;             // [N, H] compute: final_norm(y) = h_k
  Tensor e_mean, e_rstd, h_mean, h_rstd, f_mean, f_rstd;  // [N] f32 norm statistics (means: LayerNorm only)
  ops::Dropout drop;   // the embedding's dropout (Megatron's embedding applies hidden dropout)
  std::string prefix;  // "mtp.layers.k." (names eh_proj in FP8 errors)
};

class MtpHeads {
 public:
  MtpHeads() = default;
  // cfg.mtp_num_layers depths over the store's parameters, buffers for dims (N rows, T tokens) of micro-batches of B
  // sequences of cfg.seq_length.
  // fp8: the model's FP8 training (null: off), which eh_proj runs under
  MtpHeads(ParamStore& store, const ModelConfig& cfg, const nn::DenseLayerDims& dims, int64_t B, Device device,
           nn::Fp8Training* fp8);
  size_t size() const { return depths_.size(); }
  bool empty() const { return depths_.empty(); }
  MtpDepth& depth(size_t j) { return depths_[j]; }
  Tensor& carry() { return carry_; }  // dL/dh_0 after the backward of depth 0 (hnorm_backward)
  Tensor& dh() { return dfn_; }       // dL/dh_k: the loss head's input gradient, before output_backward
  Tensor& h_full() { return h_full_; }

  // Depth j's ids (and when training its labels) rolled from the previous depth's (j = 0: the batch's), on the host.
  void roll(size_t j, const Tensor& tokens_h, const Tensor& labels_h, bool training);
  // With e the embedding of the rolled ids: x = eh_proj([enorm(dropout(e)); hnorm(h_prev)]).
  void input_forward(size_t j, const Tensor& h_prev, const ops::Context& ctx);
  void output_forward(size_t j, const ops::Context& ctx);  // h = final_norm(y)
  // dy = d final_norm(dh) (plus, below the deepest depth, the next depth's carry), into dy.
  void output_backward(size_t j, Tensor& dy, const ops::Context& ctx);
  // dx: the layer input's gradient on entry, the embedding's (through enorm and the dropout) on return; eh_proj's
  // gradient added.
  void input_backward(size_t j, Tensor& dx, const ops::Context& ctx);
  void hnorm_backward(size_t j, const ops::Context& ctx);  // carry = dL/dh_{k-1}, after input_backward
  int64_t bytes(MemCategory c) const;                      // the buffers' (activations, workspace)

 private:
  nn::Linear eh_proj(const MtpDepth& d) const;  // eh_proj's GEMMs: FP8 under the model's recipe

  int64_t B_ = 0, S_ = 0, H_ = 0;
  float eps_ = 0;
  nn::Fp8Training* fp8_ = nullptr;  // FP8 training (eh_proj runs FP8 when on, as Megatron's MTP layers)
  std::vector<MtpDepth> depths_;
  Tensor dx_c_;              // [N, H] compute: a depth's layer-input gradient for the eh_proj GEMMs
  Tensor norm_out_;          // [N, H] compute: enorm's or hnorm's output before it joins eh_in
  Tensor deh_in_;            // [N, 2H] f32: eh_proj's input gradient [d enorm | d hnorm]
  Tensor carry_, dn_, dfn_;  // [N, H] f32: dL/dh_{k-1}, a norm-output gradient, dL/dh_k
  Tensor h_full_;            // [T, H] compute: a depth's h_k all-gathered (sequence parallelism only)
};

}  // namespace moecore::model
