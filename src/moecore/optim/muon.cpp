#include "moecore/optim/muon.h"

#include <algorithm>
#include <cmath>

namespace moecore::optim {

void MuonConfig::validate() const {
  if (!(momentum >= 0 && momentum < 1)) MOECORE_FAIL("optimizer: --muon-momentum (", momentum, ") must lie in [0, 1)");
  if (num_ns_steps < 1) MOECORE_FAIL("optimizer: --muon-num-ns-steps (", num_ns_steps, ") must be at least 1");
  if (!std::isfinite(extra_scale_factor))
    MOECORE_FAIL("optimizer: --muon-extra-scale-factor (", extra_scale_factor, ") must be finite");
  lion().validate();
}

ops::NewtonSchulz MuonConfig::newton_schulz() const {
  ops::NewtonSchulz ns;
  ns.steps = num_ns_steps;
  ns.coefficients = coefficient_type;
  ns.bf16 = fp32_matmul_prec == MuonMatmulPrecision::medium;
  return ns;
}

bool muon_managed(const std::string& name, int ndim, bool expert_parallel) {
  if (name.ends_with("word_embeddings.weight") || name.ends_with("output_layer.weight")) return false;
  return ndim == (expert_parallel ? 3 : 2);
}

namespace {
// Megatron's layer-wise deal (layer_wise_optimizer.py, the legacy layout): each group's parameters in ascending size
// (a stable sort: ties in model order) dealt to ranks 0..D-1, D-1..0, 0..D-1, ...
std::vector<int> deal_owners(const std::vector<Param>& params, const MuonGroups& g) {
  std::vector<int> owner(params.size(), 0);
  if (!g.distributed) return owner;
  for (bool expert : {false, true}) {
    const int D = (expert ? g.edp : g.dp).size();
    std::vector<size_t> order;
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].expert_parallel == expert) order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return params[a].value.numel() < params[b].value.numel(); });
    for (size_t k = 0; k < order.size() && D > 1; ++k) {
      const int round = static_cast<int>(k / static_cast<size_t>(D)), at = static_cast<int>(k % static_cast<size_t>(D));
      owner[order[k]] = round % 2 == 0 ? at : D - 1 - at;
    }
  }
  return owner;
}

// The scalar optimizer's parameters: those Muon leaves that this rank owns.
std::vector<Param> scalar_subset(const std::vector<Param>& params, const std::vector<MuonParam>& kinds,
                                 const std::vector<int>& owner, const MuonGroups& g, std::vector<size_t>* index) {
  MOECORE_CHECK(kinds.size() == params.size(), "Muon: ", kinds.size(), " parameter kinds for ", params.size(),
                " parameters");
  std::vector<Param> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const ProcessGroup& dp = params[i].expert_parallel ? g.edp : g.dp;
    if (!kinds[i].managed && (!g.distributed || owner[i] == dp.rank())) {
      out.push_back(params[i]);
      index->push_back(i);
    }
  }
  return out;
}
}  // namespace

Muon::Muon(std::vector<Param>& params, const std::vector<MuonParam>& kinds, const MuonConfig& cfg,
           const AdamWConfig& adam, const MuonGroups& groups)
    : params_(params),
      kinds_(kinds),
      cfg_(cfg),
      groups_(groups),
      owner_(deal_owners(params, groups)),
      scalar_index_(),
      scalar_params_(scalar_subset(params, kinds, owner_, groups, &scalar_index_)),
      adam_(adam),
      scalar_(cfg.scalar_optimizer == ScalarOptimizer::lion
                  ? std::variant<AdamW, Lion>(std::in_place_type<Lion>, scalar_params_, cfg.lion(), adam)
                  : std::variant<AdamW, Lion>(std::in_place_type<AdamW>, scalar_params_, adam)) {
  cfg_.validate();
  momentum_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {  // (every rank checks every matrix: an owner alone must not fail)
    if (!kinds_[i].managed) continue;
    const Param& p = params_[i];
    const int matrix_dims = p.expert_parallel ? 3 : 2;
    if (p.value.dim() != matrix_dims)
      MOECORE_FAIL("Muon: parameter ", p.name, " ", p.value.str(), " is no matrix", p.expert_parallel ? " stack" : "");
    if (!kinds_[i].pieces.empty()) {
      int64_t group = 0;
      for (int64_t r : kinds_[i].pieces) group += r;
      if (p.expert_parallel || group <= 0 || p.value.size(0) % group != 0)
        MOECORE_FAIL("Muon: parameter ", p.name, " ", p.value.str(), " does not split into row groups of ", group);
      if (p.tp.sharded() && p.tp.dim != 0)
        MOECORE_FAIL("Muon: parameter ", p.name, " is split into pieces of rows but sharded along dim ", p.tp.dim);
    }
    if (owned(i))
      momentum_[i] = Tensor::zeros(p.value.shape(), DType::f32, MemCategory::optimizer_state, p.value.device());
  }
}

std::vector<Tensor> Muon::spread(const std::vector<Tensor>& scalar_state) const {
  std::vector<Tensor> out(params_.size());
  for (size_t k = 0; k < scalar_index_.size(); ++k) out[scalar_index_[k]] = scalar_state[k];
  return out;
}

int64_t Muon::steps_taken() const {
  return std::visit([](const auto& s) { return s.steps_taken(); }, scalar_);
}

void Muon::set_steps_taken(int64_t n) {
  std::visit([n](auto& s) { s.set_steps_taken(n); }, scalar_);
}

std::vector<Tensor> Muon::exp_avg() const {
  return spread(std::visit([](const auto& s) { return s.exp_avg(); }, scalar_));
}

std::vector<Tensor> Muon::exp_avg_sq() const {
  if (const auto* adam = std::get_if<AdamW>(&scalar_)) return spread(adam->exp_avg_sq());
  return std::vector<Tensor>(params_.size());  // (Lion keeps one moment)
}

int64_t Muon::state_bytes() const {
  int64_t n = 0;
  for (const Tensor& m : momentum_)
    if (m.defined()) n += m.nbytes();
  for (const Param& p : scalar_params_) n += scalar_bytes_per_param(cfg_, adam_) * p.value.numel();
  return n;
}

double Muon::scale(int64_t rows, int64_t cols) const {
  const double m = static_cast<double>(rows), n = static_cast<double>(cols);
  double s = 1;
  switch (cfg_.scale_mode) {
    case MuonScaleMode::spectral:
      s = std::sqrt(std::max(m, n));
      break;
    case MuonScaleMode::unit_rms_norm:
      s = std::sqrt(m / n);
      break;
    case MuonScaleMode::shape_scaling:
      s = std::sqrt(std::max(1.0, m / n));
      break;
  }
  return s * cfg_.extra_scale_factor;
}

StepStats Muon::step(float lr, double grad_norm) {
  const StepStats st = std::visit([&](auto& s) { return s.step(lr, grad_norm); }, scalar_);
  for (size_t i = 0; i < params_.size(); ++i)
    if (kinds_[i].managed && owned(i)) step_matrix(i, lr, st.clip_scale);
  if (groups_.distributed)  // the owners' new values to every replica
    for (size_t i = 0; i < params_.size(); ++i)
      if (data_parallel(i).size() > 1) broadcast(params_[i].value, owner_[i], data_parallel(i));
  return st;
}

std::array<std::vector<Tensor>, 3> Muon::checkpoint_state(bool gather) const {
  std::array<std::vector<Tensor>, 3> st = {momentum_, exp_avg(), exp_avg_sq()};
  if (!groups_.distributed) return st;
  const bool lion = cfg_.scalar_optimizer == ScalarOptimizer::lion;
  const DType moments = lion ? DType::f32 : adam_.state_dtype;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    for (int k = 0; k < 3; ++k) {
      if ((k == 0) != kinds_[i].managed) continue;  // Muon's matrices have a momentum, the others two moments
      if (k == 2 && lion) continue;                 // (or Lion's one)
      Tensor& t = st[static_cast<size_t>(k)][i];
      if (!owned(i))
        t = Tensor::zeros(p.value.shape(), k == 0 ? DType::f32 : moments, MemCategory::workspace, p.value.device());
      if (gather && data_parallel(i).size() > 1) broadcast(t, owner_[i], data_parallel(i));
    }
  }
  return st;
}

// piece [E, r, c]: this rank's part of E matrices of rows x cols (whole), split along shard_dim (0 rows, 1 cols; -1
// whole) over group. Orthogonalised and scaled in place.
void Muon::orthogonalise(Tensor& piece, int shard_dim, const ProcessGroup& group, int64_t rows, int64_t cols) {
  const ops::Context ctx{piece.device()};
  ops::NewtonSchulz ns = cfg_.newton_schulz();
  const bool sharded = shard_dim >= 0 && group.size() > 1;
  const MuonTpMode mode = sharded ? cfg_.tp_mode : MuonTpMode::blockwise;  // (one rank's whole matrix: plain NS)
  float s = static_cast<float>(scale(rows, cols));
  switch (mode) {
    case MuonTpMode::blockwise:
      if (sharded) s = static_cast<float>(scale(piece.size(1), piece.size(2)));  // the shard's own shape
      ops::newton_schulz(piece, ns, {}, ctx);
      break;
    case MuonTpMode::duplicated: {
      Shape whole = piece.shape();
      whole[shard_dim + 1] *= group.size();
      Tensor full = Tensor::empty(whole, DType::f32, MemCategory::workspace, piece.device());
      all_gather_into(full, piece, shard_dim + 1, group);
      ops::newton_schulz(full, ns, {}, ctx);
      const int64_t n = piece.size(shard_dim + 1), r = group.rank();
      piece.copy_from(full.slice(shard_dim + 1, r * n, (r + 1) * n));
      break;
    }
    case MuonTpMode::distributed: {
      ns.transpose = shard_dim == 0 ? 1 : 0;  // the Gram contracts the split dim
      const auto sum = [&](Tensor& t) {
        if (t.dtype() == DType::f32 || t.dtype() == DType::f64) return all_reduce_sum(t, group);
        Tensor wide = Tensor::empty(t.shape(), DType::f32, MemCategory::workspace, t.device());
        wide.copy_from(t);
        all_reduce_sum(wide, group);
        t.copy_from(wide);
      };
      ops::newton_schulz(piece, ns, sum, ctx);
      break;
    }
  }
  ops::scale(piece, s, ctx);
}

void Muon::step_matrix(size_t i, float lr, float clip_scale) {
  Param& p = params_[i];
  const ops::Context ctx{p.value.device()};
  Tensor u = Tensor::empty(p.value.shape(), DType::f32, MemCategory::workspace, p.value.device());
  ops::MuonMomentumParams mp;
  mp.beta = cfg_.momentum;
  mp.nesterov = cfg_.nesterov;
  mp.grad_scale = clip_scale;
  ops::muon_momentum(u, momentum_[i], p.grad, mp, ctx);

  // [E, rows, cols]: an expert stack's matrices, or the one matrix.
  Tensor u3 = p.expert_parallel ? u : u.view({1, u.size(0), u.size(1)});
  const int shard_dim = p.tp.sharded() ? p.tp.dim - (p.expert_parallel ? 1 : 0) : -1;
  const ProcessGroup& group = p.expert_parallel ? groups_.etp : groups_.tp;
  const int64_t tp = shard_dim >= 0 ? group.size() : 1;
  const int64_t cols = u3.size(2) * (shard_dim == 1 ? tp : 1);
  const std::vector<int64_t>& pieces = kinds_[i].pieces;
  if (pieces.empty()) {
    orthogonalise(u3, shard_dim, group, u3.size(1) * (shard_dim == 0 ? tp : 1), cols);
  } else {  // Q, K and V: each the same rows of every query group, gathered, orthogonalised and put back
    int64_t width = 0;
    for (int64_t r : pieces) width += r;
    const int64_t groups = u3.size(1) / width;
    Tensor grouped = u.view({groups, width, u3.size(2)});
    int64_t at = 0;
    for (int64_t r : pieces) {
      Tensor part = grouped.slice(1, at, at + r);
      Tensor piece = Tensor::empty({1, groups * r, u3.size(2)}, DType::f32, MemCategory::workspace, u.device());
      piece.view({groups, r, u3.size(2)}).copy_from(part);
      orthogonalise(piece, shard_dim, group, groups * r * tp, cols);
      part.copy_from(piece.view({groups, r, u3.size(2)}));
      at += r;
    }
  }
  ops::muon_update(p.value, u, lr, p.weight_decay ? adam_.weight_decay : 0.0f, ctx);
}

}  // namespace moecore::optim
