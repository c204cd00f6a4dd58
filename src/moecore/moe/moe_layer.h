// The MoE layer as named stages (docs/STYLE.md, docs/megatron-moe-spec.md §9):
//   route -> dispatch_prepare -> exchange_counts -> dispatch -> experts -> combine_prepare -> combine -> combine_finish
// (which of them communicate: dispatcher.h)
// plus the shared expert on every token. Forward and backward are explicit; the dispatcher is passed in, so
// the same layer runs with the local, all-to-all or all-gather dispatcher.
// Gradient contract: parameter gradients accumulate (+=); the input gradient dx is written.
// Token order: Megatron's. The layer sees [S, B, H] activations flattened sequence-major, token t = s * B + b
// (a [B, S, H] model transposes around the layer); seq_aux_loss and the "position" drop policy depend on it.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <vector>

#include "moecore/moe/dispatcher.h"
#include "moecore/moe/echo.h"
#include "moecore/moe/experts.h"
#include "moecore/moe/router.h"

namespace moecore::moe {

struct MoeLayerDims {
  int64_t T = 0;   // this rank's tokens, the residual rows (S * B, or their SP share; t = s * B + b)
  int64_t B = 1;   // sequences
  int64_t H = 0;   // hidden size
  int64_t F = 0;   // expert ffn size
  int64_t Fs = 0;  // shared expert ffn size (0: none)
  DType compute = DType::f32;
  int64_t ep = 1;   // expert-parallel size: this rank holds experts [r*E/ep, (r+1)*E/ep) of the EP group
  int64_t etp = 1;  // expert-tensor-parallel size: this rank holds slice etp_rank of each local expert's F (fc1's
  int64_t etp_rank =
      0;  // gate and up rows and fc1 bias, fc2's columns; ExpertDims::F = F / etp) and the whole fc2 bias
  DispatcherKind dispatcher = DispatcherKind::local;  // which dispatcher the buffers are sized for
  bool recompute_act = false;  // --recompute-modules moe_act: the experts recompute their activation (ExpertDims)
  const ProcessGroup* global_aux_group = nullptr;  // global_aux_loss counts are summed over it (DP)
  const ProcessGroup* sequence_group = nullptr;    // sequence parallelism: T is this rank's share (RouterDims)
  Device device = Device::cpu;                     // where the caches live (the ops' context device)
  // MoE ECHO (echo.h): clones of hot experts in each EP rank's slots; needs the alltoall dispatcher, ETP 1, dropless
  // routing. The dispatch buffers then hold E' = E + slots expert columns.
  EchoDims echo{};
  // --moe-received-token-capacity: the saved expert-side buffers hold ceil(capacity x T x K) received rows (the
  // average's multiple); more set the dispatcher's overflow flag (dispatcher.h). 0: sized for every row (synced
  // dropless). Needs the alltoall dispatcher and ETP 1.
  float received_capacity = 0.0f;
  nn::Fp8Training* fp8 = nullptr;  // the experts' and shared expert's GEMMs run FP8 (nn/fp8.h; the router never)
  std::string_view layer{};        // the layer's parameter prefix, naming its GEMMs in errors
};
// The received rows the saved buffers hold: ceil(capacity x T x K), at most the dropless bound (0: that bound).
int64_t moe_layer_received_rows(const MoeLayerDims& d, const MoeConfig& cfg);
// The shared expert's dims in this layer (its activation, FP8 recipe and name).
SharedExpertDims shared_expert_dims(const MoeLayerDims& d, const MoeConfig& cfg);

// Megatron's add_bias_linear gives the router and the routed experts biases (router.bias, experts.fc1_bias,
// experts.fc2_bias); with a shared expert it is an error, as in Megatron (SharedExpertMLP has no biases).
struct MoeLayerWeights {
  RouterWeights router;
  ExpertWeights experts;
  SharedExpertWeights shared;  // undefined tensors without a shared expert
};
struct MoeLayerGrads {
  Tensor router;  // [E, H] f32
  ExpertGrads experts;
  SharedExpertGrads shared;
  Tensor router_bias{};  // [E] f32, defined iff the router has a bias
};

// Everything one layer keeps between forward and backward, allocated once, and its scratch: the tensors dead between
// a layer's forward and its backward (the dispatcher's staging rows -- AllToAllScratch, AllGatherScratch --, the
// experts' output rows, backward buffers), which all layers of a model share (moe_layer_cache_alloc's
// `share_scratch_with`): one cache allocates them, the others alias them, and the memory plan counts them once
// (moe_layer_scratch_bytes).
struct MoeLayerCache {
  RouterCache router;
  Tensor probs;   // [T, E] f32
  Tensor map;     // [T, E] bool
  Tensor dprobs;  // [T, E] f32 (backward)
  DispatchBuffers dispatch;
  ExpertCache experts;
  ExpertWorkspace expert_ws;
  SharedExpertCache shared;
  EchoCache echo;               // MoE ECHO's plan, rerouted routing and clones (dims.echo enabled)
  RouterStats stats;            // of the last forward
  bool owns_refilled = true;    // false when the tensors a recompute refills alias another cache's
  bool owns_expert_act = true;  // false when experts.act aliases a buffer shared by layers (moe_act recompute)
  bool owns_shared_act = true;  // false when shared.h and shared.act do (shared_experts recompute)
};
// With share_scratch_with (a cache of the same shapes and dispatcher), the scratch tensors alias that cache's.
MoeLayerCache moe_layer_cache_alloc(const MoeLayerDims& d, const MoeConfig& cfg,
                                    const MoeLayerCache* share_scratch_with = nullptr);
// Full recompute (the model's --recompute-granularity full): the saved tensors a forward with route=false refills from
// the routing -- the dispatch plans and rows, the experts' and the shared expert's activations -- alias `from`'s (one
// set per layer position of a recomputed chunk); the routing itself (router cache, probs, map, statistics) stays this
// cache's own, so the recompute routes nothing again (no noise draw, no counter, no collective of the router).
void moe_layer_cache_share_refilled(MoeLayerCache& c, const MoeLayerCache& from);
// Whether the last forward of the layer with this cache overflowed the static received-token capacity.
bool moe_layer_overflowed(const MoeLayerCache& c);
// The model's memory plan: moe_layer_cache_bytes counts the saved tensors this cache allocated itself (the refilled
// ones when owned), once per cache; moe_layer_scratch_bytes the scratch, once per set of caches that share it.
int64_t moe_layer_cache_bytes(const MoeLayerCache& c);
int64_t moe_layer_scratch_bytes(const MoeLayerCache& c);

// x [T, H] compute dtype (the pre-MLP norm output, t = s * B + b); padding_mask [T] bool or undefined; y [T, H] f32
// written with the routed plus shared expert output. route=false (recompute): the cache's routing of the forward it
// repeats is used as it is, and the rest runs again (bitwise the same, collectives included).
void moe_layer_forward(Tensor& y, const Tensor& x, const Tensor& padding_mask, const MoeLayerWeights& w,
                       RouterState& st, MoeLayerCache& cache, Dispatcher& dispatcher, const MoeLayerDims& d,
                       const MoeConfig& cfg, bool training, const ops::Context& ctx, bool route = true);
// dy [T, H] f32; dx [T, H] f32 written. aux_grad_scale: Megatron's main_loss_backward_scale.
void moe_layer_backward(Tensor& dx, MoeLayerGrads& g, const Tensor& dy, const Tensor& x, const MoeLayerWeights& w,
                        MoeLayerCache& cache, Dispatcher& dispatcher, const MoeLayerDims& d, const MoeConfig& cfg,
                        float aux_grad_scale, const ops::Context& ctx);

}  // namespace moecore::moe
