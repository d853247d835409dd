// SPDX-License-Identifier: BSD-3-Clause
#include "step/backward_step.h"

#include "autograd/accumulator_hooks.h"
#include "optim/fused_stepping.h"
#include "optim/unscale_plan.h"
#include "step/guard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <unordered_map>
#include <utility>

namespace amp::detail {
namespace {

using optim::internal::FusedStepping;
using optim::internal::UpdatePrecision;

class BackwardStep final : public GuardPart {
 public:
  explicit BackwardStep(Guard& guard);
  ~BackwardStep() override { hooks_.clear(); }

  // The guard ends well: what backward did not reach but held a gradient
  // from before the guard is stepped now.
  void before_unscale(Guard& guard) override;
  // Sharded: a bucket's averaged pieces, handed over by the reduction.
  void gradients_final(Guard&, const std::vector<at::Tensor>& params) override;
  void unwind(Guard&) noexcept override { hooks_.clear(); }

 private:
  // Where a guard's slot is stepped.
  struct Member {
    size_t optimizer = 0;  // index into the guard's steps
    size_t group = 0;
    uint64_t key = 0;  // its position among the optimizer's parameters
  };

  void on_gradient(size_t slot);
  void apply(size_t slot);

  Guard& guard_;
  std::vector<std::optional<UpdatePrecision>> precisions_;  // per optimizer
  std::vector<Member> members_;                             // per slot
  std::vector<bool> applied_;                               // per slot
  std::unordered_map<const c10::TensorImpl*, size_t> slot_of_;
  at::Tensor found_inf_;  // the unscale's flag, never read: a static scale never skips
  AccumulatorHooks hooks_;
};

BackwardStep::BackwardStep(Guard& guard) : guard_(guard) {
  const std::optional<UpdatePrecision> session_precision = update_precision(guard.session());
  std::unordered_map<const c10::TensorImpl*, Member> where;
  for (size_t k = 0; k < guard.steps().size(); ++k) {
    torch::optim::Optimizer& optimizer = guard.steps()[k]->optimizer();
    std::optional<UpdatePrecision> precision = session_precision;
    if (precision) precision->step = precision->rounder->next_step();  // as the optimizer's step() would
    pack_loaded_state(optimizer, precision ? &*precision : nullptr);
    precisions_.push_back(precision);
    uint64_t key = 0;
    for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      for (const at::Tensor& p : optimizer.param_groups()[g].params()) where.emplace(p.unsafeGetTensorImpl(), Member{k, g, key++});
    }
  }
  for (const GradSlot& slot : guard.slots()) {
    members_.push_back(where.at(slot.param.unsafeGetTensorImpl()));
    slot_of_.emplace(slot.param.unsafeGetTensorImpl(), slot_of_.size());
  }
  applied_.assign(guard.slots().size(), false);
  if (!guard.passthrough()) {
    found_inf_ = at::zeros({1}, guard.session().scaler(guard.options().loss_id).scale_tensor(guard.scaled_loss().device()).options());
  }
  // Sharded, the slots are the pieces, which no graph reaches: the
  // reduction hands them over (gradients_final) instead.
  for (size_t i = 0; i < guard.slots().size(); ++i) hooks_.add(guard.slots()[i].param, [this, i] { on_gradient(i); });
}

void BackwardStep::gradients_final(Guard&, const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    auto it = slot_of_.find(p.unsafeGetTensorImpl());
    if (it != slot_of_.end() && !applied_[it->second]) apply(it->second);
  }
}

void BackwardStep::on_gradient(size_t slot) {
  TORCH_CHECK(!applied_[slot], "amp: a parameter's gradient was accumulated twice inside one scale_loss guard "
              "(two backward passes through it), but step_in_backward applied its step at the first. Run each "
              "backward in a guard of its own, followed by step(), or sum the losses and run one backward.");
  apply(slot);
}

void BackwardStep::apply(size_t slot) {
  applied_[slot] = true;
  GradSlot& s = guard_.slots()[slot];
  const Member& m = members_[slot];
  // The gradient as the guard's unscale would leave it: with the aside
  // held from before the guard, in the slot's dtype, unscaled.
  std::vector<GradSlot> one{s};
  UnscalePlan plan(one);
  if (guard_.passthrough()) {
    plan.run({});
  } else {
    internal::LossScaling& scaler = guard_.session().scaler(guard_.options().loss_id);
    plan.run([&](const std::vector<at::Tensor>& scaled) { scaler.unscale(scaled, found_inf_); });
  }
  const at::Tensor& p = s.param;
  OptimizerStep& step = *guard_.steps()[m.optimizer];
  torch::optim::Optimizer& optimizer = step.optimizer();
  FusedStepping& stepping = step.fused_optimizer()->stepping();
  const UpdatePrecision* precision = precisions_[m.optimizer] ? &*precisions_[m.optimizer] : nullptr;
  TORCH_CHECK(stepping.suits_parameter(optimizer, optimizer.param_groups()[m.group], p, precision),
              "amp: step_in_backward cannot step a parameter of shape ", p.sizes(), " (", p.scalar_type(), " on ",
              p.device(), ") with its gradient (", p.grad().scalar_type(), p.grad().is_sparse() ? ", sparse" : "",
              "): amp's fused kernels need it dense, contiguous and of the parameter's dtype (FusedSGD does not "
              "step float16/bfloat16 parameters on the CPU). Make the gradient so, or leave step_in_backward unset.");
  optim::internal::FusedAttempt attempt =
      stepping.step_parameter(optimizer, m.group, m.key, p, precision);
  stepping.settle(attempt, /*skipped=*/false, optimizer.state());
  p.mutable_grad() = at::Tensor();  // the point: freed as soon as it is applied
  s.aside = at::Tensor();           // applied: nothing to give back on unwind
  step.release_aside(p);
}

void BackwardStep::before_unscale(Guard& guard) {
  hooks_.clear();
  for (size_t i = 0; i < guard.slots().size(); ++i) {
    const GradSlot& s = guard.slots()[i];
    if (!applied_[i] && (s.param.grad().defined() || s.aside.defined())) apply(i);
  }
}

}  // namespace

void BackwardStepParticipant::check_open(const Guard& guard) const {
  TORCH_CHECK(!guard.options().delay_unscale, "amp: delay_unscale=true accumulates gradients over several "
              "guards before one step, but step_in_backward applies the step during each guard's backward. "
              "Accumulate without step_in_backward, or train on the whole batch in one guard.");
  TORCH_CHECK(!guard.capturing(), "amp: step_in_backward steps from hooks during backward, which a CUDA graph "
              "capture of the guard does not record as such; capture without step_in_backward.");
}

std::unique_ptr<GuardPart> BackwardStepParticipant::open(Guard& guard) {
  return std::make_unique<BackwardStep>(guard);
}

}  // namespace amp::detail
