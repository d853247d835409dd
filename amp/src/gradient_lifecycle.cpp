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

bool GradientLifecycle::begin_step(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(!in_guard_, "amp: optimizer->step() inside a live amp::scale_loss guard; end the "
              "guard's scope (it unscales the gradients) before stepping.");
  TORCH_CHECK(!scaled_by_, "amp: step() while gradients are still scaled by delay_unscale "
              "(loss_id ", scaled_by_.value_or(0), "); the last micro-batch's scale_loss must "
              "use delay_unscale=false so the accumulated gradients are unscaled and checked.");
  adopt(optimizer);
  bool scratch = false;
  for (const ParamSlot& s : slots_) scratch = scratch || (s.has_master() && s.scratch().defined());
  const bool accumulated = holds_accumulated();
  TORCH_CHECK(accumulated || !scratch, "amp: step() found gradients on the model's "
              "low-precision parameters but none on the float32 master weights the optimizer "
              "steps: backward ran outside amp::scale_loss. With master weights (O2, O5) "
              "gradients reach the masters only through the guard; wrap backward in "
              "amp::scale_loss(loss, optimizer).");
  if (!accumulated) {
    verdicts_.clear();  // nothing left that they judged; stepping changes nothing
    return false;
  }
  bool skip = false;
  try {
    skip = read_verdicts(verdicts_);
  } catch (...) {  // an overflow at the floor with AtFloor::kRaise: the step is skipped
    verdicts_.clear();
    end_step(/*skipped=*/true);
    throw;
  }
  verdicts_.clear();
  return skip;
}

void GradientLifecycle::end_step(bool skipped) {
  last_step_skipped_ = skipped;
  if (skipped) ++skipped_steps_;
  if (!master_weights_ && !skipped) return;
  if (master_weights_ && !skipped) {  // masters into the model, one fused copy per model dtype
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
  for (ParamSlot& s : slots_) s.accumulator() = at::Tensor();
}

}  // namespace amp::detail
