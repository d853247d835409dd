// SPDX-License-Identifier: BSD-3-Clause
#include <amp/optimizer.h>

#include "step/step_session.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace amp {
namespace {

detail::OptimizerStep& step_of(internal::OptimizerRef optimizer, const char* what) {
  return detail::require_step_session(what)->require_step(optimizer.get(), what);
}

}  // namespace

std::vector<at::Tensor> master_params(internal::OptimizerRef optimizer) {
  const detail::OptimizerStep& step = step_of(optimizer, "amp::master_params");
  std::vector<at::Tensor> out;
  for (const auto& group : step.optimizer().param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

int64_t skipped_steps(internal::OptimizerRef optimizer) {
  return step_of(optimizer, "amp::skipped_steps").skipped_steps();
}

bool last_step_skipped(internal::OptimizerRef optimizer) {
  return step_of(optimizer, "amp::last_step_skipped").last_step_skipped();
}

}  // namespace amp

namespace amp {

at::Tensor clip_grad_norm(internal::OptimizerRef optimizer, double max_norm) {
  const auto session = detail::require_step_session("amp::clip_grad_norm");
  detail::OptimizerStep& step = session->require_step(optimizer.get(), "amp::clip_grad_norm");
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0, "amp: clip_grad_norm needs a finite "
              "max_norm > 0, got ", max_norm, ".");
  TORCH_CHECK(step.state() != detail::OptimizerStep::State::kAccumulating, "amp: clip_grad_norm "
              "while the optimizer is ", detail::to_string(step.state()), ": its gradients are "
              "still scaled and held by amp. Clip after the last micro-batch's guard "
              "(delay_unscale=false).");
  TORCH_CHECK(!session->properties().step_in_backward, "amp: clip_grad_norm needs every gradient at once "
              "to scale them by the global norm, but step_in_backward applies each gradient during backward "
              "and frees it. Clip without step_in_backward.");
  std::vector<at::Tensor> grads;
  c10::Device device(c10::kCPU);
  for (const auto& group : step.optimizer().param_groups()) {
    for (const auto& p : group.params()) {
      device = p.device();
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  at::NoGradGuard no_grad;
  at::Tensor sum_of_squares = at::zeros({1}, at::TensorOptions(device).dtype(at::kFloat));
  if (!grads.empty()) {
    sum_of_squares = at::stack(at::_foreach_norm(grads, 2)).to(at::kFloat).pow(2).sum().reshape({1});
  }
  for (detail::StepParticipant* p : session->participants()) p->total_over_ranks(step.optimizer(), sum_of_squares);
  const at::Tensor total = sum_of_squares.sqrt().reshape({});
  if (!grads.empty()) at::_foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp_max(1.0));
  return total;
}

}  // namespace amp
