// The distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer): AdamW whose moments are
// sharded over a process group. Gradients are reduce-scattered bucket by bucket, each rank updates the
// slice of the parameters it owns, and the updated f32 masters are all-gathered back into every rank's
// Param::value. With `overlap` the reduce-scatters can be posted bucket by bucket while backward still runs
// (--overlap-grad-reduce) and the all-gathers left in flight into the next forward (--overlap-param-gather).
// With several instances (Megatron's --num-distributed-optimizer-instances) the state is sharded within the group
// and every shard is all-reduced across the instances after its reduce-scatter.
// Not here: the global norm over several groups (the caller all-reduces shard_grad_sq()) and bf16 compute copies
// (Param::compute is left to the caller).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moecore/core/param.h"
#include "moecore/kernels/ops.h"
#include "moecore/optim/adamw.h"
#include "moecore/parallel/comm.h"

namespace moecore::optim {

struct DistributedAdamWOptions {
  int64_t bucket_elems = 10'000'000;  // elements per gradient bucket, e.g. 10M (a larger parameter is alone)
  // Every bucket gets a staging area of its own (about one more gradient's worth of memory), so that all of
  // them can be in flight at once: needed by the overlapped forms below.
  bool overlap = false;
  // Megatron-FSDP (optim_grads, optim_grads_params): the bucket boundaries, given instead of cut by bucket_elems --
  // bucket k holds params [bucket_ends[k - 1], bucket_ends[k]) (bucket_ends[-1] = 0), ascending, the last
  // params.size(). One bucket per FSDP unit, one per parameter outside the units.
  std::vector<size_t> bucket_ends = {};
  // optim_grads_params: the f32 masters live in this rank's shard of them, not in Param::value, which the caller may
  // release between uses (Tensor::release_storage) and fills by wait_gather.
  bool shard_params = false;
  // Megatron-FSDP's --megatron-fsdp-main-grads-dtype and --megatron-fsdp-grad-comm-dtype (f32 or bf16), for
  // reduce_bucket: the gradients are reduce-scattered in comm_dtype and accumulated in grad_dtype; finish_main_grads
  // turns the sum into the f32 shard the update reads.
  DType grad_dtype = DType::f32;
  DType comm_dtype = DType::f32;
  // Megatron-FSDP's --megatron-fsdp-main-params-dtype, with shard_params: the masters kept and updated in f32, bf16 or
  // f16 (each update computed in f32 and rounded to nearest even, ops::adamw_step) and gathered in that dtype;
  // Param::value receives them widened, exactly.
  DType master_dtype = DType::f32;
  // Megatron-FSDP's HFSDP (--outer-dp-sharding-strategy optim), with shard_params and instances: the moments and the
  // update sharded over the instances too. Each bucket's shard (the bucket padded to group x instances) splits into
  // one piece per instance, this rank's the instances' rank-th; finish_main_grads reduce-scatters the accumulated shard
  // over the instances into its piece (HSDP all-reduces it), update() steps the piece and all-gathers the pieces back
  // into the master shard. The masters stay whole over the group's shard (Megatron's inner-layout helper buffer).
  bool shard_over_instances = false;
  // shard_params: the initial values of elements [first, first + dst.numel()) of parameter i (an index into the
  // constructor's vector), for the parameters whose value is released when the masters are taken at construction
  // (born in the shards: no rank holds them whole); dst f32.
  std::function<void(size_t i, int64_t first, Tensor& dst)> initial_values = {};
};

// Layout. The parameters sit in one flat index space in `params` order, cut into buckets of whole
// parameters holding about bucket_elems elements. Bucket b of n_b elements is padded to
// N_b = ceil(n_b / P) * P (shard_over_instances: to a multiple of P x instances) and rank r owns its elements
// [r * N_b / P, (r + 1) * N_b / P). A rank's shard is the concatenation of its owned ranges over the buckets
// (shard_elems() in all); padding is never updated and never reaches a parameter.
//
// Bitwise contract: step(lr, s) leaves every Param::value bitwise equal to optim::AdamW::step on the
// group-summed gradients ((g_0 + g_1) + g_2) + ... with clip scale s, provided every rank starts from
// the same values (AdamW is elementwise; the sums are moecore's deterministic rank-ordered ones). With instances the
// sum is each instance's rank-ordered group sum, then those sums in instance order: (G_0 + G_1) + ...
//
// Instances: every instance holds the same shards (the same bits), so the group alone gathers the state, the
// parameters and, summed over the group (and the caller's other groups), the squared norm; each instance is a full
// copy of the optimizer.
//
// Every member of the group calls the collective methods in the same order (comm.h rules). Not
// thread-safe. The Param pointers stay owned by the caller and must outlive this object; their value
// and grad are contiguous f32 CPU tensors and may be replaced by tensors of the same shape.
class DistributedAdamW {
 public:
  // Collective over the group and then the instances (checks that every rank passes parameters with identical names,
  // shapes and order, and every instance the same group size, and throws moecore::Error naming the first difference
  // and ranks otherwise). Allocates the moments (MemCategory::optimizer_state) and all flat buffers once.
  // `instances`, for the partial distributed optimizer (Megatron's --num-distributed-optimizer-instances N > 1): the
  // ranks holding this rank's shard in the other instances, in instance order (inter_dist_opt in process_groups.h,
  // e.g. 2 ranks); each bucket's shard, reduce-scattered within the group, is then all-reduced over it (Megatron's
  // two-step gradient reduction). Default-constructed or of size 1: one instance.
  DistributedAdamW(std::vector<Param*> params, const AdamWConfig& cfg, const ProcessGroup& group,
                   DistributedAdamWOptions opt = {}, const ProcessGroup& instances = ProcessGroup());

  // Collective. Bucketed reduce-scatter of the gradients (and all-reduce over the instances): afterwards this rank's
  // shard holds the SUM of the gradients over the group (and instances). The params' .grad tensors are read (they may
  // be modified afterwards).
  void reduce_scatter_grads();
  // The same, overlapped (options.overlap): begin_grad_reduction(), then grad_ready(i) once for every parameter i
  // (an index into the constructor's vector), in any order, as soon as its gradient is final: a bucket's
  // nonblocking reduce-scatter is posted when its last parameter is ready, and its all-reduce over the instances once
  // that has completed (tested in posting order at each grad_ready). finish_grad_reduction() waits for them all
  // (posting any bucket not yet complete); the shard then holds the same bits as after reduce_scatter_grads().
  // Collective: every rank readies the parameters in the same order.
  void begin_grad_reduction();
  void grad_ready(size_t i);
  void finish_grad_reduction();
  // Megatron-FSDP's reduction every micro-batch (optim_grads, optim_grads_params): zero_shard_grads() before a step's
  // first micro-batch, then reduce_bucket(b) whenever bucket b's gradients hold a micro-batch's contribution: they are
  // reduce-scattered and this rank's part added into its shard (shard += sum over the group), in call order (the
  // same on every rank). The params' .grad tensors are read, not changed. Collective over the group.
  void zero_shard_grads();
  void reduce_bucket(size_t b);
  // After the step's last reduce_bucket: with instances (hybrid sharding, HSDP) the accumulated shard all-reduced over
  // them (Megatron-FSDP's outer reduction, once per step; shard_over_instances: reduce-scattered into this rank's
  // piece), then the main gradients (options' grad_dtype) cast to f32 into the shard the update, the norm and the
  // checks read (Megatron-FSDP's gradients cast to the main parameters' dtype). Collective over the instances.
  void finish_main_grads();
  // shard_params: bucket b's masters all-gathered into Param::value of its parameters (resident, Tensor::resident):
  // post_gather(b) posts it into one of two staging areas (at most two in flight: a third waits for the oldest);
  // wait_gather(b) completes it (posting it first when it was not); values released meanwhile get nothing (the gathered
  // data is dropped). Collective over the group, in the same order on every rank.
  void post_gather(size_t b);
  void wait_gather(size_t b);
  // shard_params: this rank's owned ranges of Param::value copied into its master shard (after a checkpoint load wrote
  // the values; at construction a released value's from options' initial_values). With a master dtype narrower than
  // f32 every resident value is first rounded to it in place, so that each rank holds what the gathers bring. Local.
  void take_masters_from_values(const std::function<void(size_t i, int64_t first, Tensor& dst)>& initial_values = {});
  size_t bucket_of(size_t i) const { return bucket_of_param_.at(i); }
  std::pair<size_t, size_t> bucket_params(size_t b) const { return {buckets_[b].first_param, buckets_[b].end_param}; }
  // The norms, counts and checks below read the part of the shard this rank updates: the whole shard, or under
  // shard_over_instances its piece (then summed over the instances too).
  bool shards_over_instances() const { return over_instances_; }
  // Sum of squares of this rank's reduced-gradient shard, in double. All-reduced over the group (and
  // over other groups' shares) it is the squared global gradient norm.
  double shard_grad_sq() const;
  // Sum of squares of this rank's owned ranges of the f32 masters (Param::value), in double: all-reduced over the group
  // it is the squared norm of the parameters (Megatron's calc_params_l2_norm over sharded main params). Current after
  // update(), while later gathers are still in flight. Local.
  double shard_param_sq() const;
  // The zero elements of this rank's reduced-gradient shard once multiplied by clip_scale (ops::count_zeros): summed
  // over the group, Megatron's count_zeros_fp32 of the distributed optimizer. Local.
  int64_t shard_grad_zeros(float clip_scale) const;
  // Multiplies this rank's reduced-gradient shard by s (a loss scale's inverse, the per-token normalisation). Local.
  void scale_shard_grads(float s);
  // Name of the first parameter with a non-finite element in this rank's shard, "" if none. Local.
  std::string first_nonfinite_grad() const;
  // Collective. One AdamW update of this rank's shard (shard_over_instances: of its piece, the pieces then gathered
  // over the instances; shard_params: of its master shard, gathered back only into the resident Param::value of each
  // bucket; the others wait for wait_gather) (learning rate lr, gradients times clip_scale, weight decay for params
  // with weight_decay, bias correction with the step count), then all-gather of the updated f32 masters into every
  // param's .value, bucket by bucket. Does not refresh Param::compute. With gather_later (options.overlap) the
  // all-gathers are posted and left in flight: until wait_param(i) (its bucket) or finish_param_gather() (all) a
  // Param::value may hold old values. Values end bitwise the same.
  void step(float lr, float clip_scale, bool gather_later = false);
  // step() in its two parts (timed apart by the trainer): update() is the local AdamW update of this rank's shard into
  // its owned ranges of Param::value (gathers still in flight are completed first); gather_params() then all-gathers
  // every rank's ranges (posted and left in flight with `later`). Collective: gather_params.
  void update(float lr, float clip_scale);
  void gather_params(bool later);
  void wait_param(size_t i);
  void finish_param_gather();
  bool param_gather_pending() const { return gathers_pending_ > 0; }

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }

  // Checkpoints. Collective: every rank receives the full moments of every parameter, shaped like the
  // parameter, in cfg.state_dtype (freshly allocated, MemCategory::other).
  void gather_state(std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq) const;
  // Local: from full moments (one per parameter, same shapes, any float dtype; converted to
  // cfg.state_dtype), each rank keeps its own shard.
  void load_state(const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq);

  int64_t shard_elems() const { return shard_elems_; }  // elements of this rank's shard (its gradients, its masters)
  int64_t state_elems() const { return state_elems_; }  // optimizer-state elements on this rank, per moment
  int64_t state_bytes() const;                          // bytes of both moments on this rank
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  const ProcessGroup& group() const { return group_; }
  const ProcessGroup& instances() const { return instances_; }  // size 1 without the partial distributed optimizer
  const AdamWConfig& config() const { return cfg_; }

 private:
  struct Bucket {
    size_t first_param = 0, end_param = 0;      // params [first_param, end_param)
    int64_t elems = 0;                          // n_b, unpadded
    int64_t shard = 0;                          // N_b / P
    int64_t shard_offset = 0;                   // where this bucket's owned range starts in the rank's shard
    size_t first_segment = 0, end_segment = 0;  // its pieces in segments_
  };
  // A piece of one parameter inside this rank's owned range of one bucket.
  struct Segment {
    size_t param = 0;
    int64_t param_offset = 0;  // first element within the parameter
    int64_t shard_offset = 0;  // first element within this rank's shard
    int64_t elems = 0;
    int64_t state_offset = 0;  // first element within the moments (owned_ only)
  };
  void check_same_params_across_ranks(const ProcessGroup& g) const;
  void plan_layout(int64_t bucket_elems, const std::vector<size_t>& bucket_ends);
  Tensor master(const Segment& s) const;  // the segment's masters: in master_ (shard_params) or Param::value (f32)
  bool bucket_resident(size_t b) const;   // every parameter's value of bucket b resident
  void apply_segment(const Segment& s, float lr, float clip_scale);

  std::vector<Param*> params_;
  std::vector<int64_t> param_offsets_;  // each parameter's first element within its bucket
  std::vector<int64_t> param_elems_;    // each parameter's element count, fixed at construction
  AdamWConfig cfg_;
  ProcessGroup group_;
  Device device_ = Device::cpu;
  ops::Context ctx() const {
    return ops::Context{device_};
  }  // where the parameters live (and so the shards and staging buffers)
  std::vector<Bucket> buckets_;
  std::vector<Segment> segments_;  // in parameter order
  // The segments this rank updates, in order: segments_, or under shard_over_instances their parts in its pieces.
  std::vector<Segment> owned_;
  bool over_instances_ = false;
  int64_t state_elems_ = 0;
  Tensor piece_grad_, piece_master_;  // shard_over_instances: one bucket's piece, in the accumulated gradients' and
                                      // in the masters' dtype
  int64_t piece_elems(const Bucket& b) const { return b.shard / instances_.size(); }
  void plan_owned();
  void gather_pieces();
  // Overlap (options.overlap): bucket b stages in bucket_staging_[b, b + N_b) of overlap_staging_; its owned
  // range is packed at its shard offset in overlap_shard_.
  bool overlap_ = false;
  Tensor overlap_staging_;                  // [sum of N_b] f32
  Tensor overlap_shard_;                    // [shard_elems] f32: updated masters to all-gather
  std::vector<int64_t> bucket_staging_;     // per bucket
  std::vector<size_t> bucket_of_param_;     // per parameter
  std::vector<int64_t> ready_left_;         // per bucket: parameters whose gradient is not final yet
  std::vector<char> param_ready_;           // per parameter: declared ready in the open reduction
  std::vector<CommHandle> grad_handles_;    // per bucket
  std::vector<CommHandle> gather_handles_;  // per bucket
  int64_t gathers_pending_ = 0;
  bool reducing_ = false;
  // Instances: the buckets in the order their reduce-scatters were posted; those before `instances_next_` have their
  // all-reduce over the instances posted too (same order on every rank), into instance_handles_.
  ProcessGroup instances_;
  std::vector<size_t> posted_;
  size_t instances_next_ = 0;
  std::vector<CommHandle> instance_handles_;  // per bucket
  void post_reduce_scatter(size_t b);
  void post_instance_reductions(bool wait);
  void check_grad(size_t i) const;
  void check_overlap(const char* what) const;
  int64_t shard_elems_ = 0;
  int64_t step_ = 0;
  Tensor sq_acc_;     // [1] f64: the shard's squared gradient norm, summed on the device and read once
  Tensor zeros_acc_;  // [1] i64: the shard's zero gradient elements (shard_grad_zeros)
  Tensor nonfinite_;  // [segments] i32: per segment, 1 when its gradient holds a NaN or an infinity
  mutable std::vector<int32_t> nonfinite_host_;  // its host copy (sized once: the check allocates nothing after)
  Tensor staging_;                               // [max N_b] f32: gradients to reduce-scatter, then gathered masters
  Tensor shard_grad_;                            // [shard_elems] f32: this rank's share of the summed gradients
  Tensor shard_param_;                           // [max N_b / P] f32: updated masters of one bucket, to all-gather
  Tensor exp_avg_;                               // [shard_elems] state_dtype
  Tensor exp_avg_sq_;                            // [shard_elems] state_dtype
  // shard_params: the masters of this rank's shard, and two staging areas of the largest padded bucket for gathers.
  bool shard_params_ = false;
  Tensor master_;  // [shard_elems] master_dtype (padding zero)
  // reduce_bucket with comm_dtype or grad_dtype other than f32: the staging and scratch in comm_dtype, the
  // accumulated main gradients in grad_dtype (undefined when f32: staging_, shard_param_ and shard_grad_ serve).
  Tensor comm_staging_, comm_part_, main_grad_;
  Tensor gather_staging_[2];                // [max N_b] master_dtype
  std::vector<int> gather_slot_;            // per bucket: its staging area while posted, else -1
  std::vector<size_t> gather_order_;        // buckets posted, oldest first
  std::vector<CommHandle> bucket_gathers_;  // per bucket
};

}  // namespace moecore::optim
