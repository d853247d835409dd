#include <amp/optimizer.h>

#include <amp/casting_scope.h>

#include "context.h"
#include "log.h"
#include "optimizer_grad_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <atomic>
#include <map>
#include <sstream>
#include <unordered_map>

namespace amp {
namespace detail {
namespace {

std::atomic<int64_t> g_host_syncs{0};

bool is_low_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

at::Tensor make_master(const at::Tensor& param) {
  return param.detach().to(at::kFloat).requires_grad_(param.requires_grad());
}

size_t count_params(const torch::optim::Optimizer& optimizer) {
  size_t n = 0;
  for (const auto& group : optimizer.param_groups()) n += group.params().size();
  return n;
}

void log_overflow(const PendingUpdate& u) {
  Context& ctx = *u.context;
  SkipLog& log = ctx.skip_log(u.loss_id);
  log.consecutive = u.overflow ? log.consecutive + 1 : 0;
  constexpr int kLoggedInARow = 5;  // then one notice, then silence until a clean step
  if (!u.overflow || ctx.verbosity() < 1 || log.consecutive > kLoggedInARow + 1) return;
  std::ostringstream line;
  if (log.consecutive == kLoggedInARow + 1) {
    line << "loss scaler " << u.loss_id << ": " << kLoggedInARow
         << " overflows in a row, loss scale " << u.scale_after
         << "; further skip messages are suppressed until a step succeeds.";
  } else if (u.scale_after < u.scale_before) {
    line << "Gradient overflow. Skipping step, loss scaler " << u.loss_id
         << " reducing loss scale to " << u.scale_after;
  } else {
    line << "Gradient overflow. Skipping step, loss scaler " << u.loss_id
         << " keeping loss scale " << u.scale_after
         << (u.scale_after <= ctx.scaler(u.loss_id).floor() ? " (its floor)" : " (hysteresis)");
  }
  log_line(line.str());
}

}  // namespace

void OptimizerGradState::refresh(torch::optim::Optimizer& optimizer) {
  const size_t count = count_params(optimizer);
  if (count == group_param_count) return;
  std::unordered_map<const c10::TensorImpl*, size_t> known;
  for (size_t i = 0; i < params.size(); ++i) known[params[i].master.unsafeGetTensorImpl()] = i;
  std::vector<ParamPair> refreshed;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = known.find(p.unsafeGetTensorImpl());
      if (it != known.end()) {
        refreshed.push_back(params[it->second]);
      } else if (master_weights && is_low_precision(p)) {  // added by add_param_group
        ParamPair pair{p, make_master(p)};
        p = pair.master;
        refreshed.push_back(pair);
      } else {
        refreshed.push_back({p, p});
      }
    }
  }
  params = std::move(refreshed);
  stash.assign(params.size(), at::Tensor());
  group_param_count = count;
}

bool resolve_pending(std::vector<std::shared_ptr<PendingUpdate>>& pending) {
  std::vector<at::Tensor> unread;
  for (const auto& u : pending) {
    if (!u->resolved) unread.push_back(u->snapshot);
  }
  if (!unread.empty()) {
    const at::Tensor host = at::cat(unread).cpu();  // the one host sync of the step
    g_host_syncs.fetch_add(1, std::memory_order_relaxed);
    const float* values = host.data_ptr<float>();
    size_t k = 0;
    for (const auto& u : pending) {
      if (u->resolved) continue;
      u->overflow = values[3 * k] > 0;
      u->scale_before = values[3 * k + 1];
      u->scale_after = values[3 * k + 2];
      u->resolved = true;
      u->snapshot = at::Tensor();
      ++k;
      log_overflow(*u);
    }
  }
  bool skip = false;
  std::vector<std::shared_ptr<PendingUpdate>> updates;
  updates.swap(pending);
  for (const auto& u : updates) {
    skip = skip || u->overflow;
    const LossScaler& scaler = u->context->scaler(u->loss_id);
    TORCH_CHECK(!(u->overflow && scaler.options().at_floor == AtFloor::kRaise &&
                  u->scale_before <= scaler.floor()),
                "amp: gradients overflowed with loss scaler ", u->loss_id,
                " already at its floor min_loss_scale=", scaler.floor(),
                ", so training cannot progress. Look for inf/NaN in the loss, inputs or "
                "weights, or lower the learning rate; set DynamicScaling::at_floor = "
                "AtFloor::kHold to keep skipping instead. This step was skipped.");
  }
  return skip;
}

}  // namespace detail

MixedPrecisionOptimizer::MixedPrecisionOptimizer(
    std::shared_ptr<torch::optim::Optimizer> wrapped, bool master_weights,
    const std::vector<std::pair<at::Tensor, at::Tensor>>& fp32_originals,
    std::shared_ptr<detail::Context> context)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              wrapped->defaults().clone()),
      wrapped_(std::move(wrapped)),
      grad_state_(std::make_unique<detail::OptimizerGradState>()) {
  param_groups_ = std::move(wrapped_->param_groups());
  wrapped_->param_groups().clear();
  state_ = std::move(wrapped_->state());
  wrapped_->state().clear();

  detail::OptimizerGradState& s = *grad_state_;
  s.context = context;
  s.master_weights = master_weights;
  if (master_weights) {
    std::unordered_map<const c10::TensorImpl*, at::Tensor> originals;
    for (const auto& [param, original] : fp32_originals) {
      originals[param.unsafeGetTensorImpl()] = original;
    }
    for (auto& group : param_groups_) {
      for (auto& p : group.params()) {
        if (!detail::is_low_precision(p)) {
          s.params.push_back({p, p});
          continue;
        }
        auto it = originals.find(p.unsafeGetTensorImpl());
        at::Tensor master = it != originals.end()
                                ? it->second.requires_grad_(p.requires_grad())
                                : detail::make_master(p);
        auto state = state_.find(p.unsafeGetTensorImpl());  // state made before initialize
        if (state != state_.end()) {
          auto moved = std::move(state->second);
          state_.erase(state);
          state_[master.unsafeGetTensorImpl()] = std::move(moved);
        }
        s.params.push_back({p, master});
        p = master;
      }
    }
    s.group_param_count = detail::count_params(*this);
    s.stash.assign(s.params.size(), at::Tensor());
  } else {
    s.refresh(*this);
  }
}

MixedPrecisionOptimizer::~MixedPrecisionOptimizer() = default;

bool MixedPrecisionOptimizer::has_master_weights() const { return grad_state_->master_weights; }

std::vector<MasterWeight> MixedPrecisionOptimizer::master_weights() const {
  std::vector<MasterWeight> out;
  for (const auto& pair : grad_state_->params) {
    if (pair.has_master()) out.push_back({pair.model, pair.master});
  }
  return out;
}

int64_t MixedPrecisionOptimizer::skipped_steps() const { return grad_state_->skipped_steps; }

template <class Fn>
void MixedPrecisionOptimizer::run_wrapped(Fn&& fn) const {
  auto* self = const_cast<MixedPrecisionOptimizer*>(this);  // swapped back before returning
  std::swap(wrapped_->param_groups(), self->param_groups_);
  std::swap(wrapped_->state(), self->state_);
  auto swap_back = c10::make_scope_exit([&] {
    std::swap(wrapped_->param_groups(), self->param_groups_);
    std::swap(wrapped_->state(), self->state_);
  });
  fn();
}

at::Tensor MixedPrecisionOptimizer::step(LossClosure closure) {
  TORCH_CHECK(!closure, "amp: step(closure) is not supported: a closure re-runs forward and "
              "backward inside step, outside amp's scale_loss guard. Compute the loss and "
              "backward under amp::scale_loss, then call step() without a closure.");
  detail::OptimizerGradState& s = *grad_state_;
  TORCH_CHECK(!s.in_guard, "amp: optimizer->step() inside a live amp::scale_loss guard; end the "
              "guard's scope (it unscales the gradients) before stepping.");
  TORCH_CHECK(!s.scaled_by, "amp: step() while gradients are still scaled by delay_unscale "
              "(loss_id ", s.scaled_by.value_or(0), "); the last micro-batch's scale_loss must "
              "use delay_unscale=false so the accumulated gradients are unscaled and checked.");
  // The optimizer's math runs on fp32 masters or the model's own dtypes: no
  // per-op casting (Apex disables casts around step too).
  disable_casts no_casts;
  s.refresh(*this);
  if (detail::resolve_pending(s.pending)) {
    ++s.skipped_steps;
    return {};
  }
  run_wrapped([&] { wrapped_->step(); });
  if (s.master_weights) {
    std::map<int, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> by_dtype;
    for (const auto& pair : s.params) {
      if (!pair.has_master()) continue;
      auto& [models, masters] = by_dtype[static_cast<int>(pair.model.scalar_type())];
      models.push_back(pair.model);
      masters.push_back(pair.master);
    }
    at::NoGradGuard no_grad;
    for (auto& [dtype, lists] : by_dtype) at::_foreach_copy_(lists.first, lists.second);
  }
  return {};
}

// Master weights are saved with the optimizer: reloading them (instead of
// rebuilding them from the rounded model) is what keeps a resumed O2 run
// bit-identical - Apex's "loss spike after reload".
void MixedPrecisionOptimizer::save(torch::serialize::OutputArchive& archive) const {
  run_wrapped([&] { wrapped_->save(archive); });
  if (!grad_state_->master_weights) return;
  torch::serialize::OutputArchive masters(archive.compilation_unit());
  const auto& params = grad_state_->params;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].has_master()) masters.write(std::to_string(i), params[i].master.detach());
  }
  archive.write("amp_masters", masters);
}

void MixedPrecisionOptimizer::load(torch::serialize::InputArchive& archive) {
  detail::OptimizerGradState& s = *grad_state_;
  s.refresh(*this);
  std::vector<std::pair<size_t, at::Tensor>> masters;
  torch::serialize::InputArchive saved;
  if (s.master_weights && archive.try_read("amp_masters", saved)) {
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (!s.params[i].has_master()) continue;
      at::Tensor value;
      TORCH_CHECK(saved.try_read(std::to_string(i), value), "amp: the optimizer state has no "
                  "master weight for parameter ", i, "; was it saved from the same model at the "
                  "same opt_level?");
      TORCH_CHECK(value.sizes() == s.params[i].master.sizes() && value.scalar_type() == at::kFloat,
                  "amp: saved master weight ", i, " is ", value.scalar_type(), value.sizes(),
                  ", expected Float", s.params[i].master.sizes());
      masters.emplace_back(i, value);
    }
  }
  run_wrapped([&] { wrapped_->load(archive); });
  at::NoGradGuard no_grad;
  for (const auto& [i, value] : masters) {
    s.params[i].master.copy_(value);
    s.params[i].model.copy_(value);
  }
}

int64_t host_syncs() { return detail::g_host_syncs.load(std::memory_order_relaxed); }

std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer) {
  const auto* amp_optimizer = dynamic_cast<const MixedPrecisionOptimizer*>(&optimizer);
  TORCH_CHECK(amp_optimizer != nullptr, "amp: master_params() needs an optimizer returned by "
              "amp::initialize.");
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

}  // namespace amp
