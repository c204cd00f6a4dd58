#include "moecore/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "moecore/core/rng.h"

namespace moecore::train {

void TrainConfig::validate() const {
  if (micro_batch_size <= 0 || global_batch_size <= 0 || global_batch_size % micro_batch_size != 0)
    MOECORE_FAIL("training: global_batch_size (", global_batch_size, ") must be a positive multiple of ",
                 "micro_batch_size (", micro_batch_size, ")");
  if (train_iters <= 0) MOECORE_FAIL("training: train_iters (", train_iters, ") must be positive");
  if (lr_decay_style != "constant" && lr_decay_style != "linear" && lr_decay_style != "cosine")
    MOECORE_FAIL("training: lr_decay_style '", lr_decay_style, "' is not one of constant, linear, cosine");
  if (!(lr >= 0) || !(min_lr >= 0) || min_lr > lr)
    MOECORE_FAIL("training: need 0 <= min_lr (", min_lr, ") <= lr (", lr, ")");
  if (log_interval <= 0 || eval_iters <= 0 || eval_interval < 0 || lr_warmup_iters < 0)
    MOECORE_FAIL("training: log_interval (", log_interval, ") and eval_iters (", eval_iters,
                 ") must be positive; eval_interval (", eval_interval, ") and lr_warmup_iters (",
                 lr_warmup_iters, ") must not be negative");
}

float lr_at(const TrainConfig& c, int64_t it) {
  if (c.lr_warmup_iters > 0 && it < c.lr_warmup_iters)
    return c.lr * static_cast<float>(it + 1) / static_cast<float>(c.lr_warmup_iters);
  if (c.lr_decay_style == "constant") return c.lr;
  const int64_t decay_steps = std::max<int64_t>(c.train_iters - c.lr_warmup_iters, 1);
  const double ratio = std::min(1.0, static_cast<double>(it - c.lr_warmup_iters) / static_cast<double>(decay_steps));
  const double coeff = c.lr_decay_style == "linear" ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return static_cast<float>(c.min_lr + coeff * (c.lr - c.min_lr));
}

double evaluate(model::GptModel& gpt, const TrainConfig& cfg, const BatchFn& batches) {
  const auto& m = gpt.config();
  Tensor tokens = Tensor::empty({gpt.micro_batch_size(), m.seq_length}, DType::i32, MemCategory::workspace);
  Tensor labels = Tensor::empty({gpt.micro_batch_size(), m.seq_length}, DType::i32, MemCategory::workspace);
  model::LossResult total;
  for (int64_t i = 0; i < cfg.eval_iters; ++i) {
    batches(tokens, labels, true, i);
    const auto r = gpt.evaluate(tokens, labels);
    total.loss_sum += r.loss_sum;
    total.tokens += r.tokens;
  }
  return total.mean();
}

namespace {
// Adds this micro-batch's router statistics of every MoE layer into acc; returns the number of MoE layers.
int64_t accumulate_moe_losses(const model::GptModel& gpt, MoeStepLosses& acc) {
  int64_t n = 0;
  for (int64_t l = 0; l < gpt.config().num_layers; ++l) {
    const moe::RouterStats* st = gpt.moe_stats(l);
    if (!st) continue;
    ++n;
    acc.aux_loss += st->aux_loss;
    acc.seq_aux_loss += st->seq_aux_loss;
    acc.global_aux_loss += st->global_aux_loss;
    acc.z_loss += st->z_loss;
  }
  return n;
}

std::string format_moe_losses(const moe::MoeConfig& mc, const MoeStepLosses& l) {
  std::string s;
  char buf[64];
  auto add = [&](const char* name, double v) {
    std::snprintf(buf, sizeof buf, " | %s %.4f", name, v);
    s += buf;
  };
  if (mc.uses(moe::LoadBalancing::aux_loss)) add("load_balancing_loss", l.aux_loss);
  if (mc.uses(moe::LoadBalancing::seq_aux_loss)) add("seq_load_balancing_loss", l.seq_aux_loss);
  if (mc.uses(moe::LoadBalancing::global_aux_loss)) add("global_load_balancing_loss", l.global_aux_loss);
  if (mc.z_loss_coeff > 0) add("z_loss", l.z_loss);
  return s;
}
// Per-layer router statistics of the last micro-batch: tokens per expert, max/mean load, drops and losses.
void log_moe_layers(const model::GptModel& gpt, std::FILE* log) {
  for (int64_t l = 0; l < gpt.config().num_layers; ++l) {
    const moe::RouterStats* st = gpt.moe_stats(l);
    if (!st) continue;
    std::string tpe;
    for (size_t e = 0; e < st->tokens_per_expert.size(); ++e)
      tpe += (e ? "," : "") + std::to_string(st->tokens_per_expert[e]);
    std::fprintf(log, "   moe layer %lld | max/mean load %.3f | dropped %lld | aux %.4f seq %.4f global %.4f z %.4f | "
                 "tokens per expert [%s]\n",
                 static_cast<long long>(l), st->max_over_mean_load(), static_cast<long long>(st->dropped),
                 st->aux_loss, st->seq_aux_loss, st->global_aux_loss, st->z_loss, tpe.c_str());
  }
}
}  // namespace

TrainLog train(model::GptModel& gpt, optim::AdamW& opt, const TrainConfig& cfg, const BatchFn& batches,
               std::FILE* log) {
  cfg.validate();
  const auto& m = gpt.config();
  if (gpt.micro_batch_size() != cfg.micro_batch_size)
    MOECORE_FAIL("training: the model was built for micro-batch ", gpt.micro_batch_size(), ", not ",
                 cfg.micro_batch_size);
  Tensor tokens = Tensor::empty({cfg.micro_batch_size, m.seq_length}, DType::i32, MemCategory::workspace);
  Tensor labels = Tensor::empty({cfg.micro_batch_size, m.seq_length}, DType::i32, MemCategory::workspace);
  const int64_t micro = cfg.micro_batches();
  const double flops_per_step = gpt.flops_per_step() * static_cast<double>(micro);
  TrainLog out;
  auto t_last = std::chrono::steady_clock::now();
  double loss_acc = 0;
  for (int64_t it = 0; it < cfg.train_iters; ++it) {
    gpt.zero_grad();
    double step_loss = 0;
    MoeStepLosses moe_losses;
    int64_t moe_layers = 0;
    for (int64_t mb = 0; mb < micro; ++mb) {
      batches(tokens, labels, false, it * micro + mb);
      step_loss += gpt.forward_backward(tokens, labels, 1.0f / static_cast<float>(micro)).mean();
      moe_layers = accumulate_moe_losses(gpt, moe_losses);
    }
    step_loss /= static_cast<double>(micro);
    if (moe_layers > 0) {
      const double div = static_cast<double>(micro * moe_layers);
      moe_losses = {moe_losses.aux_loss / div, moe_losses.seq_aux_loss / div, moe_losses.global_aux_loss / div,
                    moe_losses.z_loss / div};
    }
    const float lr = lr_at(cfg, it);
    const optim::StepStats st = opt.step(lr);
    gpt.refresh_compute_weights();
    gpt.finish_step();
    out.train_loss.push_back(step_loss);
    out.moe_losses.push_back(moe_losses);
    out.grad_norm.push_back(st.grad_norm);
    loss_acc += step_loss;
    if ((it + 1) % cfg.log_interval == 0 && log) {
      const auto now = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(now - t_last).count() / static_cast<double>(cfg.log_interval);
      t_last = now;
      const double tokens_per_s =
          static_cast<double>(cfg.global_batch_size * m.seq_length) / std::max(dt, 1e-9);
      std::fprintf(log,
                   " iteration %6lld/%6lld | consumed tokens %10lld | lr %.3e | lm loss %.4f%s | grad norm %.3f | "
                   "%.0f tokens/s | %.1f GFLOP/s\n",
                   static_cast<long long>(it + 1), static_cast<long long>(cfg.train_iters),
                   static_cast<long long>((it + 1) * cfg.global_batch_size * m.seq_length), lr,
                   loss_acc / static_cast<double>(cfg.log_interval),
                   format_moe_losses(gpt.config().moe, moe_losses).c_str(), st.grad_norm, tokens_per_s,
                   flops_per_step / dt / 1e9);
      if (cfg.moe_per_layer_logging) log_moe_layers(gpt, log);
      std::fflush(log);
      loss_acc = 0;
    }
    const bool last = it + 1 == cfg.train_iters;
    if (last || (cfg.eval_interval > 0 && (it + 1) % cfg.eval_interval == 0)) {
      const double v = evaluate(gpt, cfg, batches);
      out.valid_loss.emplace_back(it + 1, v);
      if (log) {
        std::fprintf(log, " validation loss at iteration %lld: %.4f (ppl %.2f)\n", static_cast<long long>(it + 1), v,
                     std::exp(v));
        std::fflush(log);
      }
    }
  }
  return out;
}

std::vector<int32_t> generate(model::GptModel& gpt, const std::vector<int32_t>& prompt, int64_t count,
                              float temperature, uint64_t seed) {
  const auto& m = gpt.config();
  const int64_t B = gpt.micro_batch_size(), S = m.seq_length, V = m.vocab_size;
  Tensor tokens = Tensor::zeros({B, S}, DType::i32, MemCategory::workspace);
  Tensor logits = Tensor::empty({B * S, V}, DType::f32, MemCategory::workspace);
  std::vector<int32_t> ctx = prompt, out;
  const PhiloxKey key = philox_key(seed, "generate");
  std::vector<std::pair<float, int32_t>> cand(static_cast<size_t>(V));
  for (int64_t t = 0; t < count; ++t) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ctx.size()), S);
    int32_t* tp = tokens.data<int32_t>();
    std::copy(ctx.end() - n, ctx.end(), tp);
    gpt.forward_logits(logits, tokens);
    const float* row = logits.data<float>() + (n - 1) * V;
    for (int64_t v = 0; v < V; ++v) cand[v] = {row[v], static_cast<int32_t>(v)};
    const int64_t k = std::min<int64_t>(40, V);
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), std::greater<>());
    double z = 0;
    std::vector<double> p(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) z += p[i] = std::exp((cand[i].first - cand[0].first) / std::max(temperature, 1e-4f));
    double u = philox_uniform(key, static_cast<uint64_t>(t)) * z;
    int64_t pick = 0;
    while (pick + 1 < k && (u -= p[pick]) > 0) ++pick;
    ctx.push_back(cand[pick].second);
    out.push_back(cand[pick].second);
  }
  return out;
}

}  // namespace moecore::train
