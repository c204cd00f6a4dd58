// The parallel layout a model is built for: its process groups (ModelParallel), Megatron's split of the decoder
// layers over pipeline stages and model chunks, which stage holds which parameter, and the checks of every size
// constraint of a layout against a configuration. Which ranks hold what, decided here once; GptModel builds this
// rank's part of the model from it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/moe/dispatcher.h"
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"

namespace moecore::model {

// The parallel layout a model is built for (size-1 groups, the default: one process).
//   tp, sequence_parallel: the tensor-parallel group of the attention and dense layers (--tensor-model-parallel-size)
//     and --sequence-parallel (nn/dense_layer.h); parameters hold their shards (Param::tp)
//   ep, dispatcher: the expert-parallel group (this rank holds experts [r*E/EP, (r+1)*E/EP) of each layer) and the
//     token dispatcher (--moe-token-dispatcher-type)
//   cp, tp_cp: the context-parallel group (--context-parallel-size; nn/context_parallel.h: this rank holds S / CP
//     positions of every sequence) and the group of TP x CP ranks, over which the MoE routers' losses see whole
//     sequences (docs/megatron-moe-spec.md §3)
//   etp, etp_ep: expert tensor parallelism (--expert-tensor-parallel-size; Parallel Folding: independent of tp): each
//     local expert's fc1 rows and fc2 columns split over etp (Param::tp of the expert weights), and the group of ETP x
//     EP ranks (ETP fastest) the allgather dispatcher gathers over
//   dp: the data-parallel group: global_aux_loss counts are summed over it
//   pp, virtual_stages, pipeline_layers: the pipeline (--pipeline-model-parallel-size), the model chunks of each stage
//     (--num-virtual-stages-per-pipeline-rank; 1: no interleaving) and the decoder layers of each virtual stage
//     k = chunk * pp + stage, in the model's order (pipeline_stage_layers; empty: every layer, at PP 1). Chunk c of
//     stage r holds the layers of virtual stage c * pp + r (parameters named by their global index); the first stage
//     holds the embeddings (used by its chunk 0), the last the final norm, the output layer, the MTP depths (its last
//     chunk's) and a copy of the word embeddings when the output layer is tied to them or MTP embeds with them
//     (Param::pipeline_copy)
struct ModelParallel {
  ProcessGroup tp = comm_single("tp");
  bool sequence_parallel = false;
  ProcessGroup cp = comm_single("cp");
  ProcessGroup tp_cp = comm_single("tp_cp");
  ProcessGroup ep = comm_single("ep");
  ProcessGroup etp = comm_single("etp");
  ProcessGroup etp_ep = comm_single("etp_ep");
  moe::DispatcherKind dispatcher = moe::DispatcherKind::alltoall;
  ProcessGroup dp = comm_single("dp");
  ProcessGroup pp = comm_single("pp");
  int64_t virtual_stages = 1;
  std::vector<int64_t> pipeline_layers;
  // Megatron-FSDP: the decoder layers' and MTP depths' gradients (fsdp_grads: optim_grads), and also their values and
  // compute copies (fsdp_params: optim_grads_params), are born without memory (Tensor::release_storage) for the FSDP
  // optimizer to take and give back as the passes need them; fsdp_params' initial values are drawn into the
  // optimizer's shards (GptModel::initial_values), so that no rank ever holds the whole model.
  bool fsdp_grads = false, fsdp_params = false;
};

// Megatron's split of num_layers decoder layers over pp stages of vpp model chunks each, by virtual stage
// k = chunk * pp + stage: even, or with --decoder-first-pipeline-num-layers (first) and/or
// --decoder-last-pipeline-num-layers (last; -1: unset) on those stages and the rest split evenly over the others; each
// stage's layers split evenly over its chunks. With embedding / loss (--account-for-embedding-in-pipeline-split,
// --account-for-loss-in-pipeline-split; without first / last) each counts as a layer: num_layers plus them split evenly
// over the pp * vpp virtual stages, the first holding one decoder layer fewer for the embedding, the last one fewer for
// the loss. Error naming the values when they do not split (every stage holds at least one layer, unless the embedding
// or loss takes its place; with vpp > 1 each stage's count divides by vpp).
std::vector<int64_t> pipeline_stage_layers(int64_t num_layers, int64_t pp, int64_t first = -1, int64_t last = -1,
                                           int64_t vpp = 1, bool embedding = false, bool loss = false);
// The decoder layers of each virtual stage from Megatron's --pipeline-model-parallel-layout: stages split by '|',
// symbols E (embedding), t (decoder layer), m (MTP layer), L (loss), 'x*N' and '(...)*N' repeat, commas are ignored,
// empty stages are allowed ("E||t|L"). A layout of pp * v stages gives v model chunks per stage (virtual stage
// k = chunk * pp + stage, Megatron's order). moecore places the embedding first on the first stage and the MTP layers
// and the loss last on the last. Error naming the layout and what is wrong (syntax, counts, placement, a stage count
// that is not a multiple of pp).
std::vector<int64_t> pipeline_layout_stage_layers(const std::string& layout, int64_t num_layers, int64_t mtp_num_layers,
                                                  int64_t pp);
// The model's groups of a training layout; pipeline_layers as pipeline_stage_layers gives them (empty at PP 1), with
// pipeline_layers.size() / pp model chunks per stage.
ModelParallel model_parallel(const ProcessGroups& pg, bool sequence_parallel, moe::DispatcherKind dispatcher,
                             std::vector<int64_t> pipeline_layers = {});

// Whether this rank's pipeline stage (par.pp, par.pipeline_layers) holds the parameter `name`: its chunks' decoder
// layers; the embeddings on the first stage (and the word embeddings' copy on the last,
// pipeline_word_embeddings_copy); the final norm, the output layer and MTP on the last. Every parameter at PP 1.
bool pipeline_stage_holds(const std::string& name, const ModelConfig& cfg, const ModelParallel& par);
// Whether the last stage of pp holds a copy of the word embeddings (tied output layer, or MTP embedding there).
bool pipeline_word_embeddings_copy(const ModelConfig& cfg, const ProcessGroup& pp);

// This rank's pipeline stage of a model: its model chunks and where each layer is.
struct StageLayout {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // per model chunk of the stage: its decoder layers [first, end)
  // Per layer (decoder, then MTP): the chunk of this stage that holds it (MTP: the last stage's last chunk), or -1.
  std::vector<int64_t> layer_chunk;
  bool first_stage = true, last_stage = true;  // holds the embeddings / the final norm, output layer and MTP
};
// Checks every size constraint of the layout against the configuration, from the configuration alone (no collective,
// so a bad layout fails identically on every rank), and returns this rank's stage. As Megatron, sequence parallelism
// needs TP > 1: par.sequence_parallel is cleared at TP 1.
StageLayout check_layout(const ModelConfig& cfg, ModelParallel& par);

}  // namespace moecore::model
