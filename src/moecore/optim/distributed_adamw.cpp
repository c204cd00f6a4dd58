// The distributed optimizer. Every rank already holds the f32 masters in Param::value, so the owner
// updates its slice in place (ops::adamw_step on 1-D views, hence the same bits as optim::AdamW) and the
// all-gather overwrites everyone's copy; no separate master shard is kept. One staging buffer sized to the
// largest bucket serves both the reduce-scatter input and the all-gather output; the overlapped forms give every
// bucket a staging area of its own (its reduce-scatter's input, then its gather's output) so that all can be in flight.
// Instances add one all-reduce of each bucket's shard over `instances` after its reduce-scatter (Megatron's
// param_and_grad_buffer start_grad_sync); everything else runs within the group.
#include "moecore/optim/distributed_adamw.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>

#include "moecore/kernels/ops.h"

namespace moecore::optim {
namespace {

int64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

Tensor flat(const Tensor& t) {
  return t.view(Shape{t.numel()});
}

// Elements [first, first + n) of a 1-D tensor.
Tensor range(const Tensor& t, int64_t first, int64_t n) {
  return t.slice(0, first, first + n);
}

}  // namespace

DistributedAdamW::DistributedAdamW(std::vector<Param*> params, const AdamWConfig& cfg, const ProcessGroup& group,
                                   DistributedAdamWOptions opt, const ProcessGroup& instances)
    : params_(std::move(params)), cfg_(cfg), group_(group) {
  if (!group_.valid()) MOECORE_FAIL("distributed optimizer: the process group is not initialized");
  // The cross-rank checks come before any local one, so a local error cannot leave peers waiting in them.
  check_same_params_across_ranks(group_);
  if (instances.valid() && instances.size() > 1) {
    check_same_params_across_ranks(instances);
    // Overlapped, a communicator of its own: the all-reduces are posted as reduce-scatters complete, an order that
    // other optimizers sharing `instances` cannot interleave with alike on every rank.
    instances_ =
        opt.overlap ? group_split(instances, instances.name() + "_" + group_.name(), {instances.ranks()}) : instances;
  } else {
    instances_ = comm_single("instances");
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i]) MOECORE_FAIL("distributed optimizer: parameter ", i, " is a null pointer");
  cfg_.validate();
  if (opt.bucket_elems < 1)
    MOECORE_FAIL("distributed optimizer: bucket_elems (", opt.bucket_elems, ") must be at least 1");
  if (!params_.empty() && params_[0]->value.defined()) device_ = params_[0]->value.device();
  for (const Param* p : params_) {
    if (!p->value.defined() || p->value.dtype() != DType::f32 || !p->value.is_contiguous() ||
        p->value.device() != device_)
      MOECORE_FAIL("distributed optimizer: parameter '", p->name, "' has value ",
                   p->value.defined() ? p->value.str() : std::string("(undefined)"),
                   "; it needs a contiguous f32 tensor on ", device_name(device_), " like the first parameter");
  }
  if (!opt.bucket_ends.empty()) {
    for (size_t k = 0; k < opt.bucket_ends.size(); ++k)
      if (opt.bucket_ends[k] <= (k ? opt.bucket_ends[k - 1] : 0) || opt.bucket_ends[k] > params_.size())
        MOECORE_FAIL("distributed optimizer: bucket_ends must rise from above 0 to the parameter count (",
                     params_.size(), "); entry ", k, " is ", opt.bucket_ends[k]);
    if (opt.bucket_ends.back() != params_.size())
      MOECORE_FAIL("distributed optimizer: the last of bucket_ends (", opt.bucket_ends.back(),
                   ") must be the parameter count (", params_.size(), ")");
  }
  for (DType t : {opt.grad_dtype, opt.comm_dtype})
    if (t != DType::f32 && t != DType::bf16)
      MOECORE_FAIL("distributed optimizer: gradients are reduced and accumulated in f32 or bf16, not ", dtype_name(t));
  if (opt.master_dtype != DType::f32 && (!opt.shard_params || !dtype_is_float(opt.master_dtype)))
    MOECORE_FAIL("distributed optimizer: masters in ", dtype_name(opt.master_dtype),
                 " need shard_params and a float dtype (f32, bf16 or f16)");
  if (opt.shard_over_instances && (!opt.shard_params || instances_.size() < 2))
    MOECORE_FAIL("distributed optimizer: shard_over_instances needs shard_params and more than one instance");
  over_instances_ = opt.shard_over_instances;
  if (opt.shard_params && opt.overlap)
    MOECORE_FAIL("distributed optimizer: shard_params gathers bucket by bucket (post_gather); it excludes overlap");
  plan_layout(opt.bucket_elems, opt.bucket_ends);
  plan_owned();
  int64_t max_padded = 0;
  for (const Bucket& b : buckets_) max_padded = std::max(max_padded, b.shard * group_.size());
  staging_ = Tensor::zeros(Shape{max_padded}, DType::f32, MemCategory::workspace, device_);
  shard_param_ = Tensor::zeros(Shape{max_padded / group_.size()}, DType::f32, MemCategory::workspace, device_);
  shard_grad_ = Tensor::zeros(Shape{shard_elems_}, DType::f32, MemCategory::gradients, device_);
  exp_avg_ = Tensor::zeros(Shape{state_elems_}, cfg_.state_dtype, MemCategory::optimizer_state, device_);
  exp_avg_sq_ = Tensor::zeros(Shape{state_elems_}, cfg_.state_dtype, MemCategory::optimizer_state, device_);
  sq_acc_ = Tensor::zeros(Shape{1}, DType::f64, MemCategory::workspace, device_);
  zeros_acc_ = Tensor::zeros(Shape{1}, DType::i64, MemCategory::workspace, device_);
  nonfinite_ = Tensor::zeros(Shape{std::max<int64_t>(1, static_cast<int64_t>(owned_.size()))}, DType::i32,
                             MemCategory::workspace, device_);
  overlap_ = opt.overlap;
  shard_params_ = opt.shard_params;
  if (opt.comm_dtype != DType::f32) {
    comm_staging_ = Tensor::zeros(Shape{max_padded}, opt.comm_dtype, MemCategory::workspace, device_);
    comm_part_ = Tensor::zeros(Shape{max_padded / group_.size()}, opt.comm_dtype, MemCategory::workspace, device_);
  }
  if (opt.grad_dtype != DType::f32)
    main_grad_ = Tensor::zeros(Shape{shard_elems_}, opt.grad_dtype, MemCategory::gradients, device_);
  if (shard_params_) {
    master_ = Tensor::zeros(Shape{shard_elems_}, opt.master_dtype, MemCategory::parameters, device_);
    take_masters_from_values(opt.initial_values);
    for (Tensor& t : gather_staging_)
      t = Tensor::empty(Shape{max_padded}, opt.master_dtype, MemCategory::workspace, device_);
    if (over_instances_) {
      const Shape piece{max_padded / group_.size() / instances_.size()};
      piece_grad_ = Tensor::empty(piece, opt.grad_dtype, MemCategory::workspace, device_);
      piece_master_ = Tensor::empty(piece, opt.master_dtype, MemCategory::workspace, device_);
    }
    gather_slot_.assign(buckets_.size(), -1);
    bucket_gathers_.resize(buckets_.size());
  }
  bucket_of_param_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t i = buckets_[b].first_param; i < buckets_[b].end_param; ++i) bucket_of_param_[i] = b;
  if (overlap_) {
    int64_t total = 0;
    for (const Bucket& b : buckets_) {
      bucket_staging_.push_back(total);
      total += b.shard * group_.size();
    }
    overlap_staging_ = Tensor::zeros(Shape{total}, DType::f32, MemCategory::workspace, device_);
    overlap_shard_ = Tensor::zeros(Shape{shard_elems_}, DType::f32, MemCategory::workspace, device_);
    grad_handles_.resize(buckets_.size());
    gather_handles_.resize(buckets_.size());
    instance_handles_.resize(buckets_.size());
  }
}

void DistributedAdamW::check_same_params_across_ranks(const ProcessGroup& g) const {
  const int P = g.size();
  if (P == 1) return;
  // Two words per rank: its parameter count and the size of the group its state is sharded over.
  std::vector<int64_t> count = {static_cast<int64_t>(params_.size()), group_.size()};
  std::vector<int64_t> counts(2 * static_cast<size_t>(P));
  all_gather(std::span<int64_t>(counts), std::span<const int64_t>(count), g);
  for (int r = 1; r < P; ++r) {
    if (counts[2 * static_cast<size_t>(r)] != counts[0])
      MOECORE_FAIL("distributed optimizer (group '", g.name(), "'): rank 0 passes ", counts[0], " parameters but rank ",
                   r, " passes ", counts[2 * static_cast<size_t>(r)],
                   "; every rank of the group must pass the same parameters in the same order");
    if (counts[2 * static_cast<size_t>(r) + 1] != counts[1])
      MOECORE_FAIL("distributed optimizer (instances '", g.name(), "'): rank 0 shards its state over ", counts[1],
                   " ranks but rank ", r, " over ", counts[2 * static_cast<size_t>(r) + 1],
                   "; every instance must be sharded alike");
  }
  // Two words per parameter: its element count and a hash of its name and shape.
  const size_t n = params_.size();
  std::vector<int64_t> mine(2 * n), all(2 * n * static_cast<size_t>(P));
  for (size_t i = 0; i < n; ++i) {
    const Param* p = params_[i];
    mine[2 * i] = p ? p->value.numel() : -1;
    mine[2 * i + 1] = p ? fnv1a(p->name + '\0' + p->value.shape().str()) : 0;
  }
  all_gather(std::span<int64_t>(all), std::span<const int64_t>(mine), g);
  for (size_t i = 0; i < n; ++i) {
    for (int r = 1; r < P; ++r) {
      const int64_t* a = &all[2 * i];
      const int64_t* b = &all[2 * n * static_cast<size_t>(r) + 2 * i];
      if (a[0] == b[0] && a[1] == b[1]) continue;
      const Param* p = params_[i];
      MOECORE_FAIL("distributed optimizer (group '", g.name(), "'): parameter ", i, " ('",
                   p ? p->name : std::string("null"), "', ", p ? p->value.shape().str() : std::string("-"),
                   " on group rank ", g.rank(), ") differs between rank 0 (", a[0], " elements) and rank ", r, " (",
                   b[0], " elements", a[0] == b[0] ? ", another name or shape" : "",
                   "); every rank of the group must pass the same parameters in the same order");
    }
  }
}

void DistributedAdamW::plan_layout(int64_t bucket_elems, const std::vector<size_t>& bucket_ends) {
  const int64_t P = group_.size(), r = group_.rank(), N = over_instances_ ? instances_.size() : 1;
  param_offsets_.assign(params_.size(), 0);
  param_elems_.clear();
  for (const Param* p : params_) param_elems_.push_back(p->value.numel());
  auto close = [&](Bucket& b, size_t end) {
    b.end_param = end;
    b.shard = (b.elems + P * N - 1) / (P * N) * N;  // (shard_over_instances: N pieces)
    b.shard_offset = shard_elems_;
    b.first_segment = segments_.size();
    const int64_t lo = r * b.shard, hi = lo + b.shard;  // this rank's owned range, bucket-local
    for (size_t i = b.first_param; i < b.end_param; ++i) {
      const int64_t start = std::max(lo, param_offsets_[i]);
      const int64_t end_elem = std::min(hi, param_offsets_[i] + param_elems_[i]);
      if (start < end_elem)
        segments_.push_back({i, start - param_offsets_[i], b.shard_offset + (start - lo), end_elem - start});
    }
    b.end_segment = segments_.size();
    shard_elems_ += b.shard;
    buckets_.push_back(b);
  };
  Bucket cur;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = param_elems_[i];
    const bool cut = bucket_ends.empty()
                         ? cur.elems > 0 && cur.elems + n > bucket_elems
                         : i > 0 && std::find(bucket_ends.begin(), bucket_ends.end(), i) != bucket_ends.end();
    if (cut) {
      close(cur, i);
      cur = Bucket{};
      cur.first_param = i;
    }
    param_offsets_[i] = cur.elems;
    cur.elems += n;
  }
  if (cur.elems > 0 || (!bucket_ends.empty() && !params_.empty())) close(cur, params_.size());
}

// The moments follow the shard (state_offset = shard_offset), or under shard_over_instances this rank's piece of each
// bucket: elements [o * n, (o + 1) * n) of the bucket's shard for instance rank o and pieces of n, at offset
// shard_offset / N in the moments.
void DistributedAdamW::plan_owned() {
  if (!over_instances_) {
    owned_ = segments_;
    for (Segment& s : owned_) s.state_offset = s.shard_offset;
    state_elems_ = shard_elems_;
    return;
  }
  const int64_t N = instances_.size(), o = instances_.rank();
  for (const Bucket& b : buckets_) {
    const int64_t n = piece_elems(b), lo = b.shard_offset + o * n, hi = lo + n;
    for (size_t k = b.first_segment; k < b.end_segment; ++k) {
      const Segment& s = segments_[k];
      const int64_t start = std::max(lo, s.shard_offset), end = std::min(hi, s.shard_offset + s.elems);
      if (start < end)
        owned_.push_back({s.param, s.param_offset + (start - s.shard_offset), start, end - start,
                          b.shard_offset / N + (start - lo)});
    }
  }
  state_elems_ = shard_elems_ / N;
}

Tensor DistributedAdamW::master(const Segment& s) const {
  return shard_params_ ? range(master_, s.shard_offset, s.elems)
                       : range(flat(params_[s.param]->value), s.param_offset, s.elems);
}

bool DistributedAdamW::bucket_resident(size_t b) const {
  for (size_t i = buckets_[b].first_param; i < buckets_[b].end_param; ++i)
    if (!params_[i]->value.resident()) return false;
  return true;
}

void DistributedAdamW::zero_shard_grads() {
  shard_grad_.zero_();
  if (main_grad_.defined()) main_grad_.zero_();
}

void DistributedAdamW::reduce_bucket(size_t b) {
  const Bucket& k = buckets_.at(b);
  const int64_t padded = k.shard * group_.size();
  const Tensor& staging = comm_staging_.defined() ? comm_staging_ : staging_;
  for (size_t i = k.first_param; i < k.end_param; ++i) {
    check_grad(i);
    range(staging, param_offsets_[i], param_elems_[i]).copy_from(flat(params_[i]->grad));
  }
  range(staging, k.elems, padded - k.elems).zero_();
  // (the scratch of one bucket's shard)
  const Tensor part = range(comm_part_.defined() ? comm_part_ : shard_param_, 0, k.shard);
  reduce_scatter_sum(part, range(staging, 0, padded), group_);
  Tensor shard = range(main_grad_.defined() ? main_grad_ : shard_grad_, k.shard_offset, k.shard);
  ops::add(shard, shard, part, ctx());  // (in f32, rounded to the accumulator's dtype)
}

void DistributedAdamW::finish_main_grads() {
  const Tensor& acc = main_grad_.defined() ? main_grad_ : shard_grad_;
  if (over_instances_) {  // each bucket's shard summed over the instances into this rank's piece (in f32 after)
    for (const Bucket& b : buckets_) {
      const int64_t n = piece_elems(b), at = b.shard_offset + instances_.rank() * n;
      const Tensor piece = range(piece_grad_, 0, n);
      reduce_scatter_sum(piece, range(acc, b.shard_offset, b.shard), instances_);
      range(shard_grad_, at, n).copy_from(piece);
    }
    return;
  }
  if (instances_.size() > 1) all_reduce_sum(acc, instances_);
  if (main_grad_.defined()) shard_grad_.copy_from(main_grad_);
}

// shard_over_instances: every instance's updated piece of each bucket's masters gathered into the whole shard.
void DistributedAdamW::gather_pieces() {
  for (const Bucket& b : buckets_) {
    const int64_t n = piece_elems(b);
    Tensor piece = range(piece_master_, 0, n);
    piece.copy_from(range(master_, b.shard_offset + instances_.rank() * n, n));
    all_gather(range(master_, b.shard_offset, b.shard), piece, instances_);
  }
}

void DistributedAdamW::post_gather(size_t b) {
  if (!shard_params_) MOECORE_FAIL("distributed optimizer: post_gather needs shard_params");
  if (gather_slot_.at(b) >= 0) return;
  if (gather_order_.size() == 2) wait_gather(gather_order_.front());
  const int slot = gather_order_.empty() ? 0 : 1 - gather_slot_[gather_order_.front()];
  const Bucket& k = buckets_[b];
  bucket_gathers_[b] = all_gather_async(range(gather_staging_[slot], 0, k.shard * group_.size()),
                                        range(master_, k.shard_offset, k.shard), group_);
  gather_slot_[b] = slot;
  gather_order_.push_back(b);
}

void DistributedAdamW::wait_gather(size_t b) {
  if (!shard_params_) MOECORE_FAIL("distributed optimizer: wait_gather needs shard_params");
  post_gather(b);
  bucket_gathers_[b].wait();
  const Tensor& staging = gather_staging_[gather_slot_[b]];
  gather_slot_[b] = -1;
  gather_order_.erase(std::find(gather_order_.begin(), gather_order_.end(), b));
  if (!bucket_resident(b)) return;  // (a prefetch nobody took: dropped)
  for (size_t i = buckets_[b].first_param; i < buckets_[b].end_param; ++i)
    flat(params_[i]->value).copy_from(range(staging, param_offsets_[i], param_elems_[i]));
}

void DistributedAdamW::take_masters_from_values(
    const std::function<void(size_t i, int64_t first, Tensor& dst)>& initial_values) {
  if (!shard_params_) return;
  if (master_.dtype() != DType::f32)
    for (Param* p : params_)
      if (p->value.resident()) p->value.copy_from(p->value.to(master_.dtype()));
  for (const Segment& s : segments_) {
    Tensor master = range(master_, s.shard_offset, s.elems);
    if (params_[s.param]->value.resident()) {
      master.copy_from(range(flat(params_[s.param]->value), s.param_offset, s.elems));
      continue;
    }
    if (!initial_values)
      MOECORE_FAIL("distributed optimizer: parameter '", params_[s.param]->name,
                   "' is released and no initial values were given for its masters");
    Tensor drawn = master.dtype() == DType::f32
                       ? master
                       : Tensor::empty(Shape{s.elems}, DType::f32, MemCategory::workspace, device_);
    initial_values(s.param, s.param_offset, drawn);
    if (!drawn.same_data(master)) master.copy_from(drawn);  // (rounded to the masters' dtype)
  }
}

void DistributedAdamW::check_grad(size_t i) const {
  const Param& p = *params_[i];
  if (!p.grad.defined() || p.grad.dtype() != DType::f32 || !p.grad.is_contiguous() || p.grad.device() != device_ ||
      p.grad.numel() != param_elems_[i])
    MOECORE_FAIL("distributed optimizer: gradient of '", p.name, "' is ",
                 p.grad.defined() ? p.grad.str() : std::string("undefined"), "; it needs a contiguous f32 ",
                 device_name(device_), " tensor of ", param_elems_[i], " elements like the value");
}

void DistributedAdamW::check_overlap(const char* what) const {
  if (!overlap_)
    MOECORE_FAIL("distributed optimizer: ", what, " needs the overlap staging (DistributedAdamWOptions::overlap)");
}

void DistributedAdamW::reduce_scatter_grads() {
  const int P = group_.size();
  for (const Bucket& b : buckets_) {
    for (size_t i = b.first_param; i < b.end_param; ++i) {
      check_grad(i);
      range(staging_, param_offsets_[i], param_elems_[i]).copy_from(flat(params_[i]->grad));
    }
    const int64_t padded = b.shard * P;
    range(staging_, b.elems, padded - b.elems).zero_();
    const Tensor shard = range(shard_grad_, b.shard_offset, b.shard);
    reduce_scatter_sum(shard, range(staging_, 0, padded), group_);
    if (instances_.size() > 1) all_reduce_sum(shard, instances_);
  }
}

void DistributedAdamW::begin_grad_reduction() {
  check_overlap("begin_grad_reduction");
  if (reducing_) MOECORE_FAIL("distributed optimizer: begin_grad_reduction while a reduction is open");
  reducing_ = true;
  posted_.clear();
  instances_next_ = 0;
  param_ready_.assign(params_.size(), 0);
  ready_left_.clear();
  for (const Bucket& b : buckets_) ready_left_.push_back(static_cast<int64_t>(b.end_param - b.first_param));
}

void DistributedAdamW::post_reduce_scatter(size_t b) {
  const Bucket& k = buckets_[b];
  const int64_t padded = k.shard * group_.size();
  wait_param(k.first_param);  // the staging area is the bucket's parameter gather's too (done by now: forward read it)
  const Tensor stage = range(overlap_staging_, bucket_staging_[b], padded);
  range(stage, k.elems, padded - k.elems).zero_();
  grad_handles_[b] = reduce_scatter_sum_async(range(shard_grad_, k.shard_offset, k.shard), stage, group_);
  ready_left_[b] = -1;  // posted
  posted_.push_back(b);
}

// Each posted bucket's all-reduce over the instances, in posting order, once its reduce-scatter is done: those done
// by now, or with `wait` all of them.
void DistributedAdamW::post_instance_reductions(bool wait) {
  if (instances_.size() == 1) return;
  for (; instances_next_ < posted_.size(); ++instances_next_) {
    const size_t b = posted_[instances_next_];
    if (wait)
      grad_handles_[b].wait();
    else if (!grad_handles_[b].test())
      return;
    const Bucket& k = buckets_[b];
    instance_handles_[b] = all_reduce_sum_async(range(shard_grad_, k.shard_offset, k.shard), instances_);
  }
}

void DistributedAdamW::grad_ready(size_t i) {
  if (!reducing_) MOECORE_FAIL("distributed optimizer: grad_ready(", i, ") outside begin/finish_grad_reduction");
  if (i >= params_.size())
    MOECORE_FAIL("distributed optimizer: grad_ready(", i, ") of ", params_.size(), " parameters");
  check_grad(i);
  const size_t b = bucket_of_param_[i];
  if (param_ready_[i])
    MOECORE_FAIL("distributed optimizer: the gradient of '", params_[i]->name, "' was declared ready twice");
  param_ready_[i] = 1;
  wait_param(i);  // the bucket's staging area must be free of its parameter gather
  range(overlap_staging_, bucket_staging_[b] + param_offsets_[i], param_elems_[i]).copy_from(flat(params_[i]->grad));
  if (--ready_left_[b] == 0) post_reduce_scatter(b);
  post_instance_reductions(false);
}

void DistributedAdamW::finish_grad_reduction() {
  if (!reducing_) MOECORE_FAIL("distributed optimizer: finish_grad_reduction without begin_grad_reduction");
  reducing_ = false;
  // Buckets with parameters never declared ready take every gradient as it is now (in bucket order, as
  // reduce_scatter_grads would: every rank does the same).
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (ready_left_[b] < 0) continue;
    wait_param(buckets_[b].first_param);
    for (size_t i = buckets_[b].first_param; i < buckets_[b].end_param; ++i) {
      check_grad(i);
      range(overlap_staging_, bucket_staging_[b] + param_offsets_[i], param_elems_[i])
          .copy_from(flat(params_[i]->grad));
    }
    post_reduce_scatter(b);
  }
  post_instance_reductions(true);
  for (CommHandle& h : grad_handles_) h.wait();
  for (CommHandle& h : instance_handles_) h.wait();
}

double DistributedAdamW::shard_param_sq() const {
  Tensor acc = sq_acc_;
  acc.zero_();
  for (const Segment& g : owned_) ops::sum_squares(acc, master(g), ctx());
  double s = 0;
  acc.copy_to_host(&s, 1);
  return s;
}

int64_t DistributedAdamW::shard_grad_zeros(float clip_scale) const {
  Tensor acc = zeros_acc_;
  acc.zero_();
  for (const Segment& g : owned_) ops::count_zeros(acc, range(shard_grad_, g.shard_offset, g.elems), clip_scale, ctx());
  int64_t n = 0;
  acc.copy_to_host(&n, 1);
  return n;
}

double DistributedAdamW::shard_grad_sq() const {
  Tensor acc = sq_acc_;
  acc.zero_();
  for (const Segment& g : owned_) ops::sum_squares(acc, range(shard_grad_, g.shard_offset, g.elems), ctx());
  double s = 0;
  acc.copy_to_host(&s, 1);
  return s;
}

void DistributedAdamW::scale_shard_grads(float s) {
  for (const Segment& g : owned_) {
    Tensor part = range(shard_grad_, g.shard_offset, g.elems);
    ops::scale(part, s, ctx());
  }
}

std::string DistributedAdamW::first_nonfinite_grad() const {
  Tensor flags = nonfinite_;
  flags.zero_();
  for (size_t i = 0; i < owned_.size(); ++i) {
    Tensor flag = range(flags, static_cast<int64_t>(i), 1);
    ops::flag_nonfinite(flag, range(shard_grad_, owned_[i].shard_offset, owned_[i].elems), ctx());
  }
  nonfinite_host_.resize(static_cast<size_t>(flags.numel()));
  flags.copy_to_host(nonfinite_host_.data(), flags.numel());
  for (size_t i = 0; i < owned_.size(); ++i)
    if (nonfinite_host_[i]) return params_[owned_[i].param]->name;
  return "";
}

void DistributedAdamW::apply_segment(const Segment& s, float lr, float clip_scale) {
  const Param& p = *params_[s.param];
  ops::AdamWParams ap;
  ap.lr = lr;
  ap.beta1 = cfg_.beta1;
  ap.beta2 = cfg_.beta2;
  ap.eps = cfg_.eps;
  ap.weight_decay = p.weight_decay ? cfg_.weight_decay : 0.0f;
  ap.step = step_;
  ap.grad_scale = clip_scale;
  Tensor value = master(s);
  const Tensor grad = shard_grad_.slice(0, s.shard_offset, s.shard_offset + s.elems);
  Tensor m = range(exp_avg_, s.state_offset, s.elems);
  Tensor v = range(exp_avg_sq_, s.state_offset, s.elems);
  ops::adamw_step(value, grad, m, v, ap, ctx());
}

void DistributedAdamW::step(float lr, float clip_scale, bool gather_later) {
  if (gather_later) check_overlap("step(gather_later)");
  update(lr, clip_scale);
  gather_params(gather_later);
}

void DistributedAdamW::update(float lr, float clip_scale) {
  if (reducing_) MOECORE_FAIL("distributed optimizer: step inside an open gradient reduction");
  finish_param_gather();
  while (!gather_order_.empty()) wait_gather(gather_order_.front());  // (their inputs are the master shard)
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& v = params_[i]->value;
    if (shard_params_ && !v.resident()) continue;
    if (!v.is_contiguous() || v.dtype() != DType::f32 || v.device() != device_ || v.numel() != param_elems_[i])
      MOECORE_FAIL("distributed optimizer: parameter '", params_[i]->name, "' has value ", v.str(),
                   "; it needs a contiguous f32 ", device_name(device_), " tensor of ", param_elems_[i], " elements");
  }
  ++step_;
  for (const Segment& s : owned_) apply_segment(s, lr, clip_scale);
  if (over_instances_) gather_pieces();
}

void DistributedAdamW::gather_params(bool gather_later) {
  const int P = group_.size();
  if (shard_params_) {  // the masters' shards gathered into the resident values (the rest: wait_gather, on demand)
    if (gather_later) MOECORE_FAIL("distributed optimizer: shard_params gathers on demand, not later");
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (bucket_resident(b)) wait_gather(b);
    return;
  }
  if (gather_later) {  // each bucket's owned range packed at its shard offset, gathered into its staging area
    check_overlap("gather_params(later)");
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& k = buckets_[b];
      Tensor packed = range(overlap_shard_, k.shard_offset, k.shard);
      packed.zero_();
      for (size_t j = k.first_segment; j < k.end_segment; ++j) {
        const Segment& s = segments_[j];
        range(packed, s.shard_offset - k.shard_offset, s.elems)
            .copy_from(range(flat(params_[s.param]->value), s.param_offset, s.elems));
      }
      gather_handles_[b] = all_gather_async(range(overlap_staging_, bucket_staging_[b], k.shard * P), packed, group_);
      ++gathers_pending_;
    }
    return;
  }
  for (const Bucket& b : buckets_) {
    // Pack the owned range (parameters, then zeros for the padding) and gather every rank's.
    Tensor packed = range(shard_param_, 0, b.shard);
    packed.zero_();
    for (size_t k = b.first_segment; k < b.end_segment; ++k) {
      const Segment& s = segments_[k];
      range(packed, s.shard_offset - b.shard_offset, s.elems)
          .copy_from(range(flat(params_[s.param]->value), s.param_offset, s.elems));
    }
    all_gather(range(staging_, 0, b.shard * P), packed, group_);
    for (size_t i = b.first_param; i < b.end_param; ++i) {
      Tensor v = flat(params_[i]->value);
      v.copy_from(range(staging_, param_offsets_[i], param_elems_[i]));
    }
  }
}

void DistributedAdamW::wait_param(size_t i) {
  if (i >= params_.size())
    MOECORE_FAIL("distributed optimizer: wait_param(", i, ") of ", params_.size(), " parameters");
  if (gathers_pending_ == 0) return;
  const size_t b = bucket_of_param_[i];
  if (!gather_handles_[b].pending()) return;
  gather_handles_[b].wait();
  --gathers_pending_;
  for (size_t j = buckets_[b].first_param; j < buckets_[b].end_param; ++j)
    flat(params_[j]->value).copy_from(range(overlap_staging_, bucket_staging_[b] + param_offsets_[j], param_elems_[j]));
}

void DistributedAdamW::finish_param_gather() {
  for (size_t b = 0; b < buckets_.size() && gathers_pending_ > 0; ++b) wait_param(buckets_[b].first_param);
}

void DistributedAdamW::gather_state(std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq) const {
  const int P = group_.size();
  int64_t max_padded = 0;
  for (const Bucket& b : buckets_) max_padded = std::max(max_padded, b.shard * P);
  const Tensor buf = Tensor::empty(Shape{max_padded}, cfg_.state_dtype, MemCategory::workspace, device_);
  // (shard_over_instances: each bucket's shard of the moments first gathered from the instances' pieces)
  const Tensor whole =
      over_instances_ ? Tensor::empty(Shape{max_padded / P}, cfg_.state_dtype, MemCategory::workspace, device_) : buf;
  const int64_t N = over_instances_ ? instances_.size() : 1;
  for (std::vector<Tensor>* out : {&exp_avg, &exp_avg_sq}) {
    const Tensor& state = out == &exp_avg ? exp_avg_ : exp_avg_sq_;
    out->clear();
    for (const Param* p : params_)
      out->push_back(Tensor::empty(p->value.shape(), cfg_.state_dtype, MemCategory::other));
    for (const Bucket& b : buckets_) {
      Tensor shard = range(state, b.shard_offset / N, b.shard / N);
      if (over_instances_) {
        all_gather(range(whole, 0, b.shard), shard, instances_);
        shard = range(whole, 0, b.shard);
      }
      all_gather(buf.slice(0, 0, b.shard * P), shard, group_);
      for (size_t i = b.first_param; i < b.end_param; ++i) {
        const int64_t n = param_elems_[i];
        flat((*out)[i]).copy_from(buf.slice(0, param_offsets_[i], param_offsets_[i] + n));
      }
    }
  }
}

void DistributedAdamW::load_state(const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq) {
  for (const std::vector<Tensor>* in : {&exp_avg, &exp_avg_sq}) {
    if (in->size() != params_.size())
      MOECORE_FAIL("distributed optimizer: load_state got ", in->size(), " moment tensors for ", params_.size(),
                   " parameters");
    for (size_t i = 0; i < params_.size(); ++i)
      if (!(*in)[i].defined() || !((*in)[i].shape() == params_[i]->value.shape()))
        MOECORE_FAIL("distributed optimizer: load_state: moment of '", params_[i]->name, "' is ",
                     (*in)[i].defined() ? (*in)[i].str() : std::string("undefined"), " but the parameter is ",
                     params_[i]->value.str());
  }
  for (const Segment& s : owned_) {
    for (int k = 0; k < 2; ++k) {
      const Tensor& full = (k == 0 ? exp_avg : exp_avg_sq)[s.param];
      const Tensor src = full.is_contiguous() ? full : full.clone();
      range(k == 0 ? exp_avg_ : exp_avg_sq_, s.state_offset, s.elems)
          .copy_from(flat(src).slice(0, s.param_offset, s.param_offset + s.elems));
    }
  }
}

int64_t DistributedAdamW::state_bytes() const {
  return 2 * state_elems_ * static_cast<int64_t>(dtype_size(cfg_.state_dtype));
}

}  // namespace moecore::optim
