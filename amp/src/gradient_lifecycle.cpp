#include "gradient_lifecycle.h"

#include "unscale_plan.h"

#include <amp/opt_levels.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>

namespace amp::detail {
namespace {

size_t count_params(const torch::optim::Optimizer& optimizer) {
  size_t n = 0;
  for (const auto& group : optimizer.param_groups()) n += group.params().size();
  return n;
}

}  // namespace

GradientLifecycle::GradientLifecycle(std::weak_ptr<Context> context, bool master_weights)
    : context_(std::move(context)), master_weights_(master_weights) {}

void GradientLifecycle::adopt(torch::optim::Optimizer& optimizer, const Fp32Originals& originals) {
  const size_t count = count_params(optimizer);
  if (count == adopted_count_) return;
  std::unordered_map<const c10::TensorImpl*, size_t> known;  // by the tensor the group holds
  for (size_t i = 0; i < slots_.size(); ++i) known[slots_[i].master.unsafeGetTensorImpl()] = i;
  std::vector<ParamSlot> adopted;
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (auto it = known.find(p.unsafeGetTensorImpl()); it != known.end()) {
        adopted.push_back(slots_[it->second]);
        continue;
      }
      if (!master_weights_ || !is_low_precision(p.scalar_type())) {
        adopted.push_back({p, p, {}});
        continue;
      }
      auto original = originals.find(p.unsafeGetTensorImpl());
      at::Tensor master = original != originals.end() ? original->second
                                                      : p.detach().to(at::kFloat);
      master.requires_grad_(p.requires_grad());
      if (auto s = state.find(p.unsafeGetTensorImpl()); s != state.end()) {  // made before initialize
        auto moved = std::move(s->second);
        state.erase(s);
        state[master.unsafeGetTensorImpl()] = std::move(moved);
      }
      adopted.push_back({p, master, {}});
      p = master;
    }
  }
  slots_ = std::move(adopted);
  adopted_count_ = count;
}

bool GradientLifecycle::holds_accumulated() const {
  for (const ParamSlot& s : slots_) {
    if (s.accumulator().defined()) return true;
  }
  return false;
}

void GradientLifecycle::check_can_open(int loss_id, bool delay_unscale) const {
  TORCH_CHECK(!in_guard_, "amp: an optimizer is already inside a live scale_loss guard; end "
              "that guard's scope before starting another over the same optimizer.");
  TORCH_CHECK(!scaled_by_ || *scaled_by_ == loss_id, "amp: gradient accumulation with "
              "delay_unscale is pending from loss_id ", scaled_by_.value_or(0), "; finish it "
              "(delay_unscale=false) with the same loss_id before scaling loss ", loss_id, ".");
  TORCH_CHECK(!delay_unscale || scaled_by_ || !holds_accumulated(),
              "amp: delay_unscale=true while the optimizer's gradients hold unscaled values; "
              "call zero_grad() before the first micro-batch of an accumulation.");
}

void GradientLifecycle::settle_before_guard() {
  // Gradients kept from a pending step are discarded if it was skipped, so
  // its outcome is needed now; without any, the guard need not wait.
  const bool kept = holds_accumulated();
  if (!kept) {
    for (PendingStep& p : pending_) p.gradients_live = false;
  }
  settle(/*wait=*/kept);
}

void GradientLifecycle::open() {
  for (ParamSlot& s : slots_) {
    if (s.has_master()) s.scratch() = at::Tensor();
    s.aside = std::exchange(s.accumulator(), at::Tensor());
  }
  bool accumulated = false;
  for (const ParamSlot& s : slots_) accumulated = accumulated || s.aside.defined();
  if (!accumulated) verdicts_.clear();
  in_guard_ = true;
}

void GradientLifecycle::plan_unscale(UnscalePlan& plan) {
  for (ParamSlot& s : slots_) plan.add(s, /*aside_scaled=*/scaled_by_.has_value());
}

void GradientLifecycle::commit(std::shared_ptr<OverflowVerdict> verdict,
                               std::optional<int> scaled_by) {
  for (ParamSlot& s : slots_) s.aside = at::Tensor();
  if (verdict) verdicts_.push_back(std::move(verdict));
  scaled_by_ = scaled_by;
  in_guard_ = false;
}

void GradientLifecycle::unwind() noexcept {
  for (ParamSlot& s : slots_) {
    if (s.has_master()) s.scratch() = at::Tensor();
    s.accumulator() = std::exchange(s.aside, at::Tensor());
  }
  in_guard_ = false;
}

GradientLifecycle::StepPlan GradientLifecycle::begin_step(torch::optim::Optimizer& optimizer,
                                                          bool device_may_decide) {
  TORCH_CHECK(!in_guard_, "amp: optimizer->step() inside a live amp::scale_loss guard; end the "
              "guard's scope (it unscales the gradients) before stepping.");
  TORCH_CHECK(!scaled_by_, "amp: step() while gradients are still scaled by delay_unscale "
              "(loss_id ", scaled_by_.value_or(0), "); the last micro-batch's scale_loss must "
              "use delay_unscale=false so the accumulated gradients are unscaled and checked.");
  settle(/*wait=*/false);
  adopt(optimizer);
  bool scratch = false;
  for (const ParamSlot& s : slots_) scratch = scratch || (s.has_master() && s.scratch().defined());
  const bool accumulated = holds_accumulated();
  TORCH_CHECK(accumulated || !scratch, "amp: step() found gradients on the model's "
              "low-precision parameters but none on the float32 master weights the optimizer "
              "steps: backward ran outside amp::scale_loss. With master weights (O2, O5) "
              "gradients reach the masters only through the guard; wrap backward in "
              "amp::scale_loss(loss, optimizer).");
  StepPlan plan;
  if (!accumulated) {
    verdicts_.clear();  // nothing left that they judged; stepping changes nothing
    return plan;
  }
  bool unread = !verdicts_.empty();
  for (const auto& v : verdicts_) unread = unread && !v->resolved;
  if (device_may_decide && unread) {
    plan.found_inf = combined_found_inf(verdicts_);
    plan.verdicts = std::exchange(verdicts_, {});
    return plan;
  }
  try {
    plan.skip = read_verdicts(verdicts_);
  } catch (...) {  // an overflow at the floor with AtFloor::kRaise: the step is skipped
    verdicts_.clear();
    StepPlan skipped;
    skipped.skip = true;
    end_step(std::move(skipped));
    throw;
  }
  verdicts_.clear();
  return plan;
}

void GradientLifecycle::end_step(StepPlan plan) {
  if (plan.found_inf.defined()) {
    // The kernel left the masters as they were if it skipped: copying them
    // rewrites the model's identical values.
    copy_masters_to_model();
    if (master_weights_) {
      for (ParamSlot& s : slots_) s.accumulator() = at::Tensor();
    }
    pending_.push_back({DeferredVerdicts(std::move(plan.verdicts)), !master_weights_});
    settle(/*wait=*/false);
    return;
  }
  if (!plan.skip) copy_masters_to_model();
  record_outcome(plan.skip, /*gradients_live=*/true);
  if (master_weights_) {
    for (ParamSlot& s : slots_) s.accumulator() = at::Tensor();
  }
}

void GradientLifecycle::settle(bool wait) {
  // A GPU run queues at most this many steps before waiting for the oldest.
  constexpr size_t kMostPending = 2;
  while (!pending_.empty() &&
         (wait || pending_.front().verdicts.ready() || pending_.size() > kMostPending)) {
    PendingStep step = std::move(pending_.front());
    pending_.pop_front();
    bool skipped = true;
    try {
      skipped = step.verdicts.resolve();
    } catch (...) {  // an overflow at the floor with AtFloor::kRaise: the step was skipped
      record_outcome(true, step.gradients_live);
      if (on_settle_) on_settle_(true);
      throw;
    }
    record_outcome(skipped, step.gradients_live);
    if (on_settle_) on_settle_(skipped);
  }
}

void GradientLifecycle::record_outcome(bool skipped, bool gradients_live) {
  last_step_skipped_ = skipped;
  if (skipped) {
    ++skipped_steps_;
    if (gradients_live) {
      for (ParamSlot& s : slots_) s.accumulator() = at::Tensor();
    }
  }
}

void GradientLifecycle::copy_masters_to_model() {
  if (!master_weights_) return;
  // One fused copy per model dtype.
  std::map<at::ScalarType, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> by_dtype;
  for (const ParamSlot& s : slots_) {
    if (!s.has_master()) continue;
    auto& [models, masters] = by_dtype[s.model.scalar_type()];
    models.push_back(s.model);
    masters.push_back(s.master);
  }
  at::NoGradGuard no_grad;
  for (auto& [dtype, lists] : by_dtype) at::_foreach_copy_(lists.first, lists.second);
}

int64_t GradientLifecycle::skipped_steps() {
  settle(/*wait=*/true);
  return skipped_steps_;
}

bool GradientLifecycle::last_step_skipped() {
  settle(/*wait=*/true);
  return last_step_skipped_;
}

}  // namespace amp::detail
