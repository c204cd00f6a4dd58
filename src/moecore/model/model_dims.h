// The dims a model's layers read, from (configuration, parallel layout, micro-batch size) alone: the dense layers'
// (nn/dense_layer.h), MLA's (nn/mla.h) and the MoE layers' (moe/moe_layer.h), reconciled in one place. Under context
// parallelism S is this rank's S / CP positions of each sequence; T = B * S rows feed the GEMMs; N = T / TP rows of
// the residual stream under sequence parallelism (else T), which is also what the MoE layers take.
// Dimensions (B, S, N, T, H, F, E, K, ...): core/dims.h.
#pragma once
#include <cstdint>

#include "moecore/model/config.h"
#include "moecore/model/parallel_layout.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/nn/dense_layer.h"
#include "moecore/nn/mla.h"

namespace moecore::model {

struct ModelDims {
  nn::DenseLayerDims dense;
  nn::MlaDims mla;  // (set when some layer has MLA)
  moe::MoeLayerDims moe;
};
// The groups the dims point at are par's (keep par alive and in place). seed: ECHO's random offloading's.
ModelDims model_dims(const ModelConfig& cfg, const ModelParallel& par, int64_t micro_batch, uint64_t seed,
                     Device device);
// The ranks whose MoE rows together are whole sequences (the routers' losses gather over them): TP x CP under context
// parallelism, TP under sequence parallelism; null when this rank's rows are the whole micro-batch.
const ProcessGroup* moe_sequence_group(const ModelParallel& par);

}  // namespace moecore::model
