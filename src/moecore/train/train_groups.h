// The process groups of a multi-process training run. Megatron's semantics: the data-parallel group `dp`
// splits every global batch (with EP it contains the EP ranks: expert parallelism folds into data parallelism for
// the attention layers); `tp` is the model's tensor-parallel group and `cp` its context-parallel group (their ranks
// see the same batch); `ep` is the model's expert-parallel group and `etp` its expert-tensor-parallel group (the
// ranks holding the other slices of the same experts); `edp` holds the ranks with the same expert slices.
// Non-expert gradients are summed over dp x cp (`dp_cp`: each CP rank holds a part of every sequence), expert
// gradients over edp (after the model has summed its tp_grad_sum parameters over tp). `pp` is the pipeline: the ranks
// holding the other stages of the same model replica; every other group lies within one stage.
// The partial distributed optimizer (--num-distributed-optimizer-instances N > 1) shards its state within one of N
// instances -- `intra_dp_cp` for non-expert, `intra_edp` for expert parameters -- and all-reduces the reduce-scattered
// shards over `inter_dist_opt`, the same place in every instance (Megatron's groups, process_groups.h).
#pragma once
#include "moecore/parallel/comm.h"
#include "moecore/parallel/process_groups.h"

namespace moecore::train {

struct TrainGroups {
  ProcessGroup dp = comm_single("dp");
  ProcessGroup ep = comm_single("ep");
  ProcessGroup etp = comm_single("etp");
  ProcessGroup etp_ep = comm_single("etp_ep");  // every distinct expert slice of a layer: etp x ep
  ProcessGroup edp = comm_single("edp");
  ProcessGroup tp = comm_single("tp");
  ProcessGroup tp_dp = comm_single("tp_dp");  // every rank of the stage, tp x dp x cp (checkpoints); when tp or cp > 1
  ProcessGroup cp = comm_single("cp");
  ProcessGroup dp_cp = comm_single("dp_cp");  // needed when cp > 1
  ProcessGroup tp_cp = comm_single("tp_cp");  // needed when cp > 1
  ProcessGroup pp = comm_single("pp");
  ProcessGroup intra_dp_cp = comm_single("intra_dp_cp");        // with N > 1: one instance of dense_grads()
  ProcessGroup intra_edp = comm_single("intra_edp");            // with N > 1: one instance of edp
  ProcessGroup inter_dist_opt = comm_single("inter_dist_opt");  // with N > 1: across the N instances
  // The group non-expert gradients are summed over.
  const ProcessGroup& dense_grads() const { return cp.size() > 1 ? dp_cp : dp; }
  int stage_size() const { return dp.size() * tp.size() * cp.size(); }  // the ranks of one pipeline stage
  int world_size() const { return stage_size() * pp.size(); }
};

// The groups of a training layout (every rank of the world: tp_dp is tp x dp x cp).
inline TrainGroups train_groups(const ProcessGroups& pg) {
  TrainGroups g;
  g.dp = pg.dp();
  g.ep = pg.ep();
  g.etp = pg.etp();
  g.etp_ep = pg.etp_ep();
  g.edp = pg.edp();
  g.tp = pg.tp();
  g.tp_dp = pg.tp_dp_cp();
  g.cp = pg.cp();
  g.dp_cp = pg.dp_cp();
  g.tp_cp = pg.tp_cp();
  g.pp = pg.pp();
  g.intra_dp_cp = pg.intra_dp_cp();
  g.intra_edp = pg.intra_edp();
  g.inter_dist_opt = pg.inter_dist_opt();
  return g;
}

}  // namespace moecore::train
