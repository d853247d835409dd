#include <amp/optimizer.h>

#include <amp/casting_scope.h>

#include "fused_step.h"
#include "gradient_lifecycle.h"
#include "optimizer_state_load.h"

#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <ATen/core/grad_mode.h>
#include <torch/serialize/archive.h>

namespace amp {
namespace detail {

GradientLifecycle& lifecycle_of(const torch::optim::Optimizer& optimizer) {
  const auto* amp_optimizer = dynamic_cast<const MixedPrecisionOptimizer*>(&optimizer);
  TORCH_CHECK(amp_optimizer != nullptr, "amp: got an optimizer that amp::initialize did not "
              "return. Pass the optimizer returned by amp::initialize (it replaces the one you "
              "created: std::tie(model, optimizer) = amp::initialize(model, optimizer, ...)).");
  return *amp_optimizer->lifecycle_;
}

}  // namespace detail

namespace {

// Groups from `from` on, for the wrapped optimizer to hold between steps:
// cloned options (what schedulers read and set), no parameters, so a stray
// step() or zero_grad() on the original optimizer changes nothing.
std::vector<torch::optim::OptimizerParamGroup> mirror(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, size_t from) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (size_t i = from; i < groups.size(); ++i) {
    out.emplace_back(std::vector<at::Tensor>{}, groups[i].options().clone());
  }
  return out;
}

bool has_learning_rate(const torch::optim::OptimizerOptions& options) {
  try {
    (void)options.get_lr();
    return true;
  } catch (const c10::Error&) {  // get_lr not implemented by a custom optimizer
    return false;
  }
}

}  // namespace

MixedPrecisionOptimizer::MixedPrecisionOptimizer(
    std::shared_ptr<torch::optim::Optimizer> wrapped, bool master_weights,
    const std::vector<std::pair<at::Tensor, at::Tensor>>& fp32_originals,
    std::shared_ptr<detail::Context> context, bool fused_step)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              wrapped->defaults().clone()),
      wrapped_(std::move(wrapped)),
      lifecycle_(std::make_unique<detail::GradientLifecycle>(context, master_weights)),
      fused_(fused_step ? detail::FusedStep::make(*wrapped_) : nullptr) {
  if (fused_) lifecycle_->on_settle([this](bool skipped) { fused_->settle(skipped, state_); });
  param_groups_ = std::move(wrapped_->param_groups());
  state_ = std::move(wrapped_->state());
  wrapped_->state().clear();
  detail::Fp32Originals originals;
  for (const auto& [param, original] : fp32_originals) {
    originals[param.unsafeGetTensorImpl()] = original;
  }
  lifecycle_->adopt(*this, originals);
  wrapped_->param_groups() = mirror(param_groups_, 0);
  shadow_groups_ = param_groups_.size();
  if (!param_groups_.empty() && has_learning_rate(param_groups_.front().options())) {
    for (const auto& group : param_groups_) synced_lrs_.push_back(group.options().get_lr());
  }
}

MixedPrecisionOptimizer::~MixedPrecisionOptimizer() = default;

bool MixedPrecisionOptimizer::has_master_weights() const { return lifecycle_->master_weights(); }

std::vector<MasterWeight> MixedPrecisionOptimizer::master_weights() const {
  std::vector<MasterWeight> out;
  for (const auto& slot : lifecycle_->slots()) {
    if (slot.has_master()) out.push_back({slot.model, slot.master});
  }
  return out;
}

// Runs `fn` with the real groups and state inside the wrapped optimizer.
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

// A scheduler made before initialize sets learning rates on the wrapped
// optimizer's mirror groups, one made after on this optimizer's groups: a
// rate that moved on either side since the last sync wins.
void MixedPrecisionOptimizer::sync_learning_rates() {
  auto& shadow = wrapped_->param_groups();
  TORCH_CHECK(shadow.size() == shadow_groups_, "amp: a parameter group was added to the "
              "optimizer passed to amp::initialize after initialize; add it to the optimizer "
              "that initialize returned (optimizer->add_param_group), which amp steps.");
  if (param_groups_.size() > shadow.size()) {  // add_param_group on this optimizer
    for (auto& group : mirror(param_groups_, shadow.size())) shadow.push_back(std::move(group));
    shadow_groups_ = shadow.size();
    if (!synced_lrs_.empty()) {
      while (synced_lrs_.size() < param_groups_.size()) {
        synced_lrs_.push_back(param_groups_[synced_lrs_.size()].options().get_lr());
      }
    }
  }
  for (size_t i = 0; i < synced_lrs_.size(); ++i) {
    auto& mine = param_groups_[i].options();
    auto& theirs = shadow[i].options();
    if (theirs.get_lr() != synced_lrs_[i]) {
      mine.set_lr(theirs.get_lr());
    } else if (mine.get_lr() != synced_lrs_[i]) {
      theirs.set_lr(mine.get_lr());
    }
    synced_lrs_[i] = mine.get_lr();
  }
}

at::Tensor MixedPrecisionOptimizer::step(LossClosure closure) {
  TORCH_CHECK(!closure, "amp: step(closure) is not supported: a closure re-runs forward and "
              "backward inside step, outside amp's scale_loss guard. Compute the loss and "
              "backward under amp::scale_loss, then call step() without a closure.");
  sync_learning_rates();
  // The optimizer's math runs on fp32 masters or the model's own dtypes: no
  // per-op casting (Apex disables casts around step too).
  disable_casts no_casts;
  if (fused_ && fused_->awaits_outcome()) lifecycle_->settle(/*wait=*/true);
  const bool device_may_decide = fused_ && fused_->suits(param_groups_, state_);
  auto plan = lifecycle_->begin_step(*this, device_may_decide);
  if (plan.found_inf.defined()) {
    fused_->step(param_groups_, state_, plan.found_inf);
  } else if (!plan.skip) {
    settle_fused_steps();  // the wrapped step reads and counts the state's steps
    run_wrapped([&] { wrapped_->step(); });
    if (fused_) fused_->reset();
  }
  lifecycle_->end_step(std::move(plan));
  return {};
}

void MixedPrecisionOptimizer::settle_fused_steps() const {
  if (lifecycle_->has_pending()) lifecycle_->settle(/*wait=*/true);
}

// Master weights are saved with the optimizer: reloading them (instead of
// rebuilding them from the rounded model) is what keeps a resumed O2 run
// bit-identical - Apex's "loss spike after reload".
void MixedPrecisionOptimizer::save(torch::serialize::OutputArchive& archive) const {
  settle_fused_steps();
  run_wrapped([&] { wrapped_->save(archive); });
  if (!lifecycle_->master_weights()) return;
  torch::serialize::OutputArchive masters(archive.compilation_unit());
  const auto& slots = lifecycle_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].has_master()) masters.write(std::to_string(i), slots[i].master.detach());
  }
  archive.write("amp_masters", masters);
}

void MixedPrecisionOptimizer::load(torch::serialize::InputArchive& archive) {
  settle_fused_steps();
  lifecycle_->adopt(*this);
  const auto& slots = lifecycle_->slots();
  std::vector<std::pair<size_t, at::Tensor>> masters;
  torch::serialize::InputArchive saved;
  if (lifecycle_->master_weights() && archive.try_read("amp_masters", saved)) {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (!slots[i].has_master()) continue;
      at::Tensor value;
      TORCH_CHECK(saved.try_read(std::to_string(i), value), "amp: the optimizer state has no "
                  "master weight for parameter ", i, "; was it saved from the same model at the "
                  "same opt_level?");
      TORCH_CHECK(value.sizes() == slots[i].master.sizes() && value.scalar_type() == at::kFloat,
                  "amp: saved master weight ", i, " is ", value.scalar_type(), value.sizes(),
                  ", expected Float", slots[i].master.sizes());
      masters.emplace_back(i, value);
    }
  }
  run_wrapped([&] { detail::load_optimizer_state(*wrapped_, archive); });
  if (fused_) fused_->reset();
  at::NoGradGuard no_grad;
  for (const auto& [i, value] : masters) {
    slots[i].master.copy_(value);
    slots[i].model.copy_(value);
  }
}

std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer) {
  (void)detail::lifecycle_of(optimizer);  // checks it is amp's
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

int64_t skipped_steps(const torch::optim::Optimizer& optimizer) {
  return detail::lifecycle_of(optimizer).skipped_steps();
}

bool last_step_skipped(const torch::optim::Optimizer& optimizer) {
  return detail::lifecycle_of(optimizer).last_step_skipped();
}

}  // namespace amp
