#include "moecore/nn/fp8_delayed.h"

#include <algorithm>
#include <cmath>

#include "moecore/core/error.h"
#include "moecore/kernels/common/fp8.h"

namespace moecore::nn {
namespace {

constexpr int kInput = 0, kWeight = 1, kGrad = 2;
constexpr int kForwardSlots[] = {kInput, kWeight}, kBackwardSlots[] = {kGrad};
std::span<const int> slots_of(bool forward) {
  return forward ? std::span<const int>(kForwardSlots) : std::span<const int>(kBackwardSlots);
}

const char* gemm_name(Fp8Delayed::Gemm g) {
  return g == Fp8Delayed::Gemm::fprop ? "fprop" : g == Fp8Delayed::Gemm::dgrad ? "dgrad" : "wgrad";
}

}  // namespace

bool Fp8Delayed::KeyLess::operator()(const std::string& x, const std::string& y) const {
  return x < y;
}
int Fp8Delayed::KeyLess::compare(std::string_view s, const Key& k) {
  const size_t n = std::min(s.size(), k.layer.size());
  if (const int c = s.substr(0, n).compare(k.layer.substr(0, n))) return c;
  if (s.size() < k.layer.size()) return -1;
  return s.substr(k.layer.size()).compare(k.name);
}
bool Fp8Delayed::KeyLess::operator()(const std::string& x, const Key& y) const {
  return compare(x, y) < 0;
}
bool Fp8Delayed::KeyLess::operator()(const Key& x, const std::string& y) const {
  return compare(y, x) > 0;
}

Fp8Delayed::Fp8Delayed(const Fp8Config& c) : cfg_(c), L_(c.amax_history_len) {
  MOECORE_CHECK(L_ >= 1, "FP8 delayed scaling: --fp8-amax-history-len must be >= 1, got ", L_);
}

void Fp8Delayed::begin(Pass p, int64_t slot) {
  MOECORE_CHECK(slot >= 0, "FP8 delayed scaling: activation slot ", slot);
  pass_ = p;
  slot_ = slot;
}

void Fp8Delayed::new_step() {
  for (auto& [name, q] : linears_) std::fill(q.weight_set.begin(), q.weight_set.end(), uint8_t{0});
}

Fp8Delayed::Quantizers& Fp8Delayed::find(const Linear& l, int64_t groups) {
  auto it = linears_.find(Key{l.layer, l.name});
  if (it == linears_.end()) {
    std::string name = std::string(l.layer) + l.name;
    Quantizers q;
    q.gemms = l.experts > 0 ? l.experts : 1;
    q.experts = l.experts;
    for (int k = 0; k < 3; ++k) {
      q.scale[k].assign(static_cast<size_t>(q.gemms), 1.0f);
      q.history[k].assign(static_cast<size_t>(L_ * q.gemms), 0.0f);
    }
    q.weight.assign(static_cast<size_t>(q.gemms), 1.0f);
    q.weight_set.assign(static_cast<size_t>(q.gemms), 0);
    if (auto r = restored_.find(name); r != restored_.end()) {
      fill(q, r->second, name);
      restored_.erase(r);
    }
    it = linears_.emplace(std::move(name), std::move(q)).first;
  }
  Quantizers& q = it->second;
  const bool ok = groups == 1 ? l.expert >= 0 && l.expert < q.gemms : groups == q.gemms && l.expert == 0;
  MOECORE_CHECK(ok, "FP8 delayed scaling: ", l.layer, l.name, " has ", q.gemms, " GEMMs; a call of ", groups,
                " from expert ", l.expert);
  return q;
}

ops::Fp8Gemm Fp8Delayed::operands(Gemm g, const Linear& l, int64_t groups) {
  Quantizers& q = find(l, groups);
  const auto f = static_cast<size_t>(groups == 1 ? l.expert : 0), n = static_cast<size_t>(groups);
  const auto gemms = static_cast<size_t>(q.gemms);
  auto operand = [&](int kind) {
    ops::Fp8Operand o;
    o.format = kind == kGrad && cfg_.format == Fp8Format::hybrid ? DType::f8e5m2 : DType::f8e4m3;
    o.rule = ops::Fp8ScaleRule::given;
    return o;
  };
  auto current = [&](int kind) {  // the slot's scale, its amax recorded
    ops::Fp8Operand o = operand(kind);
    o.scale = std::span<const float>(q.scale[kind]).subspan(f, n);
    o.amax = std::span<float>(q.history[kind]).subspan(f, n);
    return o;
  };
  auto fail = [&](const char* what) {
    MOECORE_FAIL("FP8 delayed scaling: ", l.layer, l.name, " ", gemm_name(g), " in activation slot ", slot_,
                 " without ", what, " (its training forward must come first)");
  };
  auto saved_input = [&] {  // the forward's input scales of this activation slot
    const size_t at = static_cast<size_t>(slot_) * gemms + f;
    if (q.saved_set.size() < at + n ||
        !std::all_of(q.saved_set.begin() + static_cast<ptrdiff_t>(at),
                     q.saved_set.begin() + static_cast<ptrdiff_t>(at + n), [](uint8_t s) { return s != 0; }))
      fail("its forward's input scales");
    ops::Fp8Operand o = operand(kInput);
    o.scale = std::span<const float>(q.saved).subspan(at, n);
    return o;
  };
  auto step_weight = [&](bool quantise) {  // the step's weight scales, taken on the step's first training forward
    ops::Fp8Operand o = operand(kWeight);
    const bool first = q.weight_set[f] == 0;
    for (size_t i = f; i < f + n; ++i)
      MOECORE_CHECK((q.weight_set[i] == 0) == first, "FP8 delayed scaling: ", l.layer, l.name,
                    ": its experts' weights were quantised apart");
    if (first && !quantise) fail("its weight quantised in this step");
    if (first) {
      std::copy_n(q.scale[kWeight].begin() + static_cast<ptrdiff_t>(f), n,
                  q.weight.begin() + static_cast<ptrdiff_t>(f));
      std::fill_n(q.weight_set.begin() + static_cast<ptrdiff_t>(f), n, uint8_t{1});
      o.amax = std::span<float>(q.history[kWeight]).subspan(f, n);
    }
    o.scale = std::span<const float>(q.weight).subspan(f, n);
    return o;
  };
  if (pass_ == Pass::eval && g != Gemm::fprop)
    MOECORE_FAIL("FP8 delayed scaling: ", l.layer, l.name, " ", gemm_name(g), " in an evaluation (no gradients)");
  ops::Fp8Gemm out;
  out.layer = l.layer;
  out.linear = l.name;
  out.pass = gemm_name(g);
  switch (g) {
    case Gemm::fprop:
      if (pass_ == Pass::eval) {
        out.a = current(kInput);
        out.b = current(kWeight);
      } else if (pass_ == Pass::backward) {  // a recompute: the forward's scales, nothing recorded
        out.a = saved_input();
        out.b = step_weight(false);
      } else {
        out.a = current(kInput);
        const size_t at = static_cast<size_t>(slot_) * gemms + f;
        if (q.saved.size() < at + n) {
          q.saved.resize(static_cast<size_t>(slot_ + 1) * gemms, 1.0f);
          q.saved_set.resize(q.saved.size(), 0);
        }
        std::copy_n(q.scale[kInput].begin() + static_cast<ptrdiff_t>(f), n,
                    q.saved.begin() + static_cast<ptrdiff_t>(at));
        std::fill_n(q.saved_set.begin() + static_cast<ptrdiff_t>(at), n, uint8_t{1});
        out.b = step_weight(true);
      }
      break;
    case Gemm::dgrad:
      out.a = current(kGrad);
      out.b = step_weight(false);
      break;
    case Gemm::wgrad:
      out.a = current(kGrad);
      out.b = saved_input();
      break;
  }
  return out;
}

std::vector<float> Fp8Delayed::amaxes(bool forward) const {
  std::vector<float> v;
  for (const auto& [name, q] : linears_)
    for (int k : slots_of(forward)) v.insert(v.end(), q.history[k].begin(), q.history[k].begin() + q.gemms);
  return v;
}

void Fp8Delayed::update(bool forward, std::span<const float> reduced) {
  const bool use_max = cfg_.amax_compute_algo == Fp8AmaxAlgo::max;
  const float down = std::ldexp(1.0f, static_cast<int>(-cfg_.margin));
  std::vector<float> h(static_cast<size_t>(L_));
  size_t at = 0;
  for (auto& [name, q] : linears_)
    for (int k : slots_of(forward)) {
      const float scaled_max = ops::fp8::max_of(k == kGrad && cfg_.format == Fp8Format::hybrid) * down;
      for (int64_t g = 0; g < q.gemms; ++g, ++at) {
        MOECORE_CHECK(at < reduced.size(), "FP8 delayed scaling: ", reduced.size(), " reduced amaxes for more slots");
        for (int64_t r = 0; r < L_; ++r) h[static_cast<size_t>(r)] = q.history[k][static_cast<size_t>(r * q.gemms + g)];
        h[0] = reduced[at];
        float& s = q.scale[k][static_cast<size_t>(g)];
        s = ops::fp8::delayed_update(h.data(), L_, h[0], use_max, scaled_max, s);
        for (int64_t r = 0; r < L_; ++r) q.history[k][static_cast<size_t>(r * q.gemms + g)] = h[static_cast<size_t>(r)];
      }
    }
  MOECORE_CHECK(at == reduced.size(), "FP8 delayed scaling: ", reduced.size(), " reduced amaxes for ", at, " slots");
}

std::map<std::string, Fp8Delayed::Record> Fp8Delayed::records() const {
  std::map<std::string, Record> out;
  for (const auto& [name, r] : restored_) out[name] = r;
  for (const auto& [name, q] : linears_) {
    Record r{q.experts, q.gemms, L_, std::vector<float>(static_cast<size_t>(q.gemms * 3 * (1 + L_)))};
    for (int64_t g = 0; g < q.gemms; ++g)
      for (int k = 0; k < 3; ++k) {
        float* row = r.slots.data() + (g * 3 + k) * (1 + L_);
        row[0] = q.scale[k][static_cast<size_t>(g)];
        for (int64_t h = 0; h < L_; ++h) row[1 + h] = q.history[k][static_cast<size_t>(h * q.gemms + g)];
      }
    out[name] = std::move(r);
  }
  return out;
}

void Fp8Delayed::restore(std::map<std::string, Record> slots) {
  linears_.clear();  // every linear starts again from its record (or afresh), with its weight quantised again
  restored_ = std::move(slots);
}

void Fp8Delayed::fill(Quantizers& q, const Record& record, const std::string& name) const {
  const int64_t Ls = record.history;
  const bool ok =
      record.gemms == q.gemms && Ls >= 1 && static_cast<int64_t>(record.slots.size()) == record.gemms * 3 * (1 + Ls);
  MOECORE_CHECK(ok, "checkpoint: the FP8 delayed-scaling state of ", name, " holds ", record.slots.size(),
                " values for ", record.gemms, " GEMMs and a history of ", Ls, "; this model's linear has ", q.gemms,
                " GEMMs");
  for (int64_t g = 0; g < q.gemms; ++g)
    for (int k = 0; k < 3; ++k) {
      const float* row = record.slots.data() + (g * 3 + k) * (1 + Ls);
      q.scale[k][static_cast<size_t>(g)] = row[0];
      for (int64_t r = 0; r < L_; ++r) q.history[k][static_cast<size_t>(r * q.gemms + g)] = r < Ls ? row[1 + r] : 0.0f;
    }
}

}  // namespace moecore::nn
